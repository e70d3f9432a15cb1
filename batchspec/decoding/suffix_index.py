"""Model-free drafting from what the job has already written: a bounded suffix index over earlier
completions, beside the row's own prompt and output (SuffixDecoding, Oliaro et al. 2024,
arXiv 2411.04975; Snowflake's Arctic Inference, `arctic_inference/suffix_decoding`).

Glossary:
- suffix tree: every suffix of every kept completion, cut to `max_depth` tokens, in one trie whose
  unbranched runs are single nodes (an edge label is a slice of a completion); a node's `count`
  is how many kept suffixes pass through it, i.e. how often its string occurred.
- match: a suffix of the row's context (prompt + output so far) found in the tree.
- proposal: from the matched point, the child seen most often, again and again. Each token's
  confidence is the last one's times count(next) / (count(here) + 1): Laplace's rule of
  succession, the chance that one more occurrence goes on the same way. A continuation seen once
  gets 1/2, then 1/4; one seen 9 times in 9, 0.9 a token. (SuffixDecoding's count(next) /
  count(here) rates a continuation seen once 1.0 a token: replaying templated rows,
  jobs/replay_suffix.py, tokens so rated were accepted 42 % of the time, where those this
  estimate rates 0.8-1.0 were accepted about 80 %.) A proposal
  stops where the confidence times the index's reliability falls below `min_prob`: about what
  one more verified position costs, over a step's. Of every match
  length the proposal of best `score` (the confidences' sum) is taken (a longer match wins
  ties), as Arctic Inference does.
- reliability: the tokens the target accepted over the confidence summed, of the index's recent
  proposals (`verified`), at most 1. How often a continuation seen before comes again is the
  job's own: in the replay a confidence of 0.4 was accepted 41 % of the time on templated rows,
  7 % on open-ended ones. Scaled by it, the cut needs no constant per kind of job; the record
  fades over ~4096 lookups, so a job that stopped proposing tries again later.
- own text: the row's own context, looked up as the n-gram drafter does (drafters/ngram.py), so
  that prompts an output copies (fix typos, convert to JSON) keep what prompt lookup gets there.
  `propose` takes the own text's proposal where it matched a longer suffix than the index did.

Bounded: completions leave oldest first once the tokens kept pass `max_tokens`. Each node's label
points into the newest completion that passed through it, so with oldest-first eviction a node
outlives every completion it points into, and one merged back into its only child stays a
contiguous slice. Costs: `add` is O(L * max_depth) for a completion of L tokens (eviction the
same), a lookup O(max_depth^2) whatever the index's size.
"""

from collections import deque
from dataclasses import dataclass, field

# ~290 bytes of RSS a kept token (jobs/suffix_memory.py): ~28 MiB at the cap, beside a model's hundreds.
# It keeps the latest ~1,500 completions of 64 tokens; a templated job's forms show within tens of rows
# (replay of 64 templated rows: 2.72 tokens a step with 300 tokens kept, 2.89 with 3,000).
DEFAULT_MAX_TOKENS = 100_000
DEFAULT_MAX_DEPTH = 24  # longest suffix kept: match plus proposal (gamma <= 8 leaves 16 tokens of match)
# The least confidence (times reliability) a proposed token needs: a verified position costs a tenth of a
# plain step at batch 1 on CPU, a third at batch 8 (why 0.25 and not 0.1: docs/performance.md, "The suffix index").
DEFAULT_MIN_PROB = 0.25
RELIABILITY_PRIOR = 8.0  # the reliability starts as if 8 expected tokens had all been accepted
RELIABILITY_FADE = 1 - 1 / 4096  # per lookup: the record spans ~4096 lookups, then the prior returns


@dataclass(frozen=True)
class Draft:
    """One row's proposal: tokens [k] (k <= gamma) and each one's confidence [k] (cumulative,
    non-increasing; the index's before its reliability scales it, 1.0 for the own text);
    match_len: the context tokens it followed; source: 'suffix' (earlier completions), 'own'
    (the row's own text) or None (nothing proposed)."""

    tokens: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    match_len: int = 0
    source: str | None = None

    @property
    def score(self) -> float:
        """The confidences' sum: the tokens this proposal is expected to get accepted (times the
        index's reliability, for the index's)."""
        return sum(self.probs)


class _Node:
    """A trie node: its edge label is seq[start : start + length]; count: the suffixes through it;
    children: first token -> node (None for a leaf); best: the child of highest count, None when
    unknown (recomputed on demand)."""

    __slots__ = ("count", "seq", "start", "length", "children", "best")

    def __init__(self, count: int, seq: tuple, start: int, length: int):
        self.count, self.seq, self.start, self.length = count, seq, start, length
        self.children: dict[int, "_Node"] | None = None
        self.best: "_Node | None" = None


