"""Drafters: what proposes the tokens the target checks. One small interface for every kind.

A drafter keeps its own state (a draft model's KV cache, an n-gram index) in step with the
batch's rows:
  propose(last [B], gamma, params, u [B, G] | None, process) -> Proposal
      up to gamma proposals per live row after its newest token `last` (not yet in any cache);
      u: uniforms for a sampled draft model; process(logits [B, V], proposals so far [B, i]):
      the rows' logits processing at that position (None: none), which a model draws q after.
  verified(proposal, last [B], n [B], max_n, appended)
      after the target's check of the step (Proposal.none(last) for a plain step): row b kept
      n[b] of its proposals, max_n = n.max() (host), and appended[b] (host) are the tokens the
      row gained: its accepted proposals and the correction or bonus token.
  select(keep [B'], kept)  finished rows leave; kept: the same indices on the host.
  compact()           the target's cache was compacted; compact any cache of its own.
  behind              tokens the drafter has not seen yet (host int): a step after which it
                      catches up is not a typical step to time.

make_drafter picks the kind: a draft model, n-gram lookup (no model), or both (hybrid); with a
grammar, each row's forced text (jump-forward) comes before either.
"""

import torch

from batchspec.decoding.drafters.first_of import FirstOf
from batchspec.decoding.drafters.hybrid import HybridDrafter
from batchspec.decoding.drafters.jump import JumpDrafter
from batchspec.decoding.drafters.model import ModelDrafter
from batchspec.decoding.drafters.ngram import NgramDrafter
from batchspec.decoding.drafters.proposal import Proposal
from batchspec.decoding.seq2seq import decoder_prefix


def make_drafter(draft, ngram: tuple[int, int] | None, prompts: list[list[int]], ids: torch.Tensor,
                 mask: torch.Tensor, vocab: int, source: tuple[torch.Tensor, torch.Tensor] | None = None,
                 jump: JumpDrafter | None = None):
    """draft: a draft model or None; ngram: (n_min, n_max) for prompt lookup, or None. ids, mask:
    [B, P] the left-padded (decoder) prompts; vocab: the target's logit width; source: the
    prompts, right-padded, for an encoder–decoder pair; jump: the rows' grammars' forced text,
    proposed first (None: no jump-forward). None: no drafter (ar)."""
    if draft is None and not ngram:
        return None
    model = None
    if draft is not None:  # an encoder–decoder's decoder prompt is its start, for every row
        newest = [p[-1] for p in prompts] if source is None else [decoder_prefix(draft)[-1]] * len(prompts)
        model = ModelDrafter(draft, ids, mask, vocab, newest, source)
    lookups = [jump] if jump is not None else []
    lookups += [NgramDrafter(prompts, *ngram, device=ids.device)] if ngram else []
    lookup = FirstOf(lookups) if len(lookups) > 1 else lookups[0] if lookups else None
    if model and lookup:
        return HybridDrafter(model, lookup)
    return model or lookup


__all__ = ["FirstOf", "HybridDrafter", "JumpDrafter", "ModelDrafter", "NgramDrafter", "Proposal", "make_drafter"]
