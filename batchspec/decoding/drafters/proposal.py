"""What a drafter hands the target for one step."""

from dataclasses import dataclass

import torch


@dataclass
class Proposal:
    """Up to G proposals per row. A row may propose fewer (an n-gram lookup without a match
    proposes none): its slots past `lengths[b]` are padding, verified but never accepted.

    A tree (decoding/tree.py) has `parents`: tokens are its N nodes, and lengths its depth. The
    verification hands the drafter back each row's accepted path as a chain: tokens [B, depth]
    the path's, `path` its slots in the tree, parents None."""

    tokens: torch.Tensor  # [B, G] d_1..d_G per row
    q: torch.Tensor | None  # [B, G, V] the draft's probabilities; None: one-hot at tokens (or greedy)
    lengths: list[int]  # host: proposals per row, each <= G
    sources: list[str | None]  # host: per row "model", "ngram", "jump", or None (proposed nothing)
    forwards: int = 0  # draft model forwards it took (0: the draft model sat out)
    parents: torch.Tensor | None = None  # [B, N] a tree's: each node's parent slot in [root, d_1..d_N]
    path: torch.Tensor | None = None  # [B, depth+1] the accepted path's slots in the tree, from the root
    nodes: int = 0  # a tree's nodes (N), after verification too

    @classmethod
    def none(cls, last: torch.Tensor) -> "Proposal":
        """A plain step's: nothing proposed. last: [B]."""
        B = last.shape[0]
        return cls(last.new_zeros(B, 0), None, [0] * B, [None] * B)

    @property
    def width(self) -> int:
        return self.tokens.shape[1]

    def won(self, n: torch.Tensor) -> torch.Tensor:
        """[B]: the slot of each row's accepted path's end in a checked tree ([0] for a chain).
        n: [B] the paths' lengths."""
        return self.path.gather(1, n[:, None])[:, 0] if self.path is not None else n[:0]

    def rank(self, slot: int) -> int:
        """A tree slot's rank in its depth (the nodes lie depth by depth after the root)."""
        return (slot - 1) % (self.nodes // self.width)

    def short_lengths(self) -> torch.Tensor | None:
        """lengths on the device ([B]), or None when every row proposes all G."""
        if all(k == self.width for k in self.lengths):
            return None
        return on_device(self.lengths, self.tokens.device)


def on_device(values: list, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A host list as a device tensor: a copy that does not wait for the device."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def looked_up(drafters: list, rows: int, gamma: int, device: torch.device) -> Proposal:
    """Host drafters' proposals (each has `source` and lookup(b, gamma) -> up to gamma host ids):
    each row takes the first drafter's that has any."""
    found, sources = [[] for _ in range(rows)], [None] * rows
    for b in range(rows):
        for drafter in drafters:
            found[b] = drafter.lookup(b, gamma)
            if found[b]:
                sources[b] = drafter.source
                break
    width = max(map(len, found))
    padded = [tokens + [0] * (width - len(tokens)) for tokens in found]
    tokens = on_device(padded, device).reshape(rows, width)  # [B, G]
    return Proposal(tokens, None, [len(t) for t in found], sources)
