"""Sampling is lossless: spec-mode output follows the target's own sampling distribution.

A two-sample chi-square test compares thousands of completions from our decoder with as many
from `target.generate(do_sample=True)`, per position and for the joint first two tokens, on a
small-vocabulary model. The same test is shown to catch a deliberately wrong sampler.
"""

from collections import Counter

import pytest
import torch
from transformers import (AutoModelForCausalLM, LlamaConfig, LogitsProcessor, LogitsProcessorList,
                          MinNewTokensLengthLogitsProcessor, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                          SequenceBiasLogitsProcessor)

import batchspec.decoding.processors as processors
import batchspec.decoding.sampling as sampling
from batchspec.decoding import DecodeConfig, RowOptions, SamplingParams, decode_batch
from batchspec.decoding.engine import BatchDecoder
from batchspec.decoding.suffix_index import SuffixIndex
from batchspec.models import load_pair
from batchspec.tiny import perturbed

from policies import Scripted

VOCAB, SAMPLES, NEW_TOKENS, ALPHA = 12, 6000, 4, 1e-3
PROMPT = [1, 5, 7, 2, 9, 5, 7]  # "5 7" recurs: n-gram lookup proposes "2 9 5 7" at once
LOOKUP = (1, 3)
SETTINGS = {
    "t1": SamplingParams(temperature=1.0),
    "topk-topp": SamplingParams(temperature=0.8, top_k=6, top_p=0.9),
}


def chi2_two_sample(a: Counter, b: Counter) -> float:
    """p-value that samples a and b come from one distribution (bins under 10 counts merged)."""
    total_a, total_b = sum(a.values()), sum(b.values())
    bins, rare = [], [0, 0]
    for key in set(a) | set(b):
        if a[key] + b[key] < 10:
            rare[0], rare[1] = rare[0] + a[key], rare[1] + b[key]
        else:
            bins.append((a[key], b[key]))
    if sum(rare):
        bins.append(tuple(rare))
    stat = 0.0
    for count_a, count_b in bins:
        pooled = (count_a + count_b) / (total_a + total_b)
        for count, total in ((count_a, total_a), (count_b, total_b)):
            stat += (count - pooled * total) ** 2 / (pooled * total)
    dof = len(bins) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def p_values(ours: list[list[int]], theirs: list[list[int]]) -> dict[str, float]:
    """Per-position marginals and the joint of the first two tokens."""
    result = {
        f"position {i + 1}": chi2_two_sample(Counter(r[i] for r in ours), Counter(r[i] for r in theirs))
        for i in range(NEW_TOKENS)
    }
    result["first two"] = chi2_two_sample(Counter(tuple(r[:2]) for r in ours), Counter(tuple(r[:2]) for r in theirs))
    return result


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, initializer_range=0.2, bos_token_id=None, eos_token_id=None,
    )
    target = AutoModelForCausalLM.from_config(config).eval()
    draft = perturbed(target, noise=0.3, seed=1).eval()
    return target, draft


def earlier_samples(target, params, count: int = 64) -> SuffixIndex:
    """A suffix index of the target's own samples for PROMPT, drawn apart from those the test compares."""
    torch.manual_seed(7)
    ids = torch.tensor([PROMPT] * count)
    out = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=params.temperature,
                          top_k=params.top_k or None, top_p=params.top_p, max_new_tokens=NEW_TOKENS, pad_token_id=0)
    index = SuffixIndex()
    for row in out[:, len(PROMPT) :].tolist():
        index.add(row)
    return index


@pytest.fixture(scope="module")
def target_samples(models):
    """The target's own sampling, SAMPLES times, per setting."""
    target, _ = models
    samples = {}
    for name, params in SETTINGS.items():
        torch.manual_seed(123)
        ids = torch.tensor([PROMPT] * SAMPLES)
        out = target.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=params.temperature,
            top_k=params.top_k or None, top_p=params.top_p, max_new_tokens=NEW_TOKENS,
            pad_token_id=0,
        )
        samples[name] = out[:, len(PROMPT) :].tolist()
    return samples


