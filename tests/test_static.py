"""Static caches (kv_cache.StaticKV) and compiled step forwards (decoding/compiled.py): the same
output as the target alone, every drafter and model kind; buffers that grow, roll back, compact."""

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from batchspec.decoding import DecodeConfig, decode_batch
from batchspec.decoding.compiled import Compiled
from batchspec.decoding.engine import BatchDecoder
from batchspec.decoding.kv_cache import BatchKV, StaticKV, padded
from batchspec.memory import cache_bytes
from batchspec.models import load_pair
from batchspec.tiny import perturbed

from policies import Scripted

from test_greedy import LENGTHS, LOOKUP, MAX_NEW, SWITCHING, random_prompts
from test_greedy import case  # noqa: F401  (the fixture: the greedy tests' rows and the target alone's output)
from test_rollback import CASES, assert_caches_hold_accepted_prefixes

MODES = {  # drafts, config settings, policy script
    "ar": (None, {}, None),
    "model": ("draft", {"gamma": 3}, None),
    "switching": ("draft", {}, SWITCHING),
    "tree": ("draft", {"tree_width": 2}, SWITCHING),
    "several": ("several", {}, SWITCHING),
    "hybrid": ("draft", {"ngram": LOOKUP}, SWITCHING),
    "ngram": (None, {"ngram": LOOKUP}, SWITCHING),
}


def static_decode(pair, prompts, mode, **settings):
    """Decode on static caches; asserts that finished rows stayed in the buffers, inert, before
    the buffers shrank to fewer rows."""
    drafts, kwargs, script = MODES[mode]
    draft = {"draft": pair.draft, "several": [pair.draft, perturbed(pair.target, 0.03, seed=9)], None: None}[drafts]
    trees = kwargs.get("tree_width", 1) > 1 or drafts == "several"
    policy = Scripted(script, gamma_max=8, trees=trees) if script else None
    config = DecodeConfig(max_new_tokens=MAX_NEW, eos_token_ids=pair.eos_token_ids, **kwargs, **settings)
    decoder = BatchDecoder(pair.target, draft, prompts, list(range(len(prompts))), config, policy=policy)
    kv, inert, shrunk = decoder.target_kv, False, False
    assert isinstance(kv, StaticKV)
    while not decoder.done:
        decoder.step()
        inert |= len(kv.mask) < kv.buffer_rows
        shrunk |= kv.buffer_rows < len(prompts)
    assert inert and shrunk or len(prompts) < 3
    return decoder.output()


@pytest.mark.parametrize("mode", MODES)
def test_static_cache_greedy_equals_target_alone(case, mode):  # noqa: F811
    family, pair, prompts, expected = case
    out = static_decode(pair, prompts, mode, static_cache=True)
    assert [r.token_ids for r in out.rows] == expected
    assert out.stats["static_cache"]


@pytest.mark.parametrize("family", ["llama", "gemma2"])
@pytest.mark.parametrize("gammas,width", [(SWITCHING, 1), (SWITCHING, 2)], ids=["switching", "tree-switching"])
@torch.inference_mode()
def test_static_caches_hold_each_rows_accepted_prefix(tiny_pair, family, gammas, width):
    """After every step (compacting at every one), the static buffers' written slots give each row
    a clean forward's logits: rollback by the write offset, compaction in place."""
    target_path, draft_path = tiny_pair(family, **CASES[family])
    pair = load_pair(str(target_path), str(draft_path), dtype="float32", device="cpu")
    prompts = random_prompts(len(pair.tokenizer), LENGTHS[:10], seed=3)
    config = DecodeConfig(max_new_tokens=30, gamma_max=4, compact_at=0.0, tree_width=width, static_cache=True)
    decoder = BatchDecoder(pair.target, pair.draft, prompts, list(range(len(prompts))), config,
                           policy=Scripted(gammas, gamma_max=4, trees=width > 1))
    assert isinstance(decoder.target_kv, StaticKV) and isinstance(decoder.drafter.kv, StaticKV)
    for _ in gammas:
        decoder.step()
        assert_caches_hold_accepted_prefixes(decoder, pair, prompts, decoder.drafter)
        assert decoder.target_kv.length <= decoder.target_kv.capacity
    assert decoder.totals["compactions"] > 0


@torch.inference_mode()
def test_a_static_cache_grows_when_a_forward_would_overrun_it(tiny_pair):
    """A buffer too short for the prompts, then for the tokens after them, moves to the next
    bucket and holds what a dynamic cache holds."""
    target_path, _ = tiny_pair("llama")
    model = load_pair(str(target_path), None, dtype="float32", device="cpu").target
    prompts = random_prompts(model.config.vocab_size, [70, 3, 20], seed=5)
    ids, mask = padded(prompts, "cpu")
    static, dynamic = StaticKV(model, 3, torch.device("cpu"), capacity=8), BatchKV(model, 3, torch.device("cpu"))
    assert static.capacity == 64
    for kv in (static, dynamic):
        kv.forward(ids, mask)
    assert static.capacity == 128
    for _ in range(30):  # past 128 slots
        step = torch.randint(0, model.config.vocab_size, (3, 3))
        torch.testing.assert_close(static.forward(step), dynamic.forward(step), atol=1e-5, rtol=1e-5)
    assert static.capacity == 256 and static.length == dynamic.length == 160


