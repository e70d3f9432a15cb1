"""The job-wide suffix index: frequency order, the confidence cut, the size cap, rows that share a
prefix, the row's own text, and every proposal checked against counts taken by brute force."""

import random

import pytest

from batchspec.decoding.suffix_index import Draft, RowText, SuffixIndex, propose


def occurrences(completions: list[tuple], s: list[int], depth: int) -> int:
    """How often s occurs in the completions (what a node's count must be; s no longer than depth)."""
    n = len(s)
    return sum(q[p : p + n] == tuple(s) for q in completions for p in range(len(q) - n + 1)) if n <= depth else 0


def best_of_every_match(index: SuffixIndex, context: list[int], gamma: int) -> tuple[int, list[float]]:
    """The lookup's definition, without its shortcuts: every match length's proposal followed,
    the best score taken, a longer match on ties. Returns its (match length, confidences)."""
    tail, best = context[-(index.max_depth - 1) :], (0.0, 0, [])
    for match_len in range(1, len(tail) + 1):
        found = index._match(tail, len(tail) - match_len)
        if found is None:
            break
        tokens, probs = index._follow(*found, gamma, index.min_prob / index.reliability)
        if tokens and sum(probs) >= best[0]:
            best = (sum(probs), match_len, probs)
    return best[1], best[2]


def check_counts(index: SuffixIndex, context: list[int], gamma: int) -> None:
    """The lookup's proposal is the best of every match length's; it follows the most frequent
    continuation at every token, its confidences the products of count(next) / (count(here) + 1),
    every one >= min_prob, no longer than gamma."""
    draft = index.lookup(context, gamma)
    assert len(draft.tokens) == len(draft.probs) <= gamma
    assert (draft.match_len, draft.probs) == best_of_every_match(index, context, gamma)
    if not draft.tokens:
        return
    kept = list(index.completions)
    path, prob = list(context[len(context) - draft.match_len :]), 1.0
    assert occurrences(kept, path, index.max_depth) > 0
    for token, confidence in zip(draft.tokens, draft.probs):
        following = {t: occurrences(kept, path + [t], index.max_depth) for t in set(sum(map(list, kept), []))}
        assert following[token] == max(following.values()) > 0
        prob *= following[token] / (occurrences(kept, path, index.max_depth) + 1)
        assert confidence == pytest.approx(prob) and confidence >= index.min_prob
        path.append(token)


def test_proposals_match_brute_force_counts_through_evictions():
    rng = random.Random(0)
    for _ in range(60):
        depth, alphabet = rng.randint(2, 7), rng.randint(2, 4)  # few symbols: many shared suffixes
        index = SuffixIndex(max_tokens=rng.randint(8, 50), max_depth=depth, min_prob=rng.choice([0.0, 0.3]))
        for _ in range(rng.randint(1, 12)):
            index.add([rng.randrange(alphabet) for _ in range(rng.randint(1, 12))])
            assert index.tokens == sum(map(len, index.completions)) <= index.max_tokens
            for _ in range(3):
                check_counts(index, [rng.randrange(alphabet) for _ in range(rng.randint(1, 10))], rng.randint(1, 5))
        fresh = SuffixIndex(max_tokens=index.max_tokens, max_depth=depth)
        for completion in index.completions:
            fresh.add(list(completion))
        assert fresh.node_count() == index.node_count()  # evicting merged every split that no longer branches


def test_frequency_order_the_continuation_seen_most_often_wins():
    index = SuffixIndex(min_prob=0.0)
    for tail in ([5, 6], [5, 6], [7, 8]):  # after 1 2 3: "5 6" twice, then "7 8" once, the latest
        index.add([1, 2, 3] + tail)
    draft = index.lookup([0, 1, 2, 3], 2)
    assert draft.tokens == [5, 6] and draft.source == "suffix"
    assert draft.probs == [pytest.approx(2 / 4), pytest.approx(2 / 4 * 2 / 3)]  # count(next) / (count(here) + 1)
    assert draft.match_len == 3  # every match length scores the same here: the longest wins
    index.add([1, 2, 3, 7, 8])
    index.add([1, 2, 3, 7, 8])  # now "7 8" follows 3 times in 5
    assert index.lookup([1, 2, 3], 2).tokens == [7, 8]


def test_confidence_cut_a_weak_match_proposes_little_or_nothing():
    index = SuffixIndex(min_prob=0.3)
    for value in range(50, 56):  # after 40: six different values, each seen once
        index.add([40, value, 41, 42, 43])
    assert index.lookup([9, 40], 8) == Draft()  # 1/7 < 0.3: nothing
    assert index.lookup([9, 40, 50], 8).tokens == [41]  # seen once: 1/2, then 1/4 < 0.3
    for _ in range(9):
        index.add([60, 61, 62, 63, 64, 65])  # a form seen 9 times: 0.9 a token
    strong = index.lookup([9, 60], 8)
    assert strong.tokens == [61, 62, 63, 64, 65]
    assert strong.probs == pytest.approx([0.9**k for k in range(1, 6)])


