"""Per-row generation options under speculation, greedy, float32: processed rows equal the target
alone with the same transformers processor (repetition_penalty, min_new_tokens, sequence_bias),
OpenAI's penalties equal --mode ar, stop strings cut where the target alone's text first holds
one, and logprobs equal ar's and a plain forward's."""

import random

import pytest
import torch

from batchspec.decoding import DecodeConfig, RowOptions, decode_batch
from batchspec.decoding.suffix_index import SuffixIndex
from batchspec.models import load_pair

MAX_NEW = 32
LENGTHS = [5, 40, 1, 17, 9, 60, 3, 25]
DRAFTERS = {"model": dict(gamma=3), "hybrid": dict(gamma=None, ngram=(1, 3)), "ngram": dict(gamma=4, ngram=(1, 3)),
            "suffix": dict(gamma=4, ngram=(1, 3)),  # a fresh index per batch: its rows' completions as they end
            "tree": dict(gamma=3, tree_width=3)}  # tree: each slot processed after its own ancestors


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def pair(request, tiny_pair):
    return load_pair(*map(str, tiny_pair(request.param)), dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def prompts(pair):
    rng = random.Random(1)
    return [[rng.randrange(3, len(pair.tokenizer)) for _ in range(n)] for n in LENGTHS]


def generate(pair, prompt, eos_ids=(), **processing) -> list[int]:
    """The target alone on one row, with transformers' own processors."""
    ids = torch.tensor([prompt])
    out = pair.target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW,
                               eos_token_id=list(eos_ids) or None, pad_token_id=0, **processing)
    return out[0, len(prompt) :].tolist()


def run(pair, prompts, options, drafter="model", draft=None, **config):
    """decode_batch greedy; drafter: a DRAFTERS key or "ar"; config: more DecodeConfig fields."""
    settings = DRAFTERS.get(drafter, {}) | config | ({"suffix": SuffixIndex()} if drafter == "suffix" else {})
    config = DecodeConfig(max_new_tokens=MAX_NEW, eos_token_ids=pair.eos_token_ids, **settings)
    draft = draft or (pair.draft if drafter in ("model", "hybrid", "tree") else None)
    return decode_batch(pair.target, draft, prompts, list(range(len(prompts))), config, options,
                        tokenizer=pair.tokenizer)


@pytest.fixture(scope="module")
def plain(pair, prompts):
    """Each row's unprocessed greedy output, without EOS."""
    return [generate(pair, p) for p in prompts]


@pytest.fixture(scope="module")
def processed(pair, prompts, plain):
    """Per row: its options and, where transformers has the processor, generate's tokens with it."""
    first, end = [row[0] for row in plain], [row[2] for row in plain]  # a row's own "EOS": its 3rd token
    rows = [
        (RowOptions(ignore_eos=True), {}),
        (RowOptions(ignore_eos=True, repetition_penalty=1.6), dict(repetition_penalty=1.6)),
        (RowOptions(ignore_eos=True, repetition_penalty=0.6), dict(repetition_penalty=0.6)),
        (RowOptions(ignore_eos=True, stop_token_ids=(end[3],), min_tokens=12),
         dict(eos_ids=[end[3]], min_new_tokens=12)),
        (RowOptions(ignore_eos=True, logit_bias={first[4]: -100.0, first[0]: 4.0}),
         dict(sequence_bias=[[[first[4]], -100.0], [[first[0]], 4.0]])),
        (RowOptions(ignore_eos=True, stop_token_ids=(end[5],), min_tokens=9, repetition_penalty=1.3,
                    logit_bias={first[5]: -5.0}),
         dict(eos_ids=[end[5]], min_new_tokens=9, repetition_penalty=1.3, sequence_bias=[[[first[5]], -5.0]])),
        (RowOptions(ignore_eos=True, frequency_penalty=1.5, presence_penalty=0.5), None),  # OpenAI's: spec == ar
        (RowOptions(ignore_eos=True, frequency_penalty=-0.5, presence_penalty=2.0, min_tokens=3), None),
    ]
    options = [o for o, _ in rows]
    expected = [generate(pair, p, **kw) if kw is not None else None for p, (_, kw) in zip(prompts, rows)]
    return options, expected


@pytest.mark.parametrize("drafter", ["ar", *DRAFTERS])
def test_processed_rows_equal_the_target_alone(pair, prompts, plain, processed, drafter):
    options, expected = processed
    rows = run(pair, prompts, options, drafter).rows
    out = [r.token_ids for r in rows]
    if drafter == "tree":
        assert all(r.stats["tree_steps"] for r in rows)
    for b, want in enumerate(expected):
        if want is not None:
            assert out[b] == want, b
    changed = [b for b, want in enumerate(expected) if want is not None and want != plain[b]]
    assert changed == [1, 2, 3, 4, 5]  # every processor changed its row's output
    ar = [r.token_ids for r in run(pair, prompts[6:], options[6:], "ar").rows]
    assert out[6:] == ar and all(a != p for a, p in zip(ar, plain[6:]))


