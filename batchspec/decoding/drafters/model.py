"""A draft model: gamma batched forwards propose d_1..d_G for every row.

The draft's cache lags the target's by the tokens it has not run through itself yet: the prompt
at first, then its last proposal after a fully accepted step, and every token of the steps
taken without speculation (gamma 0). Those are `owed`, right-aligned ([B, K], a 0 in
`owed_mask` where a row owes fewer), and ride in the next proposal's first forward, ahead of the
newest token: one batched forward catches the draft up however long it sat out, and a batch
that never speculates never runs the draft at all.
"""

import torch

from batchspec.decoding.kv_cache import BatchKV
from batchspec.decoding.sampling import SamplingParams, probabilities, sample


def fit_width(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Draft logits [..., Vd] -> [..., vocab]: compare on the shared ids, never propose others."""
    if logits.shape[-1] >= vocab:
        return logits[..., :vocab]
    pad = logits.new_full((*logits.shape[:-1], vocab - logits.shape[-1]), float("-inf"))
    return torch.cat([logits, pad], dim=-1)


class ModelDrafter:
    def __init__(self, model, ids: torch.Tensor, mask: torch.Tensor, vocab: int):
        """A draft that owes each prompt but its last token (the newest, fed by the first step).
        ids, mask: [B, P] left-padded; vocab: the target's logit width."""
        self.kv = BatchKV(model, ids.shape[0], ids.device)
        self.vocab = vocab
        self.owed, self.owed_mask = ids[:, :-1], mask[:, :-1]  # [B, P-1]

    @staticmethod
    def forwards(gamma: int) -> int:
        """Draft forwards a proposal of gamma tokens takes."""
        return gamma

    @property
    def behind(self) -> int:
        """Slots of owed tokens the next proposal must first feed (host int)."""
        return self.owed.shape[1]

    def propose(self, last: torch.Tensor, gamma: int, params: SamplingParams, u: torch.Tensor | None):
        """G = gamma forwards; the first also feeds the owed tokens. Returns tokens [B, G] and q
        [B, G, V] (None when greedy). u: [B, G] uniforms for sampled drafts."""
        ones = torch.ones_like(last)[:, None]  # [B, 1]
        ids = torch.cat([self.owed, last[:, None]], dim=1)  # [B, K+1]
        mask = torch.cat([self.owed_mask, ones], dim=1)
        tokens, qs = [], []
        for i in range(gamma):
            logits = fit_width(self.kv.forward(ids, mask, logits_to_keep=1)[:, -1], self.vocab)  # [B, V]
            if params.greedy:
                x = logits.argmax(-1)
            else:
                qs.append(probabilities(logits, params))
                x = sample(qs[-1], u[:, i])
            tokens.append(x)
            ids, mask = x[:, None], ones
        return torch.stack(tokens, dim=1), (torch.stack(qs, dim=1) if qs else None)

    def verified(self, last: torch.Tensor, tokens: torch.Tensor, n: torch.Tensor, max_n: int) -> None:
        """Cut the draft cache to each row's accepted prefix and note what it now owes."""
        gamma = tokens.shape[1]
        if gamma == 0:  # a plain step: `last` went into the target's cache only
            self.owed = torch.cat([self.owed, last[:, None]], dim=1)
            self.owed_mask = torch.cat([self.owed_mask, torch.ones_like(last)[:, None]], dim=1)
            return
        # the draft ran last, d_1..d_{G-1}: a row keeps last, d_1..d_n (all of them when n = G)
        self.kv.rollback((n + 1).clamp(max=gamma), gamma, min(max_n + 1, gamma))
        owes = max_n == gamma  # some row accepted everything: d_G is not in the draft cache
        self.owed = tokens[:, gamma - 1 : gamma if owes else gamma - 1]  # [B, 1] or [B, 0]
        self.owed_mask = (n == gamma).long()[:, None][:, : int(owes)]

    def select(self, keep: torch.Tensor) -> None:
        self.kv.select(keep)
        self.owed, self.owed_mask = self.owed[keep], self.owed_mask[keep]

    def compact(self) -> None:
        self.kv.compact()