def our_samples(target, draft, params, gamma=3, seed=0, policy=None, ngram=None, suffix=None, static=False):
    config = DecodeConfig(max_new_tokens=NEW_TOKENS, sampling=params, gamma=gamma, seed=seed, ngram=ngram,
                          suffix=suffix, static_cache=static)
    out = decode_batch(target, draft, [PROMPT] * SAMPLES, list(range(SAMPLES)), config, policy=policy)
    return out, [r.token_ids for r in out.rows]


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("mode", ["spec", "ar", "switching", "ngram", "hybrid", "suffix", "static"])
def test_sampling_matches_target(models, target_samples, setting, mode):
    """switching: plain and speculative steps alternate inside each completion (gammas 0, 2, 0, 1).
    static: the switching steps on static caches.
    ngram: deterministic proposals (one-hot q), and rows without a match beside them; hybrid:
    one-hot q for looked-up rows, the draft's q for the others, in one batch; suffix: the same
    from an index of earlier completions (other samples of the target's, drawn apart)."""
    target, draft = models
    policy = Scripted([0, 2, 0, 1], gamma_max=3) if mode in ("switching", "static") else None
    draft = None if mode in ("ar", "ngram", "suffix") else draft
    suffix = earlier_samples(target, SETTINGS[setting]) if mode == "suffix" else None
    out, ours = our_samples(target, draft, SETTINGS[setting], policy=policy,
                            ngram=LOOKUP if mode in ("ngram", "hybrid", "suffix") else None, suffix=suffix,
                            static=mode == "static")
    if mode != "ar":  # proposals accepted and (far more with n-gram lookup) rejected: both paths run a lot
        rates = [r.stats["acceptance_rate"] for r in out.rows if r.stats["draft_tokens"]]
        assert 0.02 < sum(rates) / len(rates) < 0.9
    if mode == "hybrid":
        assert all(sum(r.stats[k] for r in out.rows) > SAMPLES for k in ("model_steps", "ngram_steps"))
    p = p_values(ours, target_samples[setting])
    assert min(p.values()) > ALPHA, p


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_wrong_sampler_is_caught(models, target_samples, setting, drafter, monkeypatch):
    """Drawing the rejected position from p instead of norm(max(0, p - q)) biases the output
    (for a one-hot q: the rejected token drawn again)."""
    target, draft = models
    monkeypatch.setattr(sampling, "residual", lambda p_n, q_n: p_n)
    _, ours = our_samples(target, draft if drafter == "model" else None, SETTINGS[setting],
                          ngram=LOOKUP if drafter == "ngram" else None)
    p = p_values(ours, target_samples[setting])
    assert min(p.values()) < ALPHA, p


PROCESSED = RowOptions(stop_token_ids=(2,), min_tokens=NEW_TOKENS, repetition_penalty=2.0, frequency_penalty=0.8,
                       presence_penalty=0.5, logit_bias={4: 1.5, 6: -1.0})
PROCESSED_SAMPLING = SamplingParams(temperature=1.0, min_p=0.1)


class OpenAIPenalties(LogitsProcessor):
    """The test's own reference: OpenAI's frequency/presence penalties on the output tokens."""

    def __call__(self, input_ids, scores):
        output = input_ids[:, len(PROMPT) :]
        counts = torch.zeros_like(scores).scatter_add_(1, output, torch.ones_like(output, dtype=scores.dtype))
        return scores - PROCESSED.frequency_penalty * counts - PROCESSED.presence_penalty * (counts > 0)


@pytest.fixture(scope="module")
def processed_target_samples(models):
    """generate's sampling with transformers' processors for PROCESSED, in our order."""
    target, _ = models
    processors = LogitsProcessorList([
        SequenceBiasLogitsProcessor([[[t], b] for t, b in PROCESSED.logit_bias.items()]),
        RepetitionPenaltyLogitsProcessor(PROCESSED.repetition_penalty),
        OpenAIPenalties(),
        MinNewTokensLengthLogitsProcessor(len(PROMPT), PROCESSED.min_tokens, list(PROCESSED.stop_token_ids)),
        MinPLogitsWarper(PROCESSED_SAMPLING.min_p),
    ])
    torch.manual_seed(321)
    ids = torch.tensor([PROMPT] * SAMPLES)
    out = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=None,
                          max_new_tokens=NEW_TOKENS, pad_token_id=0, logits_processor=processors)
    return out[:, len(PROMPT) :].tolist()