class SuffixIndex:
    """The job-wide index: finished completions in, proposals out; at most `max_tokens` tokens kept
    (oldest completions leave first), suffixes cut to `max_depth` tokens; a proposal stops where
    its confidence times `reliability` falls below `min_prob`. `verified` tells it what the
    target accepted of its proposals."""

    def __init__(self, *, max_tokens: int = DEFAULT_MAX_TOKENS, max_depth: int = DEFAULT_MAX_DEPTH,
                 min_prob: float = DEFAULT_MIN_PROB):
        if max_tokens < 1 or max_depth < 2:
            raise ValueError(f"max_tokens must be >= 1 and max_depth >= 2, got {max_tokens} and {max_depth}")
        if not 0.0 <= min_prob <= 1.0:
            raise ValueError(f"min_prob must be in [0, 1], got {min_prob}")
        self.max_tokens, self.max_depth = max_tokens, max_depth
        self.min_prob = min_prob
        self.root = _Node(0, (), 0, 0)
        self.completions: deque[tuple] = deque()  # kept completions, oldest first
        self.tokens = 0  # tokens kept, the sum of the completions' lengths
        self.expected = 0.0  # the confidences of the tokens it proposed, summed (fading)
        self.accepted = 0.0  # the tokens of those the target accepted (fading)

    def __len__(self) -> int:
        """Completions kept."""
        return len(self.completions)

    def add(self, tokens: list[int]) -> None:
        """Index one finished completion (its token ids), first evicting the oldest ones until it
        fits under max_tokens (a completion longer than that keeps its first max_tokens)."""
        seq = tuple(tokens[: self.max_tokens])
        while self.completions and self.tokens + len(seq) > self.max_tokens:
            self._evict()
        for i in range(len(seq)):
            self._insert(seq, i, min(i + self.max_depth, len(seq)))
        self.completions.append(seq)
        self.tokens += len(seq)

    @property
    def reliability(self) -> float:
        """Accepted over expected tokens of the index's recent proposals, with the prior; at most 1."""
        return min(1.0, (self.accepted + RELIABILITY_PRIOR) / (self.expected + RELIABILITY_PRIOR))

    def verified(self, draft: Draft, accepted: int) -> None:
        """Record that the target accepted `accepted` tokens of a draft (only the index's own count)."""
        if draft.source == "suffix":
            self.expected += draft.score
            self.accepted += min(accepted, len(draft.tokens))

    def lookup(self, context: list[int], gamma: int) -> Draft:
        """Up to gamma tokens continuing `context` (a row's prompt + output ids; only its last
        max_depth - 1 matter): of every suffix of it found in the index, the proposal of best
        score, a longer match winning ties. Draft() when nothing matches or nothing passes the cut."""
        self.expected *= RELIABILITY_FADE
        self.accepted *= RELIABILITY_FADE
        floor = self.min_prob / self.reliability  # the cut, on the unscaled confidence
        tail = context[-(self.max_depth - 1) :]
        tokens, probs, length, score = [], [], 0, 0.0  # the best proposal so far, its match length and score
        shorter = 0  # the count of the match one token shorter
        for match_len in range(1, len(tail) + 1):
            found = self._match(tail, len(tail) - match_len)
            if found is None:
                break  # a longer suffix contains this one: it is not in the index either
            node, matched = found
            extends = length == match_len - 1  # the best so far is the match one token shorter
            if node.count == shorter and (not extends or len(tokens) <= self.max_depth - match_len):
                # the same occurrences one token longer: the same continuations (not cut by the depth)
                if extends:
                    length = match_len
            else:
                found_tokens, found_probs = self._follow(node, matched, gamma, floor)
                if found_tokens and sum(found_probs) >= score:
                    tokens, probs, length, score = found_tokens, found_probs, match_len, sum(found_probs)
            shorter = node.count
        return Draft(tokens, probs, length, "suffix") if tokens else Draft()

    def node_count(self) -> int:
        """Nodes in the tree, root included (for tests and memory checks: it walks the whole tree)."""
        stack, total = [self.root], 0
        while stack:
            node = stack.pop()
            total += 1
            if node.children:
                stack.extend(node.children.values())
        return total

    def _insert(self, seq: tuple, i: int, end: int) -> None:
        """Add the suffix seq[i:end]: counts up along its path, a node split where it leaves an
        edge (or ends inside one), a leaf for its unseen rest; every node passed now points into seq."""
        node = self.root
        node.count += 1
        while i < end:
            child = node.children.get(seq[i]) if node.children else None
            if child is None:
                self._attach(node, _Node(1, seq, i, end - i))
                return
            label, start, limit = child.seq, child.start, min(child.length, end - i)
            k = 1  # the first token matched: it is the child's key
            while k < limit and label[start + k] == seq[i + k]:
                k += 1
            if k < child.length:
                child = self._split(node, child, k)
            child.count += 1
            child.seq, child.start = seq, i
            if node.best is not None and node.best is not child and child.count > node.best.count:
                node.best = child
            node, i = child, i + k

    def _evict(self) -> None:
        """Drop the oldest completion: its suffixes' counts down, nodes at zero removed, a node
        left with one child of its own count merged back into it."""
        seq = self.completions.popleft()
        self.tokens -= len(seq)
        for i in range(len(seq)):
            path = self._remove(seq, i, min(i + self.max_depth, len(seq)))
            for node in reversed(path):
                self._merge(node)

    def _remove(self, seq: tuple, i: int, end: int) -> list[_Node]:
        """Count the suffix seq[i:end] out; return the nodes left on its path (root excluded)."""
        node, path = self.root, []
        node.count -= 1
        while i < end:
            key = seq[i]
            child = node.children[key]
            child.count -= 1
            if node.best is child:
                node.best = None  # it may no longer lead
            if child.count == 0:  # its whole subtree held only this suffix
                del node.children[key]
                if not node.children:
                    node.children = None
                break
            path.append(child)
            node, i = child, i + child.length
        return path

    def _merge(self, node: _Node) -> None:
        """Fold node's only child into it when every suffix through node goes on through it
        and the two labels are one contiguous slice."""
        if not node.children or len(node.children) != 1:
            return
        (child,) = node.children.values()
        if child.count != node.count or child.seq is not node.seq or child.start != node.start + node.length:
            return
        node.length += child.length
        node.children, node.best = child.children, child.best

    def _attach(self, node: _Node, child: _Node) -> None:
        """Hang a new leaf under node."""
        if node.children is None:
            node.children, node.best = {}, child
        node.children[child.seq[child.start]] = child

    def _split(self, parent: _Node, child: _Node, k: int) -> _Node:
        """Cut child's edge after k tokens: a new node of its count takes the first k, child the
        rest below it. Returns the new node."""
        upper = _Node(child.count, child.seq, child.start, k)
        key = child.seq[child.start]
        child.start += k
        child.length -= k
        upper.children, upper.best = {child.seq[child.start]: child}, child
        parent.children[key] = upper
        if parent.best is child:
            parent.best = upper
        return upper

    def _match(self, context: list[int], i: int) -> tuple[_Node, int] | None:
        """Walk context[i:] down from the root: (node, tokens of its label matched), or None."""
        node, matched = self.root, 0
        for token in context[i:]:
            if matched == node.length:
                node = node.children.get(token) if node.children else None
                if node is None:
                    return None
                matched = 1  # its key
            elif node.seq[node.start + matched] == token:
                matched += 1
            else:
                return None
        return node, matched

    def _follow(self, node: _Node, matched: int, limit: int, floor: float) -> tuple[list[int], list[float]]:
        """From `matched` tokens into node's label, up to limit tokens: the rest of the label, then
        the most frequent child's, each token's confidence the last one's times count(next) /
        (count(here) + 1), while it stays >= floor."""
        tokens, probs, prob = [], [], 1.0
        while len(tokens) < limit:
            if matched < node.length:  # inside a label: every occurrence so far went on this way
                prob *= node.count / (node.count + 1)
            else:
                child = _best_child(node)
                if child is None:
                    break
                prob *= child.count / (node.count + 1)
                node, matched = child, 0
            if prob < floor:
                break
            tokens.append(node.seq[node.start + matched])
            probs.append(prob)
            matched += 1
        return tokens, probs


