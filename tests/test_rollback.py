"""After each verify step, both cut-and-masked caches hold exactly each row's accepted prefix."""

import pytest
import torch

from batchspec.decoding import DecodeConfig
from batchspec.decoding.engine import BatchDecoder
from batchspec.models import load_pair

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
@torch.inference_mode()
def test_caches_hold_each_rows_accepted_prefix(tiny_pair, family, kwargs, compact_at):
    target_path, draft_path = tiny_pair(family, **kwargs)
    pair = load_pair(str(target_path), str(draft_path), dtype="float32", device="cpu")
    prompts = random_prompts(len(pair.tokenizer), LENGTHS[:10], seed=3)
    config = DecodeConfig(max_new_tokens=30, gamma=4, compact_at=compact_at)
    decoder = BatchDecoder(pair.target, pair.draft, prompts, list(range(len(prompts))), config)
    checked = set()
    for _ in range(6):
        decoder.step()
        rows = decoder.rows
        target_kv, draft_kv = decoder.caches
        ones = torch.ones_like(rows.last)[:, None]
        target_logits = next_logits_from_cache(target_kv, rows.last[:, None], ones)
        draft_in = torch.stack([rows.pending, rows.last], dim=1)  # the pending proposal, if owed
        draft_logits = next_logits_from_cache(draft_kv, draft_in, torch.cat([rows.has_pending[:, None], ones], 1))
        for b, index in enumerate(rows.index.tolist()):
            sequence = prompts[index] + rows.out[b, : int(rows.produced[b])].tolist()
            torch.testing.assert_close(target_logits[b], fresh_next_logits(pair.target, sequence), atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(draft_logits[b], fresh_next_logits(pair.draft, sequence), atol=1e-4, rtol=1e-4)
        checked.update(int(x) for x in rows.has_pending)
        assert target_kv.mask.shape == (len(rows.index), target_kv.length)
    assert checked == {0, 1}  # both fully accepted rows (draft owes a proposal) and rejected rows seen
    if compact_at == 0.0:
        assert decoder.totals["compactions"] > 0
