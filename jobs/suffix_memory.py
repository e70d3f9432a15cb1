"""What the job-wide suffix index (batchspec.decoding.suffix_index) costs: memory over a long job
and time per lookup and per completion added, on synthetic templated completions (a JSON-like
form around names, numbers and places drawn from large pools, and a free-text tail).

    .venv/bin/python jobs/suffix_memory.py memory [--rows 1000000] [--length 20] [--every 50000]
    .venv/bin/python jobs/suffix_memory.py speed [--index-tokens 200000] [--context 300] [--depth 24]

memory: adds --rows completions of --length tokens to one index at its default cap and prints the
process's RSS every --every rows (it must level off once the cap is reached: completions then
leave as fast as they come) with the tokens and nodes kept.
speed: fills an index to --index-tokens with ~60-token completions, then times (a) a lookup for
a row whose context is a ~--context-token prompt plus the first t tokens of a new completion
(matches end at its varying parts) or of a kept one (matches run to full depth: the worst case),
gamma 8, the index alone and with the row's own text (suffix_index.propose), and (b) adding a
completion at the cap (eviction included). Times are CPU time (process_time), per call.
"""

import argparse
import random
import resource
import time

from batchspec.decoding.suffix_index import DEFAULT_MAX_TOKENS, RowText, SuffixIndex, propose

VOCAB = 49152  # SmolLM2's
FORMS = [  # fixed token ids of three answer forms; None: a slot filled from a pool
    [90, 4, 1001, 17, None, None, 17, 12, 1002, 17, None, 12, 1003, 17, None, 17, 93],
    [2001, 42, None, 30, 2002, 42, None, None, 30, 2003, 42, None],
    [3001, 3002, None, None, 3003, None, 3004, 3005, None, 3006],
]


def completion(rng: random.Random, length: int) -> list[int]:
    """One templated completion of `length` tokens: a form with its slots filled (names, numbers,
    places from pools of thousands), then free text (random ids) up to length."""
    form = FORMS[rng.randrange(len(FORMS))]
    tokens = [rng.randrange(5000, 10000) if token is None else token for token in form]
    tokens += [rng.randrange(10000, VOCAB) for _ in range(max(0, length - len(tokens)))]
    return tokens[:length]


def rss_mib() -> float:
    """This process's resident set size now, MiB (from /proc: ru_maxrss is only the peak)."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / 2**20


def memory(rows: int, length: int, every: int, max_tokens: int) -> None:
    """Print the RSS curve of one index fed `rows` completions."""
    rng, index = random.Random(0), SuffixIndex(max_tokens=max_tokens)
    start = rss_mib()
    print(f"cap {max_tokens} tokens, completions of {length}; RSS before: {start:.1f} MiB")
    print("rows        tokens kept  nodes      RSS MiB  (index ~MiB)  bytes/kept token  add us")
    began = time.process_time()
    for row in range(1, rows + 1):
        index.add(completion(rng, length))
        if row % every == 0 or row == rows:
            took = (time.process_time() - began) / row * 1e6
            rss = rss_mib()
            per_token = (rss - start) * 2**20 / index.tokens
            print(f"{row:<11} {index.tokens:<12} {index.node_count():<10} {rss:<8.1f} ({rss - start:<8.1f})"
                  f"     {per_token:<17.0f} {took:.1f}")


def filled(tokens: int, rng: random.Random) -> SuffixIndex:
    """An index holding ~`tokens` tokens of ~60-token templated completions."""
    index = SuffixIndex(max_tokens=tokens)
    while index.tokens + 60 <= tokens:
        index.add(completion(rng, 60))
    return index


def speed(index_tokens: int, context: int, depth: int, gamma: int) -> None:
    """Print µs per lookup (index alone, index + own text) and per add at the cap."""
    rng = random.Random(1)
    index = SuffixIndex(max_tokens=index_tokens, max_depth=depth)
    began = time.process_time()
    while index.tokens + 60 <= index_tokens:
        index.add(completion(rng, 60))
    print(f"index: {index.tokens} tokens, {len(index)} completions, {index.node_count()} nodes, "
          f"filled in {time.process_time() - began:.1f} s")
    prompts = [[rng.randrange(10000, VOCAB) for _ in range(context - 30)] for _ in range(50)]
    new = [prompt + completion(rng, 60)[:t] for prompt in prompts for t in range(0, 60, 2)]  # ~270..330 tokens
    seen = [prompt + list(index.completions[k])[:t] for k, prompt in enumerate(prompts) for t in range(30, 60, 1)]
    for name, contexts in (("a new completion", new), ("a kept completion: matches to full depth", seen)):
        timed(f"lookup, index alone, context {name} (depth {depth}, gamma {gamma})",
              contexts, lambda c: index.lookup(c, gamma))
        own = [RowText(c) for c in contexts]
        timed("lookup, index + own text (suffix_index.propose)", own, lambda row: propose(index, row, gamma))
    timed("RowText.extend by 2 tokens (a step's accepted + correction)", own, lambda row: row.extend([7, 9]))
    additions = [completion(rng, 60) for _ in range(2000)]
    timed("add a 60-token completion at the cap (one eviction)", additions, index.add)


def timed(what: str, inputs: list, call) -> None:
    """Run call on every input once (after a warm-up pass over 100) and print the mean µs per call."""
    for item in inputs[:100]:
        call(item)
    began = time.process_time()
    for item in inputs:
        call(item)
    print(f"{what}: {(time.process_time() - began) / len(inputs) * 1e6:.1f} us per call over {len(inputs)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    mem = commands.add_parser("memory")
    mem.add_argument("--rows", type=int, default=1_000_000)
    mem.add_argument("--length", type=int, default=20)
    mem.add_argument("--every", type=int, default=50_000)
    mem.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    fast = commands.add_parser("speed")
    fast.add_argument("--index-tokens", type=int, default=200_000)
    fast.add_argument("--context", type=int, default=300)
    fast.add_argument("--depth", type=int, default=24)
    fast.add_argument("--gamma", type=int, default=8)
    args = parser.parse_args()
    if args.command == "memory":
        memory(args.rows, args.length, args.every, args.max_tokens)
    else:
        speed(args.index_tokens, args.context, args.depth, args.gamma)


if __name__ == "__main__":
    main()
