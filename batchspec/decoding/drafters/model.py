"""A draft model: gamma batched forwards propose d_1..d_G for every row.

The draft's cache lags the target's by the tokens it has not run through itself yet: the prompt
at first, then its last proposal after a fully accepted step, and every token of the steps
taken without it (gamma 0, or a hybrid step where every row took the n-gram's proposal), and
the accepted tokens of rows whose proposal came from elsewhere. Those are `owed` ([B, K], a 0 in
`owed_mask` where a row owes fewer: a hole), and ride in the next proposal's first forward, ahead
of the newest token: one batched forward catches the draft up however long it sat out, and a
batch that never speculates never runs the draft at all. What steps it sat out add is kept on
the host (`pending`, from the blocks the step's sync brought) and goes to the device once, when
it next runs: a plain step costs the drafter no device work.
"""

import torch

from batchspec.decoding.drafters.proposal import Proposal, on_device
from batchspec.decoding.seq2seq import model_cache
from batchspec.decoding.sampling import SamplingParams, greedy, probabilities, sample


def fit_width(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Draft logits [..., Vd] -> [..., vocab]: compare on the shared ids, never propose others."""
    if logits.shape[-1] >= vocab:
        return logits[..., :vocab]
    pad = logits.new_full((*logits.shape[:-1], vocab - logits.shape[-1]), float("-inf"))
    return torch.cat([logits, pad], dim=-1)


class ModelDrafter:
    def __init__(self, model, ids: torch.Tensor, mask: torch.Tensor, vocab: int, newest: list[int],
                 source: tuple[torch.Tensor, torch.Tensor] | None = None, static=None):
        """A draft that owes each prompt but its last token (the newest, which the prefill's plain
        step adds to what it owes).
        ids, mask: [B, P] left-padded (an encoder–decoder's decoder prompts); vocab: the
        target's logit width; newest: each prompt's last token (host); source: an
        encoder–decoder draft's prompts, right-padded; static: a static cache's plan (kv_cache.Static;
        None: dynamic)."""
        self.kv = model_cache(model, ids.shape[0], ids.device, source, static)
        self.vocab = vocab
        self.owed, self.owed_mask = ids[:, :-1], mask[:, :-1]  # [B, P-1]
        self.newest = newest  # host: each row's newest token
        self.pending: list[list[int]] = [[] for _ in newest]  # host: owed from the steps the draft sat out

    @property
    def behind(self) -> int:
        """Slots of owed tokens the next proposal must first feed (host int)."""
        return self.owed.shape[1] + max(map(len, self.pending), default=0)

    def propose(self, last: torch.Tensor, gamma: int, params: SamplingParams, u: torch.Tensor | None,
                process=None) -> Proposal:
        """G = gamma forwards; the first also feeds the owed tokens. Proposes tokens [B, G] and q
        [B, G, V] (None when greedy). u: [B, G] uniforms for sampled drafts; process(logits [B, V],
        proposals so far [B, i]) -> logits: the rows' logits processing (None: none)."""
        self.catch_up()
        ones = torch.ones_like(last)[:, None]  # [B, 1]
        ids = torch.cat([self.owed, last[:, None]], dim=1)  # [B, K+1]
        mask = torch.cat([self.owed_mask, ones], dim=1)
        tokens, qs = [], []
        for i in range(gamma):
            logits = fit_width(self.kv.forward(ids, mask, logits_to_keep=1)[:, -1], self.vocab)  # [B, V]
            if process is not None:
                logits = process(logits, torch.stack(tokens, dim=1) if tokens else last.new_zeros(len(last), 0))
            if params.greedy:
                x = greedy(logits)
            else:
                qs.append(probabilities(logits, params))
                x = sample(qs[-1], u[:, i])
            tokens.append(x)
            ids, mask = x[:, None], ones
        B = last.shape[0]
        q = torch.stack(qs, dim=1) if qs else None
        return Proposal(torch.stack(tokens, dim=1), q, [gamma] * B, ["model"] * B, forwards=gamma)

    def verified(self, report) -> None:
        """Cut the draft cache to each row's accepted prefix and note what it now owes (report:
        the step's StepReport)."""
        proposal, n, max_n = report.proposal, report.n, max(report.accepted)
        tokens, gamma, appended = proposal.tokens, proposal.width, report.blocks
        newest = self.noted(appended)
        if not proposal.forwards:  # the draft sat out: it owes `last` and each row's accepted proposals
            for pending, last_token, block in zip(self.pending, newest, appended):
                pending += [last_token, *block[:-1]]
            return
        # a row that took a proposal from elsewhere (hybrid) shares none of its path with the draft's
        others = [source != "model" for source in proposal.sources]
        common = torch.where(on_device(others, n.device, torch.bool), 0, n) if any(others) else n
        self.kept(tokens, n, common, max_n, first=0 if any(others) else gamma - 1)

    def kept(self, path: torch.Tensor, n: torch.Tensor, common: torch.Tensor, max_n: int, first: int = 0) -> None:
        """After a step in which the draft proposed a chain of G (it ran last, d_1..d_{G-1}):
        each row kept path[:, :n] (path: [B, G]), of which the draft's own proposals are the
        first common[b] <= n[b]. It keeps last and the ones it ran, and owes the rest of the
        path (all of it when the path is its own: d_G). first: no row owes a path token before
        it (host; 0 is always right)."""
        gamma = path.shape[1]
        ran = common.clamp(max=gamma - 1)  # [B]: the path's tokens the draft ran through itself
        self.kv.rollback(ran + 1, gamma, min(max_n + 1, gamma))
        slot = torch.arange(first, max(first, max_n), device=n.device)  # [K]
        owed_mask = (slot[None, :] >= ran[:, None]) & (slot[None, :] < n[:, None])  # [B, K]
        self.owed, self.owed_mask = path[:, first : first + len(slot)], owed_mask.long()

    def noted(self, appended: list[list[int]]) -> list[int]:
        """Each row's newest token after it appended `appended` (host); returns the ones before."""
        newest, self.newest = self.newest, [block[-1] if block else t for block, t in zip(appended, self.newest)]
        return newest

    def catch_up(self) -> None:
        """Move what the steps the draft sat out added (host) to the owed tokens (device)."""
        if any(self.pending):
            B, width = len(self.pending), max(map(len, self.pending))
            tokens = on_device([p + [0] * (width - len(p)) for p in self.pending], self.owed.device)
            mask = on_device([[1] * len(p) + [0] * (width - len(p)) for p in self.pending], self.owed.device)
            self.owe(tokens.reshape(B, width), mask.reshape(B, width))  # [B, W]: holes after each row's own
            self.pending = [[] for _ in self.pending]

    def owe(self, tokens: torch.Tensor, mask: torch.Tensor) -> None:
        """Add tokens [B, K] (mask [B, K]) to what the next forward must first feed."""
        self.owed = torch.cat([self.owed, tokens], dim=1)
        self.owed_mask = torch.cat([self.owed_mask, mask], dim=1)

    def select(self, keep: torch.Tensor, kept: list[int]) -> None:
        self.kv.select(keep)
        self.owed, self.owed_mask = self.owed[keep], self.owed_mask[keep]
        self.newest, self.pending = [self.newest[b] for b in kept], [self.pending[b] for b in kept]

    def compact(self, longest: int) -> None:
        """Each row's cache holds a prefix of what the target's holds: `longest` bounds it too."""
        self.kv.compact(min(longest, self.kv.length))
