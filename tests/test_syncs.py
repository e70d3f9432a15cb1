"""One host sync per step: every step reads the device exactly once, whatever gamma it took,
whichever rows it finished. Reads are counted where torch exposes them (tolist, item, bool, int,
float, and the aten ops that read back a size or a scalar), so this holds on a CPU run as it
would on a GPU, where each read stalls the launch queue."""

import collections
from dataclasses import replace

import pytest
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from batchspec.decoding import DecodeConfig, RowOptions, SamplingParams
from batchspec.decoding.engine import BatchDecoder
from batchspec.decoding.kv_cache import StaticKV
from batchspec.models import load_pair

from policies import Scripted
from test_greedy import random_prompts

READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy"}
READING_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_consecutive"}


class FunctionReads(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


class OpReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name in READING_OPS:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


MODES = ["auto", "switching", "ar", "ngram", "hybrid", "options", "tree",  # tree: with options
         "even", "single",  # rows of one length (ar), one row (switching): the model's own causal mask
         "static-switching", "static-tree"]  # on static caches: buffers rows leave inert, then shrink
CASES = [(family, mode) for family in ("llama", "mistral") for mode in MODES] + [
    ("bart", mode) for mode in ("switching", "hybrid", "options")]  # an encoder–decoder, forced EOS


@pytest.mark.parametrize("family, mode", CASES)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_step_reads_the_device_once(tiny_pair, family, mode, temperature):
    static, mode = mode.startswith("static-"), mode.removeprefix("static-")
    target, draft = tiny_pair(family, **({"window": 12} if family == "mistral" else {}))
    pair = load_pair(str(target), str(draft), dtype="float32", device="cpu")
    lengths = {"even": [9, 9, 9, 9], "single": [17]}.get(mode, [3, 17, 1, 9])
    prompts = random_prompts(len(pair.tokenizer), lengths)
    dense = mode in ("even", "single")  # the model makes its own causal mask
    config = DecodeConfig(max_new_tokens=12, eos_token_ids=pair.eos_token_ids, gamma_max=4,
                          compact_at=1.0 if dense else 0.3,  # else the caches are compacted, the draft's too
                          sampling=SamplingParams(temperature=temperature),
                          ngram=(1, 3) if mode in ("ngram", "hybrid") else None, tree_width=3 if mode == "tree" else 1,
                          static_cache=static)
    scripted = mode in ("switching", "ngram", "hybrid", "options", "tree", "single")
    policy = Scripted([0, 3, 0, 0, 4, 1], gamma_max=4, trees=mode == "tree") if scripted else None
    draft = pair.draft if mode in ("auto", "switching", "hybrid", "options", "tree", "single") else None
    options = [RowOptions(max_new_tokens=k) for k in (12, 5, 9, 2)]  # rows finish at different steps
    if mode == "single":
        options = [RowOptions(max_new_tokens=12, ignore_eos=True)]  # enough steps
    if mode in ("options", "tree"):  # stop strings (rows end on the host), logprobs, processing
        options = [replace(o, stop=("e", "zz") if b else (), logprobs=2, repetition_penalty=1.2, frequency_penalty=0.5,
                           min_tokens=1, logit_bias={5: 1.0}) for b, o in enumerate(options)]
    decoder = BatchDecoder(pair.target, draft, prompts, list(range(len(prompts))), config, options, policy,
                           pair.tokenizer)
    assert (decoder.target_kv.dense and decoder.target_kv.maskless) == dense
    assert isinstance(decoder.target_kv, StaticKV) == static
    steps = []
    while not decoder.done:
        with FunctionReads() as calls, OpReads() as ops:
            decoder.step()
        steps.append(calls.counts + ops.counts)
    assert len(steps) >= 5 and all(reads == {"tolist": 1} for reads in steps), steps
    if mode in ("switching", "tree", "hybrid") and family != "bart":  # the caches were compacted, the draft's too
        assert decoder.totals["compactions"]
    assert (decoder.target_kv.dense and decoder.target_kv.maskless) == dense  # a row alone, or rows of one length
    # decoded plainly, stay dense
    timed = decoder.policy.costs.cells  # the steps were timed all the same: (B, gamma, tree) -> seconds
    assert mode != "auto" or (4, 0, False) in timed and {rows for rows, _, _ in timed} <= {1, 2, 3, 4}
