"""N-gram lookup: the incremental index proposes exactly what a scan of the whole context would."""

import random
from types import SimpleNamespace

import torch

from batchspec.decoding.drafters import NgramDrafter


def scanned(context: list[int], n_min: int, n_max: int, gamma: int) -> list[int]:
    """The definition, by brute force: the longest suffix (n_max..n_min) with an earlier
    occurrence, its latest one, and what followed it (repeating where it reaches the end)."""
    L = len(context)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        for end in range(L - 1, n - 1, -1):  # where the continuation starts, latest first
            if context[end - n : end] == context[L - n :]:
                return [context[end + k % (L - end)] for k in range(gamma)]
    return []


def test_lookup_equals_a_scan_of_the_whole_context():
    rng = random.Random(0)
    for trial in range(40):
        n_min = rng.randint(1, 3)
        n_max = rng.randint(n_min, 5)
        alphabet = rng.randint(2, 6)  # few symbols: many matches, of every length
        prompts = [[rng.randrange(alphabet) for _ in range(rng.randint(1, 12))] for _ in range(3)]
        drafter = NgramDrafter(prompts, n_min, n_max, torch.device("cpu"))
        contexts = [list(p) for p in prompts]
        for _ in range(15):
            gamma = rng.randint(1, 6)
            proposal = drafter.propose(None, gamma, None, None)
            for b, context in enumerate(contexts):
                expected = scanned(context, n_min, n_max, gamma)
                assert proposal.lengths[b] == len(expected)
                assert proposal.tokens[b, : len(expected)].tolist() == expected
                assert proposal.sources[b] == ("ngram" if expected else None)
            assert proposal.tokens.shape == (3, max(proposal.lengths))
            appended = [[rng.randrange(alphabet) for _ in range(rng.randint(1, 4))] for _ in contexts]
            drafter.verified(SimpleNamespace(blocks=appended))  # what the step's report tells a lookup
            contexts = [c + a for c, a in zip(contexts, appended)]


def test_examples():
    drafter = NgramDrafter([[1, 2, 3, 9, 1, 2], [5, 6, 7], [4, 4, 4]], 1, 3, torch.device("cpu"))
    proposal = drafter.propose(None, 4, None, None)
    assert proposal.tokens[0].tolist() == [3, 9, 1, 2]  # "1 2" recurs: what followed it, then it again
    assert proposal.lengths == [4, 0, 4]  # "7" never occurred before: no proposal
    assert proposal.tokens[2].tolist() == [4, 4, 4, 4]  # period 1
    drafter.select(torch.tensor([0, 2]), [0, 2])
    assert drafter.contexts == [[1, 2, 3, 9, 1, 2], [4, 4, 4]]