def _best_child(node: _Node) -> _Node | None:
    """node's child of highest count (of equals, a fixed one: the same operations choose the
    same), cached on the node."""
    if node.best is None and node.children:
        node.best = max(node.children.values(), key=lambda child: child.count)
    return node.best


class RowText:
    """One row's own prompt and output so far, with the n-gram index the n-gram drafter keeps
    (n-gram -> where its latest continuation starts), so a lookup costs n_max - n_min + 1 reads."""

    def __init__(self, tokens: list[int], *, n_min: int = 2, n_max: int = 4):
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        self.latest: dict[tuple, int] = {}
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        """Append tokens (the step's accepted ones and its correction), indexing the n-grams each continues."""
        context, latest = self.tokens, self.latest
        for token in tokens:
            end = len(context)
            for n in range(self.n_min, min(self.n_max, end) + 1):
                latest[tuple(context[end - n :])] = end
            context.append(token)

    def lookup(self, gamma: int, max_depth: int = DEFAULT_MAX_DEPTH) -> Draft:
        """The n-gram drafter's proposal (longest n first, the latest occurrence, repeating where it
        reaches the row's end), its match measured back to max_depth tokens; each token's
        confidence 1 (the row's own text is one occurrence)."""
        context = self.tokens
        L = len(context)
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            end = self.latest.get(tuple(context[L - n :]))
            if end is not None:
                tokens = [context[end + k % (L - end)] for k in range(gamma)]
                return Draft(tokens, [1.0] * gamma, _matched_back(context, end, n, max_depth), "own")
        return Draft()


def _matched_back(context: list[int], end: int, n: int, most: int) -> int:
    """How many tokens before `end` equal the context's last ones (n known equal), up to `most`."""
    L, m = len(context), n
    while m < most and m < end and context[end - m - 1] == context[L - m - 1]:
        m += 1
    return m


def propose(index: SuffixIndex, row: RowText, gamma: int) -> Draft:
    """One row's proposal: from the job's earlier completions or from its own text, whichever
    matched the longer suffix of its context (the index on a tie: it has counts to cut by)."""
    if gamma <= 0:
        return Draft()
    earlier = index.lookup(row.tokens, gamma)
    own = row.lookup(gamma, index.max_depth)
    if own.tokens and own.match_len > earlier.match_len:
        return own
    return earlier if earlier.tokens else own
