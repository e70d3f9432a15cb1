"""Make the embedded draft for SmolLM2-135M-Instruct: a slice of the target itself (its first
token embeddings and first decoder layer) trained on the target's own greedy answers.
Reproduces models/smollm2-135m-draft on a 2-core CPU in under an hour.

    .venv/bin/python jobs/make_draft.py --work build/draft --out models/smollm2-135m-draft

Steps: (1) write a broad set of prompts: questions the target writes itself, requests about
the Python standard library's prose and code, and template rows; (2) complete them with the
target through `batchspec run --mode ar` (bfloat16, resumable); (3) copy part of the target
(`draft_from_target`) and train it to predict the target's greedy token (greedy acceptance is
exactly "the draft's argmax is the target's"); (4) save it in bfloat16 with the target's
tokenizer, measure it and write its model card.
"""

import argparse
import ast
import copy
import json
import math
import random
import subprocess
import sys
import sysconfig
import textwrap
import time
from pathlib import Path

import torch

from batchspec.bench import load_prompts
from batchspec.decoding import DecodeConfig, decode_batch
from batchspec.defaults import default_target
from batchspec.models import load_pair

TOPICS = """photosynthesis; black holes; the French Revolution; the Roman Empire; volcanoes; earthquakes;
the immune system; vaccines; climate change; renewable energy; solar panels; wind turbines; electric cars;
the internet; blockchain; machine learning; neural networks; databases; operating systems; compilers;
the stock market; inflation; interest rates; budgeting; saving for retirement; credit scores; taxes;
healthy eating; vitamins; exercise; sleep; stress; meditation; coffee; tea; bread baking; fermentation;
gardening; composting; bees; ants; whales; dinosaurs; evolution; DNA; cells; the heart; the brain;
memory; language learning; grammar; poetry; Shakespeare; the printing press; the Renaissance;
World War I; the Cold War; the moon landing; Mars; the solar system; stars; gravity; magnetism;
electricity; batteries; light; sound; music theory; the piano; jazz; photography; painting; chess;
football; the Olympics; marathon training; mountains; rivers; deserts; rainforests; oceans; tides;
weather; clouds; rainbows; snow; glaciers; recycling; plastic pollution; cities; public transport;
bridges; airplanes; trains; ships; maps; GPS; time zones; calendars; clocks; money; banks; trade;
supply and demand; entrepreneurship; job interviews; writing a resume; public speaking; negotiation;
teamwork; leadership; project management; email etiquette; time management; procrastination;
friendship; parenting; pets; dogs; cats; birds; fish; insects; mushrooms; trees; flowers; soil;
the water cycle; the carbon cycle; nuclear power; chemistry; acids and bases; the periodic table;
atoms; molecules; fractions; percentages; probability; statistics; geometry; algebra; calculus;
prime numbers; encryption; passwords; viruses in computers; cloud computing; smartphones; robots""".replace("\n", " ")