def processed_samples(target, draft, ngram=None):
    config = DecodeConfig(max_new_tokens=NEW_TOKENS, sampling=PROCESSED_SAMPLING, gamma=3, ngram=ngram)
    out = decode_batch(target, draft, [PROMPT] * SAMPLES, list(range(SAMPLES)), config, [PROCESSED] * SAMPLES)
    return [r.token_ids for r in out.rows]


@pytest.mark.parametrize("mode", ["spec", "ar", "ngram"])
def test_sampling_with_penalties_bias_and_min_p_matches_target(models, processed_target_samples, mode):
    target, draft = models
    ours = processed_samples(target, draft if mode == "spec" else None, LOOKUP if mode == "ngram" else None)
    assert all(2 not in row for row in ours)  # min_tokens masked the stop id at every position
    p = p_values(ours, processed_target_samples)
    assert min(p.values()) > ALPHA, p


def test_unprocessed_q_stays_lossless(models, processed_target_samples, monkeypatch):
    """Any q is a valid proposal distribution as long as the proposals are drawn from the q the
    acceptance test is given: a draft whose logits are left unprocessed only lowers acceptance."""
    target, draft = models
    monkeypatch.setattr(BatchDecoder, "process_draft", lambda self, logits, proposals: logits)
    p = p_values(processed_samples(target, draft), processed_target_samples)
    assert min(p.values()) > ALPHA, p


def test_processing_blind_to_the_proposals_is_caught(models, processed_target_samples, monkeypatch):
    """Processing position i as if the proposals before it were not in the context (p and q
    alike) samples another distribution: the same two-sample test fails."""
    target, draft = models
    monkeypatch.setattr(processors, "prefix_counts",
                        lambda tokens, first, vocab: torch.zeros(tokens.shape[0], tokens.shape[1] - first + 1, vocab))
    p = p_values(processed_samples(target, draft), processed_target_samples)
    assert min(p.values()) < ALPHA, p


@pytest.mark.parametrize("gamma", [None, 3])
def test_row_output_does_not_depend_on_batch_mates(tiny_pair, gamma):
    target_path, draft_path = tiny_pair("llama")
    pair = load_pair(str(target_path), str(draft_path), dtype="float32", device="cpu")
    draft = pair.draft if gamma else None
    prompts = {"a": [5, 6, 7], "b": [9] * 40, "c": [11, 12], "d": list(range(20, 90))}
    config = DecodeConfig(max_new_tokens=24, sampling=SamplingParams(temperature=1.0), gamma=gamma or 1, seed=42)

    def run(ids, limits=None):
        options = limits and [RowOptions(max_new_tokens=k) for k in limits]
        out = decode_batch(pair.target, draft, [prompts[i] for i in ids], ids, config, options)
        return {i: r.token_ids for i, r in zip(ids, out.rows)}

    together = run(["a", "b", "c", "d"])
    limits = [24, 6, 15, 9]  # rows end at different steps and leave the batch
    assert run(["a", "b", "c", "d"], limits) == {k: together[k][:limit] for k, limit in zip(together, limits)}
    assert run(["d", "c"]) == {k: together[k] for k in ("d", "c")}
    assert run(["b"]) == {"b": together["b"]}
    other_seed = decode_batch(pair.target, draft, [prompts["b"]], ["b"], DecodeConfig(
        max_new_tokens=24, sampling=config.sampling, gamma=config.gamma, seed=43)).rows[0].token_ids
    assert other_seed != together["b"]  # the seed matters: the check above is not vacuous


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_greedy_takes_the_first_of_tied_highest_logits(dtype):
    """Greedy picks what argmax picks, ties included (they are common in bfloat16)."""
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0], [5.0, 5.0, 5.0, 5.0], [0.0, 1.0, 2.0, 2.0]], dtype=dtype)
    assert sampling.greedy(logits).tolist() == [1, 0, 2]
    wide = (torch.randn(8, 3, 49152, generator=torch.Generator().manual_seed(0)) * 3).round().to(dtype)
    assert torch.equal(sampling.greedy(wide), wide.argmax(-1))
