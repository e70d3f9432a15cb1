"""After each verify step, both cut-and-masked caches hold exactly each row's accepted prefix."""

import pytest
import torch

from batchspec.decoding import DecodeConfig
from batchspec.decoding.engine import BatchDecoder
from batchspec.models import load_pair
from batchspec.tiny import perturbed

from policies import Scripted

from test_greedy import LENGTHS, random_prompts, reference


def next_logits_from_cache(kv, ids, mask):
    """Feed ids/mask ([B, S]) through the cache, return the last position's logits, undo the feed."""
    logits = kv.forward(ids, mask)[:, -1]  # [B, V]
    kv.rollback(torch.zeros(ids.shape[0], dtype=torch.long), ids.shape[1], 0)
    return logits


def fresh_next_logits(model, sequence):
    return model(torch.tensor([sequence])).logits[0, -1]


# mistral and gemma2: sliding windows far shorter than the rows (gemma2's draft noisier, or it
# would accept nearly everything: no holes inside the windows)
CASES = {"llama": {}, "qwen2": {}, "gpt2": {}, "mistral": {"window": 12}, "gemma2": {"window": 12, "noise": 0.1}}


def assert_caches_hold_accepted_prefixes(decoder, pair, prompts, drafter, draft=None) -> None:
    """The target's and the draft's caches, fed each row's newest token (the draft first what it
    owes), give the logits of a clean forward over the row's whole sequence. draft: the
    drafter's model (default: the pair's)."""
    draft = draft or pair.draft
    rows = decoder.rows
    drafter.catch_up()  # what plain steps left on the host
    ones = torch.ones_like(rows.last)[:, None]
    target_logits = next_logits_from_cache(decoder.target_kv, rows.last[:, None], ones)
    draft_in = torch.cat([drafter.owed, rows.last[:, None]], dim=1)  # what the draft owes, then the newest
    draft_logits = next_logits_from_cache(drafter.kv, draft_in, torch.cat([drafter.owed_mask, ones], 1))
    for b, tally in enumerate(decoder.tallies):
        sequence = prompts[tally.index] + tally.tokens
        torch.testing.assert_close(target_logits[b], fresh_next_logits(pair.target, sequence), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(draft_logits[b], fresh_next_logits(draft, sequence), atol=1e-4, rtol=1e-4)
    assert decoder.target_kv.mask.shape == (len(decoder.tallies), decoder.target_kv.length)


SWITCHING = [0, 0, 3, 0, 4, 1, 0, 0, 0, 2]


@pytest.mark.parametrize("family,kwargs", CASES.items(), ids=CASES)
@pytest.mark.parametrize("compact_at", [0.0, 1.0])
@pytest.mark.parametrize("gammas,width", [([4], 1), (SWITCHING, 1), ([3], 3), (SWITCHING, 2)],
                         ids=["fixed", "switching", "tree", "tree-switching"])
@torch.inference_mode()
def test_caches_hold_each_rows_accepted_prefix(tiny_pair, family, kwargs, compact_at, gammas, width):
    """After every step, fixed gamma or switching between plain steps (the draft falls behind)
    and speculative ones (it catches up in its first forward); chains, and trees whose accepted
    path the caches keep, in order, of all the tree's slots."""
    target_path, draft_path = tiny_pair(family, **kwargs)
    pair = load_pair(str(target_path), str(draft_path), dtype="float32", device="cpu")
    prompts = random_prompts(len(pair.tokenizer), LENGTHS[:10], seed=3)
    config = DecodeConfig(max_new_tokens=30, gamma_max=4, compact_at=compact_at, tree_width=width)
    decoder = BatchDecoder(pair.target, pair.draft, prompts, list(range(len(prompts))), config,
                           policy=Scripted(gammas, gamma_max=4, trees=width > 1))
    owed, behind = set(), set()
    for _ in range(len(gammas) if len(gammas) > 1 else 6):
        behind.add(decoder.drafter.behind)
        decoder.step()
        assert_caches_hold_accepted_prefixes(decoder, pair, prompts, decoder.drafter)
        owed.update(int(x) for x in decoder.drafter.owed_mask[:, -1:].flatten())
    assert owed == {0, 1}  # rows that owe the draft a token beside rows that owe nothing
    assert max(behind) > (1 if len(gammas) > 1 else 0)  # switching: the draft caught up on several tokens
    if compact_at == 0.0:
        assert decoder.totals["compactions"] > 0


@pytest.mark.parametrize("family,kwargs", [("llama", {}), ("gemma2", CASES["gemma2"])], ids=["llama", "gemma2"])
@pytest.mark.parametrize("compact_at", [0.0, 1.0])
@torch.inference_mode()
def test_several_drafts_caches_hold_each_rows_accepted_prefix(tiny_pair, family, kwargs, compact_at):
    """Two drafts whose chains are checked as one tree, plain and chain steps (the first draft
    alone) between: after every step each draft holds the part of the accepted path it ran and
    owes the rest."""
    target_path, draft_path = tiny_pair(family, **kwargs)
    pair = load_pair(str(target_path), str(draft_path), dtype="float32", device="cpu")
    other = perturbed(pair.target, 0.08, seed=9)
    prompts = random_prompts(len(pair.tokenizer), LENGTHS[:10], seed=3)
    config = DecodeConfig(max_new_tokens=30, gamma_max=4, compact_at=compact_at)
    policy = Scripted(SWITCHING, gamma_max=4, trees=True)
    decoder = BatchDecoder(pair.target, [pair.draft, other], prompts, list(range(len(prompts))), config,
                           policy=policy)
    for step in range(len(SWITCHING) + 2):
        policy.tree = step % 4 != 1  # a chain step of the first draft now and then
        decoder.step()
        for drafter, model in zip(decoder.drafter.drafters, [pair.draft, other]):
            assert_caches_hold_accepted_prefixes(decoder, pair, prompts, drafter, model)
    branches = [sum(c) for c in zip(*(t.stats.tree_branch_histogram for t in decoder.tallies))]
    assert all(branches)  # each draft's chain won somewhere


@pytest.mark.parametrize("family,kwargs", [("llama", {}), ("gemma2", CASES["gemma2"])], ids=["llama", "gemma2"])
@pytest.mark.parametrize("compact_at", [0.0, 1.0])
@torch.inference_mode()
def test_hybrid_draft_cache_holds_each_rows_accepted_prefix(tiny_pair, family, kwargs, compact_at):
    """Hybrid drafting, with a lookup that knows each row's true continuation (its last proposal
    spoilt on odd lengths, so that rows accept all or all but one): every third step all rows
    take the lookup's proposal (the draft model sits out), every third some do (their draft
    slots are dropped, their accepted tokens owed), every third none; plain steps between.
    After each the draft cache still holds every row's true prefix."""
    target_path, draft_path = tiny_pair(family, **kwargs)
    pair = load_pair(str(target_path), str(draft_path), dtype="float32", device="cpu")
    prompts = random_prompts(len(pair.tokenizer), LENGTHS[:6], seed=3)
    truth = [p + reference(pair.target, p, [], max_new=60) for p in prompts]
    config = DecodeConfig(max_new_tokens=40, gamma_max=4, compact_at=compact_at, ngram=(1, 3))
    decoder = BatchDecoder(pair.target, pair.draft, prompts, list(range(len(prompts))), config,
                           policy=Scripted([3, 0, 4, 2, 0, 3, 1, 4], gamma_max=4))
    ngram = decoder.drafter.lookup

    def oracle(b: int, gamma: int) -> list[int]:
        context, step = ngram.contexts[b], decoder.totals["verify_steps"]
        if step % 3 == 2 or (step % 3 == 1 and b % 2):
            return []
        row = next(t for t in truth if t[: len(context)] == context)
        proposal = row[len(context) : len(context) + gamma]
        return proposal[:-1] + [(proposal[-1] + 1) % len(pair.tokenizer)] if len(context) % 2 else proposal

    ngram.lookup = oracle
    sat_out = []
    verified = decoder.drafter.model.verified

    def noted(report):
        if report.proposal.width and not report.proposal.forwards:
            sat_out.append(max(report.accepted))
        verified(report)

    decoder.drafter.model.verified = noted
    while not decoder.done:
        decoder.step()
        if not decoder.done:
            assert_caches_hold_accepted_prefixes(decoder, pair, prompts, decoder.drafter.model)
    rows = decoder.output().rows
    assert [p + r.token_ids for p, r in zip(prompts, rows)] == [t[: len(p) + 40] for p, t in zip(prompts, truth)]
    assert max(sat_out) > 0  # steps where the model sat out and rows accepted the lookup's tokens
    assert all(r.stats["model_steps"] and r.stats["ngram_steps"] for r in rows)


@pytest.mark.parametrize("family", ["llama", "bart"])
def test_every_forward_runs_without_cudnn_attention(tiny_pair, family):
    """cuDNN attention builds a plan for every new shape, and a decode step's key length is new
    at every step: each forward of a decode (prefill, draft, verify; an encoder–decoder's
    encoder too) has it off, and the process's setting is back after."""
    pair = load_pair(*map(str, tiny_pair(family)), dtype="float32", device="cpu")
    flags = []
    models = [pair.target, pair.draft] + ([pair.target.get_encoder()] if family == "bart" else [])
    hooks = [m.register_forward_pre_hook(lambda *_: flags.append(torch.backends.cuda.cudnn_sdp_enabled()))
             for m in models]
    config = DecodeConfig(max_new_tokens=6, eos_token_ids=(), gamma=2)
    BatchDecoder(pair.target, pair.draft, random_prompts(len(pair.tokenizer), [3, 7]), [0, 1], config).run()
    for hook in hooks:
        hook.remove()
    assert len(flags) > 4 and not any(flags)
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_verify_forwards_attend_without_copying_the_cache(tiny_pair, monkeypatch):
    """A grouped-query layer (the tiny Llama: 4 query heads over 2 key-value heads) verifying
    several positions under a mask attends per key-value head: transformers' repeat_kv, a copy
    of the layer's cache, never runs; and transformers' own SDPA is back after our forwards."""
    from transformers.integrations import sdpa_attention
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    pair = load_pair(*map(str, tiny_pair("llama")), dtype="float32", device="cpu")
    assert pair.target.config.num_attention_heads > pair.target.config.num_key_value_heads
    repeats, repeat_kv = [], sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda *a: repeats.append(a) or repeat_kv(*a))
    widths = []  # the target's forwards' query positions
    hook = pair.target.register_forward_pre_hook(lambda _, args, kw: widths.append(kw["input_ids"].shape[1]),
                                                 with_kwargs=True)
    config = DecodeConfig(max_new_tokens=8, eos_token_ids=(), gamma=3)
    prompts = random_prompts(len(pair.tokenizer), [3, 7, 5])  # left pads: every forward is masked
    BatchDecoder(pair.target, pair.draft, prompts, [0, 1, 2], config).run()
    hook.remove()
    assert widths.count(4) > 1 and not repeats
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention.sdpa_attention_forward


@pytest.mark.parametrize("mask_queries", [1, 3])
@pytest.mark.parametrize("boolean", [True, False])
def test_grouped_attention_is_transformers_sdpa(mask_queries, boolean):
    """Packed per key-value head, the queries' attention equals transformers' SDPA (keys and
    values repeated per query head), with a mask per query or one for all, boolean or additive."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from batchspec.decoding.attention import grouped_sdpa

    torch.manual_seed(0)
    query, key, value = torch.randn(2, 6, 3, 8), torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 8)
    seen = torch.rand(2, 1, mask_queries, 9) > 0.3
    seen[..., -1] = True
    mask = seen if boolean else torch.zeros(seen.shape).masked_fill_(~seen, torch.finfo(torch.float32).min)
    module = SimpleNamespace(num_key_value_groups=3, is_causal=True)
    ours, _ = grouped_sdpa(module, query, key, value, mask, scaling=0.3)
    theirs, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    assert ours.shape == theirs.shape == (2, 3, 6, 8)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)
