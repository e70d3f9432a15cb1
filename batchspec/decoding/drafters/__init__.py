"""Drafters: what proposes the tokens the target checks. One small interface for every kind.

A drafter keeps its own state (a draft model's KV cache, an n-gram index) in step with the
batch's rows:
  propose(last [B], gamma, params, u [B, G] | None, process) -> Proposal
      up to gamma proposals per row after its newest token `last` (not yet in any cache); rows
      may propose different numbers (Proposal.lengths, 0: none); u: uniforms for a sampled
      draft model; process(logits [B, V], proposals so far [B, i]): the rows' logits
      processing at that position (None: none), which a model draws q after.
  verified(report)    after every step (a plain one too), the engine's StepReport: the proposal
                      as checked (report.proposal), what each row kept (report.n [B] on the
                      device, report.accepted on the host), the tokens each appended
                      (report.blocks) and which rows ended (report.finished).
  select(keep [B'], kept)  finished rows leave; kept: the same indices on the host.
  compact(longest)    the target's cache was compacted to `longest` slots, which no row's valid
                      slots exceed (nor a draft's: it holds a prefix of its row); compact any cache
                      of its own.
  behind              tokens the drafter has not seen yet (host int): a step after which it
                      catches up is not a typical step to time.

A host lookup (n-gram, a grammar's forced text, or any other that reads the rows' tokens from the
reports, such as an index of the job's earlier completions) also has `source`, its name in the
rows' statistics (row_stats.RowStats counts its steps as "<source>_steps"), and lookup(b, gamma)
-> up to gamma host ids for row b (rows may propose different numbers); make_drafter tries the
lookups in order (FirstOf) and puts the draft model behind them (HybridDrafter).

A draft model that grows token trees (TreeDrafter), and several draft models together
(SeveralDrafters: their chains merged into one tree) also have
  propose_tree(last [B], depth) -> Proposal with parents (a tree; greedy), and their verified()
      then gets each row's accepted path (report.proposal.path) to keep.
"""

import torch

from batchspec.decoding.drafters.first_of import FirstOf
from batchspec.decoding.drafters.hybrid import HybridDrafter
from batchspec.decoding.drafters.jump import JumpDrafter
from batchspec.decoding.drafters.model import ModelDrafter
from batchspec.decoding.drafters.ngram import NgramDrafter
from batchspec.decoding.drafters.proposal import Proposal
from batchspec.decoding.drafters.several import SeveralDrafters
from batchspec.decoding.drafters.suffix import SuffixDrafter
from batchspec.decoding.drafters.tree import TreeDrafter, tree_problem
from batchspec.decoding.seq2seq import decoder_prefix
from batchspec.decoding.suffix_index import SuffixIndex


def make_drafter(drafts: list, ngram: tuple[int, int] | None, prompts: list[list[int]], ids: torch.Tensor,
                 mask: torch.Tensor, vocab: int, source: tuple[torch.Tensor, torch.Tensor] | None = None,
                 jump: JumpDrafter | None = None, tree_width: int = 1, suffix: SuffixIndex | None = None,
                 static=None):
    """drafts: draft models (none, one, or several: their chains merged into trees); ngram:
    (n_min, n_max) for prompt lookup, or None. ids, mask: [B, P] the left-padded (decoder)
    prompts; vocab: the target's logit width; source: the prompts, right-padded, for an
    encoder–decoder pair; jump: the rows' grammars' forced text, proposed first (None: no
    jump-forward); tree_width > 1: the draft proposes trees; suffix: the run's index of earlier
    completions, looked up (with each row's own text, at the ngram sizes) in place of n-gram
    lookup; static: the draft caches' plan (kv_cache.Static; None: dynamic). None: no drafter (ar)."""
    if not drafts and not ngram:
        return None
    models = []
    for draft in drafts:  # an encoder–decoder's decoder prompt is its start, for every row
        newest = [p[-1] for p in prompts] if source is None else [decoder_prefix(draft)[-1]] * len(prompts)
        models.append(TreeDrafter(draft, ids, mask, vocab, newest, source, static, width=tree_width)
                      if tree_width > 1 else ModelDrafter(draft, ids, mask, vocab, newest, source, static))
    model = SeveralDrafters(models) if len(models) > 1 else models[0] if models else None
    lookups = [jump] if jump is not None else []
    if ngram:
        lookups.append(SuffixDrafter(suffix, prompts, *ngram, device=ids.device) if suffix is not None
                       else NgramDrafter(prompts, *ngram, device=ids.device))
    lookup = FirstOf(lookups) if len(lookups) > 1 else lookups[0] if lookups else None
    if model and lookup:
        return HybridDrafter(model, lookup)
    return model or lookup


__all__ = ["FirstOf", "HybridDrafter", "JumpDrafter", "ModelDrafter", "NgramDrafter", "Proposal", "SeveralDrafters",
           "SuffixDrafter", "TreeDrafter", "make_drafter", "tree_problem"]