def test_rejected_proposals_make_the_index_propose_less_until_the_record_fades():
    index = SuffixIndex(min_prob=0.5)
    for _ in range(3):
        index.add([60, 61, 62, 63, 64, 65])  # seen 3 times: 3/4 a token
    assert index.lookup([60], 8).tokens == [61, 62]  # 0.75 ** 2 = 0.56 >= 0.5
    for _ in range(10):
        index.verified(index.lookup([60], 8), 0)  # the target took none of them
    assert index.reliability < 2 / 3 and index.lookup([60], 8) == Draft()  # 0.75 x reliability < 0.5
    index.verified(Draft([1], [1.0], 1, "own"), 0)  # the own text's drafts do not count
    for _ in range(20_000):  # lookups with nothing proposed: the record fades back to the prior
        index.lookup([1], 8)
    assert index.reliability > 0.9 and index.lookup([60], 8).tokens == [61, 62]


def test_size_cap_oldest_completions_leave_first_and_nodes_stay_bounded():
    rng = random.Random(1)
    index = SuffixIndex(max_tokens=200, max_depth=8)
    completions = [[c * 1000 + rng.randrange(5) for _ in range(20)] for c in range(300)]  # own ids, repetitive
    nodes = []
    for count, completion in enumerate(completions, 1):
        index.add(completion)
        assert index.tokens <= 200
        if count % 50 == 0:
            nodes.append(index.node_count())
    assert [list(kept) for kept in index.completions] == completions[-10:]  # the newest 10 stayed
    assert max(nodes) <= 2 * 200 + 1  # a leaf and a split at most per kept suffix
    assert index.lookup(completions[-11], 4) == Draft()  # the ones before left the index
    assert index.lookup(completions[-1][:8], 4).tokens  # the newest did not
    fresh = SuffixIndex(max_tokens=200, max_depth=8)
    for completion in completions[-10:]:
        fresh.add(completion)
    assert fresh.node_count() == index.node_count()  # evictions leave the tree a fresh one would build


def test_a_completion_longer_than_the_cap_keeps_its_start():
    index = SuffixIndex(max_tokens=5)
    index.add([1, 2, 3])
    index.add(list(range(10, 20)))
    assert index.tokens == 5 and [list(kept) for kept in index.completions] == [[10, 11, 12, 13, 14]]


def test_rows_that_share_a_prefix():
    index = SuffixIndex(min_prob=0.0)
    prompt = [100, 101, 102]  # one system prompt before every row
    index.add([1, 2, 3, 4])
    index.add([1, 2, 3, 5])
    index.add([1, 2, 6, 7])
    rows = [RowText(prompt + [1]), RowText(prompt + [1, 2]), RowText(prompt + [1, 2, 6])]
    drafts = [propose(index, row, 3) for row in rows]
    assert drafts[0].tokens == [2, 3, 4] and drafts[0].probs == pytest.approx([3 / 4, 3 / 8, 1 / 8])
    assert drafts[1].tokens == [3, 4] and drafts[1].probs == pytest.approx([2 / 4, 1 / 6])
    assert drafts[1].match_len == 2
    assert drafts[2].tokens == [7] and drafts[2].match_len == 3  # the one that went "6" goes on with "7"
    assert all(d.source == "suffix" for d in drafts)


def test_the_rows_own_text_when_the_index_has_nothing():
    row = RowText([5, 6, 7, 8, 9, 5, 6])  # the prompt repeats "5 6": prompt lookup proposes what followed
    draft = propose(SuffixIndex(), row, 4)
    assert draft.tokens == [7, 8, 9, 5] and draft.source == "own" and draft.match_len == 2
    row.extend([7, 8])
    assert propose(SuffixIndex(), row, 3).tokens == [9, 5, 6]
    assert propose(SuffixIndex(), RowText([1, 2, 3]), 4) == Draft()  # no match anywhere
    assert propose(SuffixIndex(), row, 0) == Draft()


def test_the_longer_match_wins_between_own_text_and_index():
    index = SuffixIndex(min_prob=0.0)
    index.add([1, 2, 3, 4, 5, 6])
    row = RowText([9, 3, 4, 8, 1, 2, 3, 4])  # own text matched "3 4" (2), the index "1 2 3 4" (4)
    assert propose(index, row, 2) == Draft([5, 6], [0.5, 0.25], 4, "suffix")
    row = RowText([1, 2, 3, 4, 7, 7, 1, 2, 3, 4])  # own text matches 4 tokens back, the index too:
    assert propose(index, row, 2).source == "suffix"  # a tie goes to the index
    row.extend([7])  # own: "4 7" and back to "1 2 3 4 7" (5); the index has no "7"
    assert propose(index, row, 3) == Draft([7, 1, 2], [1.0] * 3, 5, "own")


def test_deterministic():
    rng = random.Random(2)
    completions = [[rng.randrange(6) for _ in range(rng.randint(3, 15))] for _ in range(80)]
    contexts = [[rng.randrange(6) for _ in range(12)] for _ in range(40)]

    def run() -> list[Draft]:
        index = SuffixIndex(max_tokens=300, max_depth=10, min_prob=0.1)
        for completion in completions:
            index.add(completion)
        return [propose(index, RowText(context), 6) for context in contexts]

    assert run() == run()


def test_arguments_checked():
    with pytest.raises(ValueError, match="max_depth"):
        SuffixIndex(max_depth=1)
    with pytest.raises(ValueError, match="min_prob"):
        SuffixIndex(min_prob=1.5)
