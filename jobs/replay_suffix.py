"""Replay what model-free drafters would have proposed over a job's greedy outputs: tokens per
target step without running a model, for the job-wide suffix index
(batchspec.decoding.suffix_index) beside prompt lookup over the row's own text.

    .venv/bin/batchspec run INPUT --out AR.jsonl --mode ar --max-new-tokens 64 --token-ids --no-progress --chat
    .venv/bin/python jobs/replay_suffix.py INPUT AR.jsonl [--rows 64] [--gamma 8] [--batch 1]
                                          [--min-prob 0.1] [--max-tokens N]

Greedy decoding is deterministic, so the target's output is known: a step proposes from the
row's context (prompt + output so far), accepts the longest prefix of the proposal equal to the
true continuation and adds one token of its own. The first step is the prefill's, a plain one.
Rows run in input order, --batch at a time; the index gets a group's completions once the whole
group is done (a lower bound: in a run, a row that ends early already helps its batch mates).
Methods:
- own: the row's own text only (today's --draft ngram, n-grams 2..4, gamma tokens per match);
- latest: n-grams 6..2 over the row's own text, then over the earlier completions, the latest
  occurrence's continuation, gamma tokens (the issue's measurement);
- index: the suffix index alone (frequency order, the confidence cut);
- suffix: the index and the row's own text, the longer match winning (suffix_index.propose).
The indexes hear what was accepted of their proposals (SuffixIndex.verified), as the drafter's will.
Prints per method: tokens per target step, tokens proposed per step, and the share accepted.
"""

import argparse
import json
from dataclasses import dataclass

from batchspec.buckets import make_encoder
from batchspec.decoding.suffix_index import DEFAULT_MAX_TOKENS, DEFAULT_MIN_PROB, Draft, RowText, SuffixIndex, propose
from batchspec.defaults import default_target
from batchspec.models import load_tokenizer
from batchspec.sources import Row, read_jsonl


@dataclass
class Tally:
    """One method's totals over the replay."""

    tokens: int = 0  # output tokens
    steps: int = 0  # target forwards (the prefill's included)
    proposed: int = 0
    accepted: int = 0

    def line(self, name: str) -> str:
        """Its row of the markdown table."""
        share = self.accepted / self.proposed if self.proposed else 0.0
        return (f"| {name} | {self.tokens / self.steps:.2f} | {self.proposed / self.steps:.2f} | {share:.2f} |")


class Latest:
    """The issue's lookup: the longest n-gram (n_max..n_min) of the context's end found first in
    the row's own text, then in the earlier completions (one list, separators between them),
    and the continuation of its latest occurrence."""

    def __init__(self, n_min: int = 2, n_max: int = 6):
        self.n_min, self.n_max = n_min, n_max
        self.earlier: list[int] = []
        self.positions: dict[tuple, int] = {}  # n-gram -> where its latest continuation starts in `earlier`

    def add(self, tokens: list[int]) -> None:
        """Append one finished completion, indexing its n-grams."""
        for token in tokens + [-1]:  # -1: no n-gram runs across two completions
            end = len(self.earlier)
            for n in range(self.n_min, min(self.n_max, end) + 1):
                self.positions[tuple(self.earlier[end - n :])] = end
            self.earlier.append(token)

    def lookup(self, context: list[int], own: dict, gamma: int) -> list[int]:
        """Up to gamma tokens: own text first at each n, then the earlier completions."""
        L = len(context)
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            key = tuple(context[L - n :])
            if key in own:
                end = own[key]
                return [context[end + k % (L - end)] for k in range(gamma)]
            if key in self.positions:
                end = self.positions[key]
                return [t for t in self.earlier[end : end + gamma] if t != -1][:gamma]
        return []


def accepted(proposal: list[int], truth: list[int]) -> int:
    """The longest prefix of the proposal equal to the true continuation (greedy acceptance)."""
    n = 0
    for drafted, true in zip(proposal, truth):
        if drafted != true:
            break
        n += 1
    return n


def load(path: str, out: str, rows: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy output ids) of the first `rows` rows of INPUT, in input order."""
    tokenizer = load_tokenizer(default_target())
    good = [item for item in read_jsonl(path) if isinstance(item, Row)]
    prompts = make_encoder(tokenizer, context_length=None, max_new_tokens=0, truncate=None)(good)
    outputs = {}
    with open(out) as f:
        for line in f:
            record = json.loads(line)
            if "token_ids" in record:
                outputs[record["id"]] = record["token_ids"]
    pairs = [(list(ids), outputs[row.id]) for row, ids in zip(good, prompts) if row.id in outputs]
    return pairs[:rows]


def replay(pairs, gamma: int, batch: int, max_tokens: int, min_prob: float) -> dict[str, Tally]:
    """Every method's tally over the rows, `batch` at a time (each method its own index)."""
    methods = ("own", "latest", "index", "suffix")
    tallies = {method: Tally() for method in methods}
    sources = {"latest": Latest(), "index": SuffixIndex(max_tokens=max_tokens, min_prob=min_prob),
               "suffix": SuffixIndex(max_tokens=max_tokens, min_prob=min_prob)}
    for first in range(0, len(pairs), batch):
        group = pairs[first : first + batch]
        for method in methods:
            run_group(method, group, gamma, sources.get(method), tallies[method])
        for prompt, output in group:  # every method has run the group: the indexes learn it now
            for source in sources.values():
                source.add(output)
    return tallies


def run_group(method: str, group, gamma: int, source, tally: Tally) -> None:
    """One method over one group of rows: each row's steps, from `source` as it stood before the group."""
    for prompt, output in group:
        row = RowText(prompt + output[:1])
        t, steps = 1, 1  # the prefill's step gave the first token
        while t < len(output):
            draft = proposed(method, row, gamma, source)
            n = accepted(draft.tokens, output[t:])
            if isinstance(source, SuffixIndex):
                source.verified(draft, n)
            advance = min(n + 1, len(output) - t)
            row.extend(output[t : t + advance])
            tally.proposed += len(draft.tokens)
            tally.accepted += min(n, advance)
            t += advance
            steps += 1
        tally.tokens += len(output)
        tally.steps += steps


def proposed(method: str, row: RowText, gamma: int, source) -> Draft:
    """What `method` proposes for the row now."""
    if method == "own":
        return row.lookup(gamma)
    if method == "latest":
        return Draft(source.lookup(row.tokens, row.latest, gamma))
    if method == "index":
        return source.lookup(row.tokens, gamma)
    return propose(source, row, gamma)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("input")
    parser.add_argument("ar_out")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=8)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--min-prob", type=float, default=DEFAULT_MIN_PROB)
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    args = parser.parse_args()
    pairs = load(args.input, args.ar_out, args.rows)
    tallies = replay(pairs, args.gamma, args.batch, args.max_tokens, args.min_prob)
    print(f"{args.input}: {len(pairs)} rows, {sum(len(o) for _, o in pairs)} tokens, gamma <= {args.gamma}, "
          f"batch {args.batch}, min_prob {args.min_prob}")
    print("| proposals from | tokens per target step | proposed per step | accepted share |\n|---|---|---|---|")
    for method, tally in tallies.items():
        print(tally.line(method))


if __name__ == "__main__":
    main()
