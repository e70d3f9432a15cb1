"""After each verify step, both cut-and-masked caches hold exactly each row's accepted prefix."""

import pytest
import torch

from batchspec.decoding import DecodeConfig
from batchspec.decoding.engine import BatchDecoder
from batchspec.models import load_pair

from policies import Scripted

from test_greedy import LENGTHS, random_prompts


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


@pytest.mark.parametrize("family,kwargs", CASES.items(), ids=CASES)
@pytest.mark.parametrize("compact_at", [0.0, 1.0])
@pytest.mark.parametrize("gammas", [[4], [0, 0, 3, 0, 4, 1, 0, 0, 0, 2]], ids=["fixed", "switching"])
@torch.inference_mode()
def test_caches_hold_each_rows_accepted_prefix(tiny_pair, family, kwargs, compact_at, gammas):
    """After every step, fixed gamma or switching between plain steps (the draft falls behind)
    and speculative ones (it catches up in its first forward)."""
    target_path, draft_path = tiny_pair(family, **kwargs)
    pair = load_pair(str(target_path), str(draft_path), dtype="float32", device="cpu")
    prompts = random_prompts(len(pair.tokenizer), LENGTHS[:10], seed=3)
    config = DecodeConfig(max_new_tokens=30, gamma_max=4, compact_at=compact_at)
    decoder = BatchDecoder(pair.target, pair.draft, prompts, list(range(len(prompts))), config,
                           policy=Scripted(gammas, gamma_max=4))
    owed, behind = set(), set()
    for _ in range(len(gammas) if len(gammas) > 1 else 6):
        behind.add(decoder.drafter.behind)
        decoder.step()
        rows, drafter = decoder.rows, decoder.drafter
        ones = torch.ones_like(rows.last)[:, None]
        target_logits = next_logits_from_cache(decoder.target_kv, rows.last[:, None], ones)
        draft_in = torch.cat([drafter.owed, rows.last[:, None]], dim=1)  # what the draft owes, then the newest
        draft_logits = next_logits_from_cache(drafter.kv, draft_in, torch.cat([drafter.owed_mask, ones], 1))
        for b, tally in enumerate(decoder.tallies):
            sequence = prompts[tally.index] + tally.tokens
            torch.testing.assert_close(target_logits[b], fresh_next_logits(pair.target, sequence), atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(draft_logits[b], fresh_next_logits(pair.draft, sequence), atol=1e-4, rtol=1e-4)
        owed.update(int(x) for x in drafter.owed_mask[:, -1:].flatten())
        assert decoder.target_kv.mask.shape == (len(decoder.tallies), decoder.target_kv.length)
    assert owed == {0, 1}  # rows that owe the draft a token beside rows that owe nothing
    assert max(behind) > (1 if len(gammas) > 1 else 0)  # switching: the draft caught up on several tokens
    if compact_at == 0.0:
        assert decoder.totals["compactions"] > 0