QUESTION_TEMPLATES = [
    "What is {t}?", "Explain {t} to a ten-year-old.", "Why is {t} important?", "Give three facts about {t}.",
    "What are common misconceptions about {t}?", "Summarize the history of {t} in a few sentences.",
    "How does {t} work?", "Write a short paragraph about {t}.", "What are the pros and cons of {t}?",
    "List five questions a student might ask about {t}.", "Compare {t} and {u}.",
    "How are {t} and {u} related?", "Describe {t} in one sentence.", "What should a beginner know about {t}?",
    "Write a haiku about {t}.", "Write a short story that involves {t}.", "Give me a fun fact about {t}.",
    "What careers involve {t}?", "Create a quiz question about {t} with the answer.",
    "Explain {t} step by step.",
]
CODE_TASKS = """reverse a string; check if a number is prime; compute the factorial of n; find the largest element
in a list; count the vowels in a string; merge two sorted lists; remove duplicates from a list; compute
the Fibonacci sequence; check if a string is an anagram of another; flatten a nested list; convert
Celsius to Fahrenheit; find the most common word in a text; validate an email address; sort a list of
dictionaries by a key; read a file and count its lines; compute the average of a list; implement binary
search; implement a stack; parse a date string; compute the GCD of two numbers; capitalize each word of
a sentence; check for balanced parentheses; compute the sum of digits of a number; generate a random
password; transpose a matrix""".replace("\n", " ")
LANGUAGES = ["Python", "JavaScript", "Java", "C", "Go", "Rust", "TypeScript", "Bash", "SQL", "C++"]
CODE_TEMPLATES = [
    "Write a {lang} function to {task}.", "How do I {task} in {lang}?", "Show a short {lang} example that can {task}.",
    "Explain how to {task} in {lang}, with code.",
]
NAMES = ["Alice", "Bob", "Maria", "John", "Wei", "Fatima", "Carlos", "Yuki", "Olga", "Ahmed", "Priya", "Liam"]
CITIES = ["Paris", "Tokyo", "Lagos", "Lima", "Berlin", "Toronto", "Mumbai", "Sydney", "Cairo", "Oslo"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October"]
EXTRACT_TEMPLATES = [
    "Extract the names of people from this text: {s}", "List the cities mentioned in: {s}",
    "What dates appear in this sentence? {s}", "Turn this into JSON with keys name, city and date: {s}",
    "Summarize in five words: {s}", "Who is the main person in this text, and where are they? {s}",
]
PLAIN_STARTS = [
    "The most important thing to know about {t} is", "In this article, we explain {t}.",
    "Chapter 1: {t}\n\n", "Q: What is {t}?\nA:", "Here are some notes on {t}:\n-", "{t} is",
    "A brief introduction to {t}.", "def solve():\n    # {task}\n",
]


def sentence(rng: random.Random) -> str:
    a, b = rng.sample(NAMES, 2)
    return (f"{a} met {b} in {rng.choice(CITIES)} on {rng.choice(MONTHS)} {rng.randint(1, 28)}, "
            f"{rng.randint(1990, 2025)}, and they later traveled to {rng.choice(CITIES)}.")


def template_rows(count: int, rng: random.Random, exclude: set[str]) -> list[dict]:
    """`count` rows from the templates: about 80% chat messages, 20% plain text to continue."""
    topics = [t.strip() for t in TOPICS.split(";")]
    tasks = [t.strip() for t in CODE_TASKS.split(";")]
    rows = []
    while len(rows) < count:
        kind = rng.random()
        t, u = rng.sample(topics, 2)
        if kind < 0.45:
            text = rng.choice(QUESTION_TEMPLATES).format(t=t, u=u)
        elif kind < 0.65:
            text = rng.choice(CODE_TEMPLATES).format(lang=rng.choice(LANGUAGES), task=rng.choice(tasks))
        elif kind < 0.8:
            text = rng.choice(EXTRACT_TEMPLATES).format(s=sentence(rng))
        else:
            text = rng.choice(PLAIN_STARTS).format(t=t, task=rng.choice(tasks))
            rows.append({"prompt": text[0].upper() + text[1:]})
            continue
        if text not in exclude:
            rows.append(chat_row(text))
    return rows


def chat_row(text: str) -> dict:
    return {"messages": [{"role": "user", "content": text}]}


TEXT_TASKS = [
    "Summarize this text in two sentences:\n\n{x}", "Explain this to a beginner:\n\n{x}",
    "What are the key terms in this text?\n\n{x}", "Rewrite this in simpler words:\n\n{x}",
    "Write three questions about this text:\n\n{x}", "Give an example that illustrates this:\n\n{x}",
]
CODE_READING_TASKS = [
    "Explain what this code does:\n\n{x}", "Add comments to this code:\n\n{x}",
    "Is there a bug in this code?\n\n{x}", "Write a test for this function:\n\n{x}",
    "Explain what this does: {x}",
]
QUESTION_ASKS = [
    "Write one question a curious person might ask about {t}. Reply with the question only.",
    "Ask a practical question about {t}. Reply with the question only.",
    "Write a homework question about {t}. Reply with the question only.",
    "Write a request a user might send to an AI assistant about {t}. Reply with the request only.",
]


def stdlib_texts() -> tuple[list[str], list[str]]:
    """Docstring paragraphs and short functions from the Python standard library's own source
    files (parsed, never imported): real, varied prose and code to ask about."""
    paragraphs, functions = [], []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if {"test", "idlelib", "site-packages"} & set(path.parts):
            continue
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and (doc := ast.get_docstring(node)):
                paragraphs += [" ".join(p.split()) for p in doc.split("\n\n") if 150 <= len(p) <= 600]
            if isinstance(node, ast.FunctionDef) and 4 <= node.end_lineno - node.lineno <= 20:
                functions.append(textwrap.dedent(" " * node.col_offset + ast.get_source_segment(source, node)))
    return paragraphs, [f for f in functions if len(f) <= 900]


def text_rows(count: int, rng: random.Random) -> list[dict]:
    """`count` chat rows asking about standard-library prose (60%) and code (40%), and plain
    continuations of its prose."""
    paragraphs, functions = stdlib_texts()
    rows = []
    while len(rows) < count:
        kind = rng.random()
        if kind < 0.5:
            rows.append(chat_row(rng.choice(TEXT_TASKS).format(x=rng.choice(paragraphs))))
        elif kind < 0.9:
            rows.append(chat_row(rng.choice(CODE_READING_TASKS).format(x=rng.choice(functions))))
        else:
            words = rng.choice(paragraphs).split()
            rows.append({"prompt": " ".join(words[: rng.randint(8, 30)])})
    return rows


def question_asks(count: int, rng: random.Random) -> list[dict]:
    """Rows that ask the target to write a question itself (answered in a second pass)."""
    topics = [t.strip() for t in TOPICS.split(";")]
    return [chat_row(rng.choice(QUESTION_ASKS).format(t=rng.choice(topics))) for _ in range(count)]


def written_questions(records_path: Path, exclude: set[str]) -> list[dict]:
    """The target's own questions (first line of each sampled completion) as chat rows."""
    rows = []
    for line in records_path.read_text().splitlines():
        text = json.loads(line)["completion"].strip().split("\n")[0].strip().strip('"')
        if 15 <= len(text) <= 300 and text not in exclude:
            rows.append(chat_row(text))
    return rows


def with_ids(rows: list[dict]) -> str:
    return "".join(json.dumps({"id": f"r{i}", **row}) + "\n" for i, row in enumerate(rows))


def sample_prompts(path: Path) -> set[str]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {m["content"] for r in rows for m in r.get("messages", [])} | {r["prompt"] for r in rows if "prompt" in r}


def generate(rows_path: Path, out: Path, target: str, max_new_tokens: int, temperature: float = 0.0) -> None:
    """The target's completions, through batchspec itself (resumable if interrupted); skipped
    when a finished run is already there."""
    summary = out.with_suffix(".summary.json")
    if summary.exists() and json.loads(summary.read_text())["finished"]:
        return
    command = [sys.executable, "-m", "batchspec", "run", str(rows_path), "--out", str(out), "--target", target,
               "--mode", "ar", "--dtype", "bfloat16", "--batch-size", "32", "--max-new-tokens", str(max_new_tokens),
               "--temperature", str(temperature), "--seed", "0", "--token-ids"]
    code = subprocess.call(command)
    if code not in (0, 3):
        raise SystemExit(f"generation failed with exit code {code}")


def training_sequences(records_path: Path, tokenizer, max_prompt: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, completion ids) per record, prompts cut to their last max_prompt tokens."""
    sequences = []
    for line in records_path.read_text().splitlines():
        r = json.loads(line)
        if "messages" in r:
            prompt = list(tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True, return_dict=False))
        else:
            prompt = tokenizer(r["prompt"])["input_ids"]
        sequences.append((prompt[-max_prompt:], r["token_ids"]))
    return sequences


def draft_from_target(target, vocab: int, layers: list[int]):
    """A slice of a Llama-style target: its embeddings (and head) of the first `vocab` ids, its
    decoder layers numbered `layers` and its final norm. Byte-level BPE numbers tokens in
    merge order, so the first ids are the common ones; the engine clamps higher ids going into
    the draft and never proposes them. Starting from the target's own weights keeps its output
    space: a from-scratch draft of the same size generalized worse from the same data."""
    config = copy.deepcopy(target.config)
    config.vocab_size, config.num_hidden_layers = vocab, len(layers)
    if getattr(config, "layer_types", None):  # per-layer attention kinds (e.g. Qwen2's sliding window)
        config.layer_types = [config.layer_types[i] for i in layers]
    draft = type(target)(config).float()
    with torch.no_grad():
        draft.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight[:vocab])
        if not config.tie_word_embeddings:
            draft.lm_head.weight.copy_(target.lm_head.weight[:vocab])
        for layer, i in zip(draft.model.layers, layers):
            layer.load_state_dict(target.model.layers[i].state_dict())
        draft.model.norm.load_state_dict(target.model.norm.state_dict())
    return draft


def batches(sequences, tokens_per_batch: int, rng: random.Random):
    """Length-sorted batches of about tokens_per_batch tokens, in random order."""
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i][0]) + len(sequences[i][1]))
    groups, group, longest = [], [], 0
    for i in order:
        length = len(sequences[i][0]) + len(sequences[i][1])
        if group and max(longest, length) * (len(group) + 1) > tokens_per_batch:
            groups.append(group)
            group, longest = [], 0
        group.append(i)
        longest = max(longest, length)
    groups.append(group)
    rng.shuffle(groups)
    return groups


def collate(sequences, group, pad_id: int):
    """input_ids, attention_mask: [B, T], right-padded; where: (rows [N], positions [N]) of the
    N positions whose next token is a completion token."""
    width = max(len(sequences[i][0]) + len(sequences[i][1]) for i in group)
    ids = torch.full((len(group), width), pad_id)
    mask = torch.zeros(len(group), width, dtype=torch.long)
    rows, positions = [], []
    for b, i in enumerate(group):
        prompt, completion = sequences[i]
        n = len(prompt) + len(completion)
        ids[b, :n] = torch.tensor(prompt + completion)
        mask[b, :n] = 1
        rows += [b] * len(completion)
        positions += range(len(prompt) - 1, n - 1)
    return ids, mask, (torch.tensor(rows), torch.tensor(positions))


def greedy_token_loss(draft, ids, mask, where, greedy):
    """Cross-entropy to the target's greedy token (greedy acceptance is exactly "the draft's
    argmax is the target's"), computing the head only at completion positions; tokens beyond the
    draft's vocabulary are left out (it can never propose them)."""
    vocab = draft.config.vocab_size
    hidden = draft.model(input_ids=ids.clamp(max=vocab - 1), attention_mask=mask).last_hidden_state[where]  # [N, H]
    logits = draft.lm_head(hidden).float()  # [N, vocab]
    return torch.nn.functional.cross_entropy(logits, greedy.masked_fill(greedy >= vocab, -100))


def train(draft, sequences, *, minutes: float, lr: float, tokens_per_batch: int, seed: int, pad_id: int):
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(draft.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    start, step, deadline = time.monotonic(), 0, time.monotonic() + minutes * 60
    draft.train()
    while time.monotonic() < deadline:
        for group in batches(sequences, tokens_per_batch, rng):
            elapsed = (time.monotonic() - start) / (minutes * 60)
            if elapsed >= 1:
                break
            for g in optimizer.param_groups:  # linear warm-up, then cosine decay over the time budget
                g["lr"] = lr * min(1.0, (step + 1) / 100) * 0.5 * (1 + math.cos(math.pi * elapsed))
            ids, mask, where = collate(sequences, group, pad_id)
            greedy = torch.tensor([t for i in group for t in sequences[i][1]])  # [N]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = greedy_token_loss(draft, ids, mask, where, greedy)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % 100 == 0:
                print(f"step {step} loss {loss.item():.3f} ({elapsed:.0%} of the time budget)", flush=True)
    draft.eval()


def acceptance(pair, rows_path: Path, gamma: int = 5, max_new_tokens: int = 128) -> float:
    """Greedy acceptance rate of the pair on a JSONL file's rows (float32, one batch of 8 at a time)."""
    prompts = load_prompts(str(rows_path), pair.tokenizer, count=len(rows_path.read_text().splitlines()))
    config = DecodeConfig(max_new_tokens=max_new_tokens, eos_token_ids=pair.eos_token_ids, gamma=gamma)
    proposed = accepted = 0
    for start in range(0, len(prompts), 8):
        batch = prompts[start : start + 8]
        for row in decode_batch(pair.target, pair.draft, batch, list(range(len(batch))), config).rows:
            proposed += row.stats["draft_tokens"]
            accepted += row.stats["accepted_tokens"]
    return accepted / proposed


@torch.inference_mode()
def forward_ms(model, batch: int = 8, context: int = 128, repeats: int = 20) -> float:
    """Milliseconds of one decode forward (one new token per row after `context` cached ones)."""
    ids = torch.randint(100, 1000, (batch, context))
    out = model(ids, use_cache=True)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        model(ids[:, :1], past_key_values=out.past_key_values, use_cache=True)
        out.past_key_values.crop(-1)
        best = min(best, time.perf_counter() - start)
    return best * 1000


def write_card(out: Path, target_spec: str, args, facts: dict) -> None:
    size_mb = sum(f.stat().st_size for f in out.iterdir() if f.is_file()) / 1e6
    card = f"""# smollm2-135m-draft

A draft model for speculative decoding with **SmolLM2-135M-Instruct** (the target), made by
`jobs/make_draft.py` in this repository. It shares the target's tokenizer (49152 ids, copied
here) and is meant for `batchspec run` (the default pair), not for use on its own.

| | |
|---|---|
| architecture | {facts['architecture']}: the target's embeddings of the first {facts['vocab']} token ids (tied to the head), its decoder layer(s) {args.layers} and its final norm, then trained |
| parameters | {facts['parameters'] / 1e6:.1f}M, stored in bfloat16 |
| size on disk | {size_mb:.1f} MB (weights and tokenizer) |
| license | Apache-2.0, like the target it is distilled from |
| greedy acceptance with the target, sample_data/prompts.jsonl (chat), gamma 5 | {facts['acceptance_chat']:.3f} |
| greedy acceptance with the target, sample_data/plain_prompts.jsonl, gamma 5 | {facts['acceptance_plain']:.3f} |
| greedy acceptance with the target, sample_data/prompts.jsonl (chat), gamma 1 | {facts['acceptance_chat_gamma1']:.3f} |
| one decode forward, batch 8, 128 cached tokens, float32, 2 CPU cores | draft {facts['draft_ms']:.1f} ms, target {facts['target_ms']:.1f} ms ({facts['draft_ms'] / facts['target_ms']:.2f} of a target forward) |

## Training data

{facts['sequences']} prompts (seed {args.seed}) written by `write_prompts` in `jobs/make_draft.py`, a
third each: questions the target wrote itself when asked for one about ~180 everyday and
school topics (sampled at temperature 0.9); requests about prose and code from the Python
standard library's own source files (summarize, explain, simplify, comment, test, and
plain-text continuations); and template rows (questions, coding tasks in 10 languages,
extraction from synthetic sentences, plain-text openings). None is one of the sample_data
prompts. The target (`{Path(target_spec).name}`, bfloat16) completed them greedily with
`batchspec run --mode ar` (at most {args.max_new_tokens} new tokens): {facts['completion_tokens']} completion tokens.

## Training

The draft starts as a copy of part of the target (above) and is trained with cross-entropy to
the target's greedy token at every completion position (greedy acceptance is exactly "the
draft's argmax is the target's"; tokens beyond its {facts['vocab']} ids, {facts['uncovered']:.1%} of the
completion tokens, are left out). AdamW (lr {args.lr}, warm-up then cosine decay), batches of
about 2048 tokens, bfloat16 autocast, {args.minutes:g} minutes on 2 CPU cores.

## Reproduce

```bash
.venv/bin/python jobs/make_draft.py --work build/draft --out {out}
```

On the 2-core CPU here the whole script took 45 minutes: 3 for the target's own questions,
18 for its 471k-token answers (bfloat16, about 430 tokens/s), {args.minutes:g} of training and 3 of
measuring. The figures above are measured by the same script (`--evaluate-only` re-measures
them and rewrites this card).

## Limits

This draft is weak: on the held-out sample prompts it predicts the target's next token about
a third of the time (the gamma 1 acceptance), so long proposals are mostly rejected and
speculative decoding with the embedded pair rarely beats the target alone on a CPU (see the
README's performance tables). The limit is the data, not the model or the steps: it agrees
with the target far more often on its training answers than on new prompts, and a draft
trained from scratch, or with the target's top-32 distributions as soft labels, did no
better. Halving the answers costs about 0.02 of agreement on new prompts, and the target's
labels on text it did not write (standard-library prose and code) lowered it, so only far
more target-written text (millions of tokens, minutes on a GPU) can close the gap.
"""
    (out / "README.md").write_text(card)


def evaluate(out: Path, target_spec: str, args) -> None:
    pair = load_pair(target_spec, str(out), dtype="float32", device="cpu")
    completions = [json.loads(line)["token_ids"] for line in (Path(args.work) / "target.jsonl").open()]
    config, vocab = pair.draft.config, pair.draft.config.vocab_size
    facts = {
        "architecture": f"Llama, {config.num_hidden_layers} layer(s), hidden {config.hidden_size}, "
        f"{config.num_attention_heads} heads ({config.num_key_value_heads} KV heads), MLP {config.intermediate_size}",
        "parameters": sum(p.numel() for p in pair.draft.parameters()),
        "vocab": vocab,
        "uncovered": sum(t >= vocab for c in completions for t in c) / sum(map(len, completions)),
        "acceptance_chat": acceptance(pair, Path("sample_data/prompts.jsonl")),
        "acceptance_plain": acceptance(pair, Path("sample_data/plain_prompts.jsonl")),
        "acceptance_chat_gamma1": acceptance(pair, Path("sample_data/prompts.jsonl"), gamma=1),
        "draft_ms": forward_ms(pair.draft),
        "target_ms": forward_ms(pair.target),
        "sequences": len(completions),
        "completion_tokens": sum(map(len, completions)),
    }
    print(json.dumps(facts, indent=2))
    write_card(out, target_spec, args, facts)


def write_prompts(work: Path, target_spec: str, args) -> Path:
    """The prompt set, a third each: questions the target writes itself (sampled at
    temperature 0.9), requests about standard-library prose and code, and template rows.
    None is one of the sample_data prompts the draft is measured on."""
    rows_path = work / "prompts.jsonl"
    if rows_path.exists():
        return rows_path
    rng = random.Random(args.seed)
    exclude = sample_prompts(Path("sample_data/prompts.jsonl")) | sample_prompts(Path("sample_data/plain_prompts.jsonl"))
    asks = work / "asks.jsonl"
    asks.write_text(with_ids(question_asks(args.prompts // 3, rng)))
    generate(asks, work / "questions.jsonl", target_spec, max_new_tokens=48, temperature=0.9)
    rows = written_questions(work / "questions.jsonl", exclude) + text_rows(args.prompts // 3, rng)
    rows += template_rows(args.prompts - len(rows), rng, exclude)
    rng.shuffle(rows)
    rows_path.write_text(with_ids(rows))
    return rows_path


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default="build/draft", help="working folder (prompts, target completions)")
    parser.add_argument("--out", default="models/smollm2-135m-draft")
    parser.add_argument("--prompts", type=int, default=5000)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--minutes", type=float, default=22, help="training time budget")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--vocab", type=int, default=12288, help="the draft knows the first VOCAB token ids")
    parser.add_argument("--layers", type=int, nargs="+", default=[0], help="which target layers the draft copies")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--evaluate-only", action="store_true", help="re-measure the saved draft, rewrite its card")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    target_spec = default_target()
    if args.evaluate_only:
        return evaluate(out, target_spec, args)
    records = work / "target.jsonl"
    generate(write_prompts(work, target_spec, args), records, target_spec, args.max_new_tokens)
    pair = load_pair(target_spec, dtype="float32", device="cpu")
    sequences = training_sequences(records, pair.tokenizer, max_prompt=192)
    print(f"{len(sequences)} sequences, {sum(len(c) for _, c in sequences)} completion tokens", flush=True)
    draft = draft_from_target(pair.target, args.vocab, args.layers)
    train(draft, sequences, minutes=args.minutes, lr=args.lr, tokens_per_batch=2048, seed=args.seed,
          pad_id=pair.target.config.pad_token_id)
    draft.generation_config = pair.target.generation_config
    draft.to(torch.bfloat16).save_pretrained(out)
    pair.tokenizer.save_pretrained(out)
    evaluate(out, target_spec, args)


if __name__ == "__main__":
    main()
