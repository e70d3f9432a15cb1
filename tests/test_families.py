"""More architectures: greedy spec (chains and trees, a fixed gamma and steps that switch between
plain and speculative ones, on dynamic and static caches) and ar equal the target alone on tiny
random models.

Where an architecture has sliding-window layers, the window (12) is far shorter than the rows.
"""

from dataclasses import replace

import pytest

from batchspec.decoding import DecodeConfig, decode_batch
from batchspec.decoding.kv_cache import uses_alibi
from batchspec.decoding.seq2seq import static_problem
from batchspec.models import load_pair

from policies import Scripted
from test_greedy import LENGTHS, SWITCHING, random_prompts, reference

FAMILIES = [  # sliding windows: mixtral, gemma3_text, phi3, cohere2, starcoder2, gpt_oss, ministral, olmo3, exaone4
    "mixtral", "gemma", "gemma3_text", "phi", "phi3", "qwen2_moe", "qwen3", "qwen3_moe", "cohere", "cohere2",
    "starcoder2", "olmo2", "olmo3", "olmoe", "exaone4", "gpt_neox", "falcon", "bloom", "opt", "gpt_oss", "gptj",
    "codegen", "gpt_bigcode", "ministral", "smollm3", "granite", "granitemoe", "stablelm", "persimmon", "helium",
    "glm", "nemotron", "xglm", "biogpt",
]
MAX_NEW = 24


@pytest.mark.parametrize("family", FAMILIES)
def test_spec_and_ar_equal_target_alone(family, tiny_pair):
    target_path, draft_path = tiny_pair(family, window=12)
    pair = load_pair(str(target_path), str(draft_path), dtype="float32", device="cpu")
    prompts = random_prompts(len(pair.tokenizer), LENGTHS[:9])
    expected = [reference(pair.target, p, pair.eos_token_ids, MAX_NEW) for p in prompts]
    config = DecodeConfig(max_new_tokens=MAX_NEW, eos_token_ids=pair.eos_token_ids, gamma=4)
    for draft, width, static in ((pair.draft, 1, False), (None, 1, False), (pair.draft, 3, False),
                                 (pair.draft, 1, True), (pair.draft, 3, True)):
        tree = replace(config, tree_width=width, static_cache=static)
        if width > 1 and uses_alibi(pair.target.config):  # its biases come from a 2D mask: no tree mask
            with pytest.raises(ValueError, match="ALiBi"):
                decode_batch(pair.target, draft, prompts, list(range(len(prompts))), tree)
            continue
        out = decode_batch(pair.target, draft, prompts, list(range(len(prompts))), tree)
        assert [r.token_ids for r in out.rows] == expected
        assert out.stats["static_cache"] == (static and static_problem(pair.target) is None)
    switching = Scripted(SWITCHING, gamma_max=8)  # the draft sits out plain steps, then reads them with holes
    out = decode_batch(pair.target, pair.draft, prompts, list(range(len(prompts))), config, policy=switching)
    assert [r.token_ids for r in out.rows] == expected
    histograms = [r.stats["gamma_histogram"] for r in out.rows]
    assert all(h[0] and sum(h[1:]) for h in histograms if sum(h) > 2)  # plain and speculative steps in a row
    even = random_prompts(len(pair.tokenizer), [30, 30], seed=1)  # no pad: the cache starts dense
    for rows, wanted in ((prompts[1:2], expected[1:2]),  # one row: no hole either, the model's own mask
                         (even, [reference(pair.target, p, pair.eos_token_ids, MAX_NEW) for p in even])):
        for draft in (pair.draft, None):
            out = decode_batch(pair.target, draft, rows, list(range(len(rows))), config)
            assert [r.token_ids for r in out.rows] == wanted
