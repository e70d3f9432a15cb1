"""A draft model's token tree: the `width` likeliest continuations at every depth, a beam over
the draft's summed log-probabilities (as EAGLE-2 grows its trees), checked by the target in one
forward (decoding/tree.py).

Depth 1 holds the draft's top `width` tokens after the newest one; each further depth the top
`width` children of the previous depth's nodes, by the draft's log-probability of their whole
path. Each depth is one batched draft forward over the previous depth's nodes with a tree mask
(BatchKV.forward_tree): a tree of depth D costs D draft forwards like a chain of D, and puts
width × D slots in the target's verify. Width 1 is the chain.

Greedy only: sampling from several drafts needs multi-draft rejection sampling (SpecInfer),
which this does not do; nor do grammars, whose matchers read a chain. The engine gives such
batches the chain (ModelDrafter), with the same output either way, as it does when the gamma
policy finds the chain pays more. The tree grows from the draft's unprocessed log-probabilities
(greedy output does not depend on them); the target processes each slot after its own
ancestors.
"""

import torch

from batchspec.decoding.drafters.model import ModelDrafter, fit_width
from batchspec.decoding.drafters.proposal import Proposal
from batchspec.decoding.kv_cache import uses_alibi


def tree_problem(models: list) -> str | None:
    """Why these models cannot verify trees (None: they can)."""
    for model in models:
        if model is not None and uses_alibi(model.config):
            return (f"{model.config.model_type} models read their ALiBi biases from a 2D mask and take no tree "
                    "attention mask: one draft's chains only (no --tree-width, one --draft)")
    return None


class TreeDrafter(ModelDrafter):
    def __init__(self, *args, width: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.width = width

    def propose_tree(self, last: torch.Tensor, gamma: int) -> Proposal:
        """A tree of depth gamma: tokens and parents [B, width × gamma], depth by depth (greedy;
        propose, inherited, proposes the chain)."""
        self.catch_up()
        B, W = last.shape[0], self.width
        ids = torch.cat([self.owed, last[:, None]], dim=1)  # [B, K+1]
        mask = torch.cat([self.owed_mask, torch.ones_like(ids[:, :1])], dim=1)
        logits = self.kv.forward(ids, mask, logits_to_keep=1)  # [B, 1, Vd]: after the root
        score = torch.zeros(B, 1, device=last.device)  # [B, w]: log q of each frontier node's path
        tokens, parents = [], []  # per depth [B, W]: the nodes, their parents' slots in [root, d_1..d_N]
        for depth in range(gamma):
            if depth:  # the previous depth's nodes through the draft; their tree slots are their verify slots - 1
                logits = self.kv.forward_tree(tokens[-1], parents[-1] - 1, depth)  # [B, W, Vd]
            log_q = torch.log_softmax(fit_width(logits, self.vocab).float(), dim=-1)  # [B, w, V]
            score, best = (score[:, :, None] + log_q).flatten(1).topk(W, dim=-1)  # [B, W]
            frontier = best // self.vocab  # [B, W]: which node of the previous depth
            tokens.append(best % self.vocab)
            parents.append(frontier + (1 + (depth - 1) * W if depth else 0))
        return Proposal(torch.cat(tokens, dim=1), None, [gamma] * B, ["model"] * B, forwards=gamma,
                        parents=torch.cat(parents, dim=1), nodes=W * gamma)

    def verified(self, report) -> None:
        """After a tree: keep the accepted path's nodes the draft ran (depth < gamma); owe the
        deepest node when the whole depth was accepted."""
        proposal, n = report.proposal, report.n
        if proposal.path is None:
            return super().verified(report)
        self.noted(report.blocks)
        gamma = proposal.width
        self.kv.take_tree((proposal.path[:, 1:gamma] - 1).clamp(min=0))  # [B, gamma-1] its tree slots
        self.kept(proposal.tokens, n, n, max(report.accepted), first=gamma - 1)  # as after its own chain
