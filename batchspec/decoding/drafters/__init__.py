"""Drafters: what proposes the tokens the target checks. One small interface for every kind.

A drafter keeps its own state (a draft model's KV cache, an n-gram index) in step with the
batch's rows:
  propose(last [B], gamma, params, u [B, G] | None) -> tokens [B, G], q [B, G, V] | None
      gamma proposals per live row after its newest token `last` (not yet in any cache);
      q: the (warped) distributions they were drawn from, None when greedy.
  verified(last [B], tokens [B, G], n [B], max_n)
      after the target's check of a step with G = tokens.shape[1] proposals (0: a plain step):
      row b kept n[b] of them; max_n = n.max(), known on the host.
  select(keep [B'])   finished rows leave.
  compact()           the target's cache was compacted; compact any cache of its own.
  forwards(gamma)     draft forwards one proposal of gamma tokens takes (statistics).
  behind              tokens the drafter has not seen yet (host int): a step after which it
                      catches up is not a typical step to time.
"""

from batchspec.decoding.drafters.model import ModelDrafter

__all__ = ["ModelDrafter"]