@pytest.mark.parametrize("case", ["llama"], indirect=True)  # one family: compiling costs seconds a shape
def test_ar_and_spec_compiled_equal_the_target_alone(case):  # noqa: F811
    """Compiled step forwards (compiling at once): greedy ar and speculation equal the target
    alone; compiling is timed."""
    family, pair, prompts, expected = case
    compiled = Compiled(slots=4, after=0.0)  # every shape of up to 4 slots compiles at once
    for mode in ("ar", "model"):
        out = static_decode(pair, prompts[:2], mode, compiled=compiled)
        assert [r.token_ids for r in out.rows] == expected[:2]
    print(compiled.summary())
    assert compiled.compile_seconds > 0 and len(compiled.forwards) == 2  # the target's and the draft's


def test_a_shape_compiles_once_its_eager_forwards_cost_as_much(monkeypatch):
    """Per shape, eager until its forwards have cost `after` seconds, then compiled (timed), its
    position ids given fresh strides; forwards wider than a step's slots stay the model's own."""
    compiles = []
    monkeypatch.setattr(torch, "compile", lambda forward, **settings: compiles.append(settings) or forward)
    clock = iter(range(100))
    monkeypatch.setattr("batchspec.decoding.compiled.time.perf_counter", lambda: next(clock))

    class Echo(torch.nn.Module):
        def forward(self, position_ids):
            return SimpleNamespace(logits=position_ids)

    model, compiled = Echo(), Compiled(slots=4, after=2.0)
    x = {"position_ids": torch.arange(10).reshape(2, 5)[:, -1:]}  # a [2, 1] slice: its row stride is 5
    assert compiled.forward(model, (1, 5, 64)) is None  # a prefill's width
    for _ in range(2):  # each call "takes" 1 s
        compiled.forward(model, (1, 1, 64))(**x)
    compiled.forward(model, (2, 1, 64))(**x)  # another shape: its own account
    assert compiles == []
    compiled.forward(model, (1, 1, 64))(**x)  # the first compiled call: counted as compiling
    out = compiled.forward(model, (1, 1, 64))(**x)
    assert compiles == [{"dynamic": False, "mode": None}]
    assert out.logits.tolist() == [[4], [9]] and out.logits.stride() == (1, 1)
    assert compiled.summary() == {"compiled_shapes": 1, "compile_seconds": 1.0, "eager_seconds": 3.0}


@torch.inference_mode()
def test_the_memory_estimate_is_what_static_buffers_take(tiny_pair):
    target_path, draft_path = tiny_pair("qwen2")
    pair = load_pair(str(target_path), str(draft_path), dtype="float32", device="cpu")
    prompts = random_prompts(len(pair.tokenizer), [5, 9, 2])
    decoder = BatchDecoder(pair.target, pair.draft, prompts, [0, 1, 2], DecodeConfig(max_new_tokens=8, gamma=2,
                                                                                      static_cache=True))
    decoder.step()
    decoder.step()  # the draft's buffers too
    for kv in (decoder.target_kv, decoder.drafter.kv):
        held = sum(t.nbytes for layer in kv.layers for t in (layer.keys, layer.values))
        assert held == cache_bytes(kv.model, kv.buffer_rows, kv.capacity)


def test_a_batch_of_256_rows(tiny_pair):
    """--batch-size 256 on static caches: each row as in batches of 16 on dynamic ones."""
    target_path, draft_path = tiny_pair("llama")
    pair = load_pair(str(target_path), str(draft_path), dtype="float32", device="cpu")
    prompts = random_prompts(len(pair.tokenizer), [3 + i % 29 for i in range(256)], seed=4)
    config = DecodeConfig(max_new_tokens=6, gamma=3)
    wide = decode_batch(pair.target, pair.draft, prompts, list(range(256)), replace(config, static_cache=True))
    assert wide.stats["static_cache"]
    for start in range(0, 256, 16):
        part = decode_batch(pair.target, pair.draft, prompts[start : start + 16], list(range(16)), config)
        assert [r.token_ids for r in part.rows] == [r.token_ids for r in wide.rows[start : start + 16]]


@pytest.mark.parametrize("case", ["llama"], indirect=True)
def test_a_compiled_step_reads_the_device_once(case):  # noqa: F811
    """Over shapes compiled already (a first batch compiled them), every step of the same batch
    again reads the device once, as an eager step does."""
    from test_syncs import FunctionReads, OpReads

    family, pair, prompts, expected = case
    compiled = Compiled(slots=4, after=0.0)
    static_decode(pair, prompts[:2], "model", compiled=compiled)
    shapes = len(compiled.shapes)
    config = DecodeConfig(max_new_tokens=MAX_NEW, eos_token_ids=pair.eos_token_ids, gamma=3, compiled=compiled)
    decoder = BatchDecoder(pair.target, pair.draft, prompts[:2], [0, 1], config)
    steps = []
    while not decoder.done:
        with FunctionReads() as calls, OpReads() as ops:
            decoder.step()
        steps.append(calls.counts + ops.counts)
    assert len(compiled.shapes) == shapes  # nothing compiled while counting
    assert len(steps) >= 5 and all(reads == {"tolist": 1} for reads in steps), steps