def stop_cut(pair, tokens: list[int], stop: str) -> int | None:
    """The oracle: how many tokens until the decoded text first holds stop (None: never)."""
    return next((j for j in range(1, len(tokens) + 1)
                 if stop in pair.tokenizer.decode(tokens[:j], skip_special_tokens=True)), None)


@pytest.mark.parametrize("drafter", ["ar", "model", "self", "ngram", "hybrid", "suffix", "tree"])
def test_stop_strings_end_rows_where_the_text_first_holds_one(pair, prompts, plain, drafter):
    """Stop strings spanning tokens, several per row, kept (include) or not; "self": the target
    drafts for itself, so every stop completes inside a fully accepted block."""
    texts = [pair.tokenizer.decode(row, skip_special_tokens=True) for row in plain]
    rng = random.Random(2)
    options, stops = [], []
    for b, text in enumerate(texts):
        at = rng.randrange(len(text) // 4, len(text) // 2)
        row_stops = (text[at : at + 1 + b % 4], "\x00never") if b != 7 else ()  # the last row: no stop string
        stops.append(row_stops)
        cut = stop_cut(pair, plain[b], row_stops[0]) if row_stops else None
        # rows 0-3: the token after the stop string is a stop id, likely in the same block
        ids = (plain[b][cut],) if b < 4 and cut < len(plain[b]) and plain[b][cut] not in plain[b][:cut] else ()
        options.append(RowOptions(ignore_eos=True, stop=row_stops, include_stop_str=b % 2 == 1, logprobs=1,
                                  stop_token_ids=ids))
    draft = pair.target if drafter == "self" else None
    out = run(pair, prompts, options, "model" if drafter == "self" else drafter, draft=draft).rows
    for b, (row, text) in enumerate(zip(out, texts)):
        if not stops[b]:
            assert row.token_ids == plain[b] and row.text_end is None and row.finish_reason == "length"
            continue
        stop = stops[b][0]
        cut = stop_cut(pair, plain[b], stop)
        assert row.token_ids == plain[b][:cut] and row.finish_reason == "stop", b
        kept = text.index(stop) + (len(stop) if options[b].include_stop_str else 0)
        assert pair.tokenizer.decode(row.token_ids, skip_special_tokens=True)[: row.text_end] == text[:kept]
        assert len(row.logprobs) == row.stats["completion_tokens"] == cut
        assert row.stats["accepted_tokens"] <= cut
    if drafter == "self":
        assert sum(r.stats["accepted_tokens"] for r in out) > sum(len(r.token_ids) for r in out) / 2


@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_logprobs_equal_ar_and_a_plain_forward(pair, prompts, drafter):
    """Raw log-softmax of the target, from the verify forward: spec (with processing on, which
    logprobs do not see) equals ar to 1e-4 and a forward over the whole row."""
    options = [RowOptions(logprobs=[3, None, 0, 5][b % 4], repetition_penalty=1.2) for b in range(len(prompts))]
    spec, ar = run(pair, prompts, options, drafter).rows, run(pair, prompts, options, "ar").rows
    for b, (s, a) in enumerate(zip(spec, ar)):
        assert s.token_ids == a.token_ids
        if options[b].logprobs is None:
            assert s.logprobs is None and a.logprobs is None
            continue
        k = options[b].logprobs
        assert [[i for i, _ in top] for _, top in s.logprobs] == [[i for i, _ in top] for _, top in a.logprobs]
        assert all(len(top) == k for _, top in s.logprobs)
        values = lambda row: torch.tensor([[lp, *(v for _, v in top)] for lp, top in row.logprobs])  # noqa: E731
        torch.testing.assert_close(values(s), values(a), atol=1e-4, rtol=0)
        ids = torch.tensor([prompts[b] + s.token_ids])
        with torch.no_grad():
            raw = torch.log_softmax(pair.target(ids).logits[0, len(prompts[b]) - 1 : -1].float(), -1)  # [T, V]
        direct = raw.gather(1, torch.tensor(s.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(values(s)[:, 0], direct, atol=1e-4, rtol=0)
        if k:
            assert [[i for i, _ in top] for _, top in s.logprobs] == raw.topk(k).indices.tolist()


@pytest.mark.parametrize("share", [True, False])
def test_rows_sharing_a_prompt_are_prefilled_once(pair, prompts, plain, share):
    """n samples of a request (here: repeated prompts) share one prefill (unless share_prefill is
    off, bench's baseline); each row's output is still the target alone's."""
    rows = [prompts[1], prompts[5], prompts[1], prompts[1], prompts[3], prompts[5]]
    prefill_rows = []
    hook = pair.target.register_forward_pre_hook(
        lambda m, args, kw: prefill_rows.append(kw["input_ids"].shape) if not prefill_rows else None, with_kwargs=True)
    try:
        out = run(pair, rows, [RowOptions(ignore_eos=True)] * len(rows), share_prefill=share)
    finally:
        hook.remove()
    assert prefill_rows[0][0] == (3 if share else 6)  # three distinct prompts
    assert [r.token_ids for r in out.rows] == [plain[b] for b in (1, 5, 1, 1, 3, 5)]
