"""Logits processing that depends on a row's context: logit bias, repetition, frequency and
presence penalties, min_tokens, a structured output's grammar mask, and the tokens a generation
config forces at an output index (forced BOS first, forced EOS last, as BART's and mBART's do).
Applied alike to the target's logits (p) and the draft's (q).

The target scores G+1 positions of a step at once; position i must be processed as if the
proposals before it, d_1..d_i, had been emitted. So each row's counts of its output tokens [B, V]
(and the set of tokens in its prompt and output, for the repetition penalty) are held on the
device, and each position adds the cumulative one-hot of the proposals before it: no loop over
positions, no host sync. A grammar is the exception: its matchers run on the host, so the proposals are
read there (grammar.GrammarRows). A token tree's slots (tree.py) each come after their own
ancestors: the counts add those, and a slot's output index is the row's length plus its depth
(no grammar over trees).

Order as transformers' generate applies them (logit bias, repetition penalty, min_new_tokens,
grammar mask, forced tokens), with OpenAI's frequency/presence penalties after the repetition
penalty as vLLM does; in float32, like generate's scores. Sampling warpers (temperature, top-k, top-p, min-p)
come after, in sampling.probabilities.
"""

import torch

from batchspec.decoding.grammar import GrammarRows
from batchspec.decoding.options import RowOptions


def prefix_counts(tokens: torch.Tensor, first: int, vocab: int) -> torch.Tensor:
    """tokens [B, first+J-1] -> [B, J, V]: at position j, how often each id occurs in
    tokens[:, :first+j] (the first `first` summed once, the rest cumulated)."""
    B, K = tokens.shape
    counts = torch.zeros(B, K - first + 1, vocab, dtype=torch.float32, device=tokens.device)
    counts[:, 0].scatter_add_(1, tokens[:, :first], torch.ones_like(tokens[:, :first], dtype=torch.float32))
    counts[:, 1:].scatter_(2, tokens[:, first:, None], 1.0)
    return counts.cumsum_(1)


def tree_counts(tokens: torch.Tensor, ancestors: torch.Tensor, vocab: int) -> torch.Tensor:
    """tokens [B, N] a tree's nodes, ancestors [B, N+1, N+1] over [root, d_1..d_N] -> [B, N+1, V]:
    how often each id occurs among the nodes on each slot's path, itself included (the root, the
    row's newest token, is counted already)."""
    B, N = tokens.shape
    one_hot = torch.zeros(B, N, vocab, device=tokens.device).scatter_(2, tokens[:, :, None], 1.0)  # [B, N, V]
    return ancestors[:, :, 1:].float() @ one_hot


def put(table: torch.Tensor, entries: list[tuple[int, int, float | bool]]) -> None:
    """table[row, column] = value for each entry, in one copy to the device."""
    rows, columns, values = zip(*entries)
    index = torch.tensor([rows, columns]).to(table.device, non_blocking=True)  # [2, N]
    table.index_put_((index[0], index[1]), torch.tensor(values, dtype=table.dtype).to(table.device))


