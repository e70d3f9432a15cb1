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
  compact(longest)    the target's cache was compacted to `longest` slots, which no row's valid
                      slots exceed (nor a draft's: it holds a prefix of its row); compact any cache
                      of its own.
  behind              tokens the drafter has not seen yet (host int): a step after which it
                      catches up is not a typical step to time.
  idle_rows           (optional, default False) rows that ended may stay in the batch, inert
                      (they accept nothing and append nothing); such a drafter also has
  idle(inert)         inert: host bools, each row of the batch (after select) whether it is
                      inert. A draft model proposes for them as for any row (their share of its
                      forwards); a lookup proposes nothing for them, so that they never widen
                      a step or wake the draft model.

A draft model that grows token trees (TreeDrafter), and several draft models together
(SeveralDrafters: their chains merged into one tree) also have
  propose_tree(last [B], depth) -> Proposal with parents (a tree; greedy), and their verified()
      then gets each row's accepted path (Proposal.path) to keep.

make_drafter picks the kind: a draft model (chains, or trees with tree_width > 1), several,
n-gram lookup (no model), or a model and n-gram lookup (hybrid); with a grammar, each row's
forced text (jump-forward) comes before either.
"""

import torch

from batchspec.decoding.drafters.first_of import FirstOf
from batchspec.decoding.drafters.hybrid import HybridDrafter
from batchspec.decoding.drafters.jump import JumpDrafter
from batchspec.decoding.drafters.model import ModelDrafter
from batchspec.decoding.drafters.ngram import NgramDrafter
from batchspec.decoding.drafters.proposal import Proposal
from batchspec.decoding.drafters.several import SeveralDrafters
from batchspec.decoding.drafters.tree import TreeDrafter, tree_problem
from batchspec.decoding.seq2seq import decoder_prefix


def make_drafter(drafts: list, ngram: tuple[int, int] | None, prompts: list[list[int]], ids: torch.Tensor,
                 mask: torch.Tensor, vocab: int, source: tuple[torch.Tensor, torch.Tensor] | None = None,
                 jump: JumpDrafter | None = None, tree_width: int = 1):
    """drafts: draft models (none, one, or several: their chains merged into trees); ngram:
    (n_min, n_max) for prompt lookup, or None. ids, mask: [B, P] the left-padded (decoder)
    prompts; vocab: the target's logit width; source: the prompts, right-padded, for an
    encoder–decoder pair; jump: the rows' grammars' forced text, proposed first (None: no
    jump-forward); tree_width > 1: the draft proposes trees. None: no drafter (ar)."""
    if not drafts and not ngram:
        return None
    models = []
    for draft in drafts:  # an encoder–decoder's decoder prompt is its start, for every row
        newest = [p[-1] for p in prompts] if source is None else [decoder_prefix(draft)[-1]] * len(prompts)
        models.append(TreeDrafter(draft, ids, mask, vocab, newest, source, width=tree_width) if tree_width > 1
                      else ModelDrafter(draft, ids, mask, vocab, newest, source))
    model = SeveralDrafters(models) if len(models) > 1 else models[0] if models else None
    lookups = [jump] if jump is not None else []
    lookups += [NgramDrafter(prompts, *ngram, device=ids.device)] if ngram else []
    lookup = FirstOf(lookups) if len(lookups) > 1 else lookups[0] if lookups else None
    if model and lookup:
        return HybridDrafter(model, lookup)
    return model or lookup


__all__ = ["FirstOf", "HybridDrafter", "JumpDrafter", "ModelDrafter", "NgramDrafter", "Proposal", "SeveralDrafters",
           "TreeDrafter", "make_drafter", "tree_problem"]
