"""Token trees: several continuations per row checked by the target in one forward (SpecInfer,
Miao et al. 2024; the dynamic trees of EAGLE-2).

A step's tree hangs below each row's newest token, the root: the verify forward takes the slots
[root, d_1..d_N] and `parents` [B, N] gives each node's parent slot in it (0: the root; a parent
always comes before its child). Each slot attends to the row's past and to its own ancestors
only (tree_ancestors), at position past + depth, so every path reads exactly like a chain.
Greedy acceptance walks the tree: a node is accepted when its token is the target's argmax after
its parent and its parent is accepted; the row keeps the deepest accepted path and the target's
token after it. A tree whose nodes each have one child is the chain of the core engine.
"""

import torch

from batchspec.decoding.sampling import greedy


def tree_ancestors(parents: torch.Tensor, depth: int) -> torch.Tensor:
    """parents [B, S]: each slot's parent slot (-1: none, the slot hangs below the past) ->
    [B, S, S] bool: slot i's ancestors, itself included. depth: the deepest chain of parents (host)."""
    B, S = parents.shape
    ancestors = torch.eye(S, dtype=torch.bool, device=parents.device).expand(B, S, S).clone()
    up = parents  # [B, S]: each slot's ancestor `k` levels up, -1 past the top
    for _ in range(depth):
        above = torch.zeros_like(ancestors).scatter_(2, up.clamp(min=0)[:, :, None], (up >= 0)[:, :, None])
        ancestors |= above
        up = torch.where(up >= 0, parents.gather(1, up.clamp(min=0)), -1)
    return ancestors


def accept_tree_greedy(logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, ancestors: torch.Tensor,
                       depth: int):
    """The deepest path of each row's tree that the target's argmax agrees with.

    logits [B, N+1, V] at the slots [root, d_1..d_N]; tokens, parents [B, N]; ancestors
    [B, N+1, N+1] over the slots; depth: the tree's (host). Returns n [B] (the path's length),
    next_token [B] (the target's token after it) and path [B, depth+1] (the path's slots from
    the root, level by level; slot 0 past n).
    """
    N = tokens.shape[1]
    target_next = greedy(logits)  # [B, N+1]: the target's token after each slot
    good = tokens == target_next.gather(1, parents)  # [B, N]
    good = torch.cat([torch.ones_like(good[:, :1]), good], dim=1)  # [B, N+1], the root always
    accepted = ~(ancestors & ~good[:, None, :]).any(-1)  # [B, N+1]: every ancestor good
    level = ancestors.sum(-1) - 1  # [B, N+1]: depth below the root
    reached = torch.where(accepted, level, -1)  # [B, N+1]
    n, best = reached.max(-1)  # [B], [B]
    on_path = ancestors.gather(1, best[:, None, None].expand(-1, 1, N + 1))[:, 0]  # [B, N+1]
    at_level = on_path[:, None, :] & (level[:, None, :] == torch.arange(depth + 1, device=n.device)[None, :, None])
    path = at_level.int().argmax(-1)  # [B, depth+1]
    return n, target_next.gather(1, best[:, None])[:, 0], path