class Processors:
    """The live rows' context-dependent processing; a no-op when no row asks for any."""

    def __init__(self, options: list[RowOptions], prompts: list[list[int]], ending: torch.Tensor, vocab: int,
                 device: torch.device, forced: torch.Tensor | None = None, grammar: GrammarRows | None = None):
        """ending: [B, K] the ids that end each row (-1: none), masked before min_tokens; forced:
        [B, W] the token forced at each output index (-1: none), W past every row's limit;
        grammar: the rows' grammar states (the engine advances them)."""
        B, self.vocab = len(options), vocab
        column = lambda values: torch.tensor(values, dtype=torch.float32, device=device)  # noqa: E731
        self.repetition = column([o.repetition_penalty for o in options])  # [B]
        self.frequency = column([o.frequency_penalty for o in options])  # [B]
        self.presence = column([o.presence_penalty for o in options])  # [B]
        self.min_tokens = torch.tensor([o.min_tokens for o in options], device=device)  # [B]
        self.uses = {
            "bias": any(o.logit_bias for o in options),
            "repetition": any(o.repetition_penalty != 1 for o in options),
            "counts": any(o.frequency_penalty or o.presence_penalty for o in options),
            "min_tokens": any(o.min_tokens for o in options),
            "forced": forced is not None,
            "grammar": grammar is not None and grammar.active,
        }
        self.grammar = grammar
        self.forced = forced if forced is not None else torch.zeros(B, 0, dtype=torch.long, device=device)
        self.bias = torch.zeros(B, vocab if self.uses["bias"] else 0, device=device)  # [B, V]
        if self.uses["bias"]:
            put(self.bias, [(b, token, value) for b, o in enumerate(options) for token, value in o.logit_bias.items()])
        self.counts = torch.zeros(B, vocab if self.uses["counts"] else 0, device=device)  # [B, V] output tokens
        self.seen = torch.zeros(B, vocab if self.uses["repetition"] else 0, dtype=torch.bool, device=device)
        if self.uses["repetition"]:  # [B, V] prompt and output tokens
            put(self.seen, [(b, token, True) for b, prompt in enumerate(prompts) for token in prompt])
        self.ending = torch.zeros(B, vocab + 1 if self.uses["min_tokens"] else 0, dtype=torch.bool, device=device)
        if self.uses["min_tokens"]:  # [B, V] the ids masked before min_tokens
            self.ending = self.ending.scatter_(1, torch.where(ending < 0, vocab, ending), True)[:, :vocab]

    @property
    def active(self) -> bool:
        return any(self.uses.values())

    def __call__(self, logits: torch.Tensor, proposals: torch.Tensor, produced: torch.Tensor,
                 first: int = 0, ancestors: torch.Tensor | None = None) -> torch.Tensor:
        """logits [B, J, V] at the step's positions first..first+J-1; position i comes after the
        row's proposals[:, :i] (proposals: [B, first+J-1]); produced [B]: tokens the rows had
        before the step. A tree's: proposals its N nodes, logits at [root, d_1..d_N] and
        ancestors [B, J, J] over those slots. Returns processed float32 logits [B, J, V] (logits
        itself when inactive)."""
        if not self.active:
            return logits
        J = logits.shape[1]
        scores = logits.float()
        if self.uses["bias"]:
            scores = scores + self.bias[:, None, :]
        proposed = proposals.shape[1] > 0 and (self.uses["repetition"] or self.uses["counts"])
        if ancestors is not None:
            at = produced[:, None] + ancestors.sum(-1) - 1  # [B, J] output index: the row's length + depth
            before = tree_counts(proposals, ancestors, self.vocab) if proposed else None  # [B, J, V]
        else:
            at = produced[:, None] + first + torch.arange(J, device=logits.device)  # [B, J] output index
            before = prefix_counts(proposals, first, self.vocab) if proposed else None  # [B, J, V]
        if self.uses["repetition"]:
            seen = self.seen[:, None, :] | (before > 0) if proposed else self.seen[:, None, :]  # [B, J, V]
            penalty = self.repetition[:, None, None]
            penalized = torch.where(scores < 0, scores * penalty, scores / penalty)
            scores = torch.where(seen, penalized, scores)
        if self.uses["counts"]:
            counts = self.counts[:, None, :] + before if proposed else self.counts[:, None, :]  # [B, J, V]
            scores = scores - self.frequency[:, None, None] * counts - self.presence[:, None, None] * (counts > 0)
        if self.uses["min_tokens"]:
            early = at < self.min_tokens[:, None]  # [B, J]
            scores = scores.masked_fill(early[:, :, None] & self.ending[:, None, :], float("-inf"))
        if self.uses["grammar"]:
            before = proposals.tolist() if proposals.shape[1] else [[]] * len(proposals)  # a plain step reads nothing
            allowed = self.grammar.allowed(before, first, J)  # [B, J, V]
            scores = scores.masked_fill(~allowed, float("-inf"))
        if self.uses["forced"]:  # 0 for the token, -inf for every other, as transformers' ForcedBOS/EOS do
            token = self.forced.gather(1, at.clamp(max=self.forced.shape[1] - 1))  # [B, J]
            it = torch.arange(self.vocab, device=logits.device) == token[:, :, None]  # [B, J, V]
            scores = torch.where((token >= 0)[:, :, None], torch.where(it, 0.0, float("-inf")), scores)
        return scores

    def emitted(self, new: torch.Tensor, count: torch.Tensor) -> None:
        """The rows appended new[b, :count[b]] (new: [B, G+1], count: [B])."""
        if not (self.uses["counts"] or self.uses["repetition"]):
            return
        kept = (torch.arange(new.shape[1], device=new.device)[None, :] < count[:, None]).float()  # [B, G+1]
        added = torch.zeros(new.shape[0], self.vocab, device=new.device).scatter_add_(1, new, kept)  # [B, V]
        if self.uses["counts"]:
            self.counts += added
        if self.uses["repetition"]:
            self.seen |= added > 0

    def select(self, keep: torch.Tensor) -> None:
        for name in ("repetition", "frequency", "presence", "min_tokens", "bias", "counts", "seen", "ending", "forced"):
            setattr(self, name, getattr(self, name)[keep])
