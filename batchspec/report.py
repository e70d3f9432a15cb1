"""`batchspec report OUT.jsonl`: one self-contained HTML page about a run (no network: the plots
are PNGs inside the page). The output and its error file are read in one streaming pass in
bounded memory, whatever the run's size: counters, fixed-size histograms, a timeline whose bins
merge as it grows, and a uniform sample of rows for the per-token view."""

import base64
import io
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import jinja2

from batchspec.bench_files import pyplot
from batchspec.errors import UsageError
from batchspec.sink import OutputPaths, foreign, read_records, read_summary
from batchspec.stats import by_source
from batchspec.decoding.row_stats import RowStats

ACCEPTANCE_BINS = 20  # per-row acceptance histogram over [0, 1]
ERROR_EXAMPLES = 3  # error records shown per type
PREVIEW = 300  # characters of a prompt shown
TIME_BINS = 40  # points of the over-the-run plots


@dataclass
class Timeline:
    """Traced samples by the time they finished, in bins of `width` seconds from the first one
    seen; when they would span more than `size` bins, the width doubles and neighbours merge
    (bounded memory whatever the run's length). A bin: [completion tokens, drafted, accepted]."""

    size: int = 256
    width: float = 1.0
    origin: float | None = None
    bins: dict[int, list[int]] = field(default_factory=dict)
    low: int = 0  # the smallest and largest bin keys
    high: int = 0

    def add(self, finished_at: float, tokens: int, drafted: int, accepted: int) -> None:
        if self.origin is None:
            self.origin = finished_at
        key = int((finished_at - self.origin) // self.width)
        while max(key, self.high) - min(key, self.low) >= self.size:
            self.coarsen()
            key = int((finished_at - self.origin) // self.width)
        self.low, self.high = min(key, self.low), max(key, self.high)
        sums = self.bins.setdefault(key, [0, 0, 0])
        sums[0] += tokens
        sums[1] += drafted
        sums[2] += accepted

    def coarsen(self) -> None:
        """Double the width: bin k goes to k // 2."""
        merged: dict[int, list[int]] = {}
        for key, sums in self.bins.items():
            into = merged.setdefault(key // 2, [0, 0, 0])
            into[:] = [a + b for a, b in zip(into, sums)]
        self.bins, self.width, self.low, self.high = merged, self.width * 2, self.low // 2, self.high // 2

    def points(self, most: int) -> list[tuple[float, list[int]]]:
        """(minutes from the first bin's start, sums) of every bin from the first to the last,
        empty ones included (nothing finished then), in at most `most` bins."""
        while self.high - self.low >= most:
            self.coarsen()
        return [((key - self.low) * self.width / 60, self.bins.get(key, [0, 0, 0]))
                for key in range(self.low, self.high + 1)] if self.bins else []


@dataclass
class Digest:
    """What the report shows, added up record by record."""

    views: int  # rows kept for the per-token view
    rng: random.Random
    records: int = 0
    samples: int = 0
    traced: int = 0  # samples written with --trace
    totals: RowStats = field(default_factory=RowStats)  # the samples' statistics summed (the prompts' once a record)
    finish_reasons: Counter = field(default_factory=Counter)
    row_acceptance: list[int] = field(default_factory=lambda: [0] * ACCEPTANCE_BINS)
    timeline: Timeline = field(default_factory=Timeline)
    sampled: list[tuple[int, dict]] = field(default_factory=list)  # (place in the output, view)
    errors: Counter = field(default_factory=Counter)
    error_examples: dict[str, list[dict]] = field(default_factory=dict)

    def add(self, record: dict) -> None:
        samples = samples_of(record)
        self.records += 1
        self.totals.prompt_tokens += samples[0][2]["prompt_tokens"]
        for _, finish_reason, stats in samples:
            self.add_sample(finish_reason, stats)
        self.keep_view(record, samples)

    def add_sample(self, finish_reason: str, stats: dict) -> None:
        self.samples += 1
        self.finish_reasons[finish_reason] += 1
        self.totals.add({k: v for k, v in stats.items() if k != "prompt_tokens"})
        if stats["draft_tokens"]:
            rate = stats["accepted_tokens"] / stats["draft_tokens"]
            self.row_acceptance[min(int(rate * ACCEPTANCE_BINS), ACCEPTANCE_BINS - 1)] += 1
        if "trace" in stats:
            self.traced += 1
            self.timeline.add(stats["trace"]["finished_at"], stats["completion_tokens"], stats["draft_tokens"],
                              stats["accepted_tokens"])

    def keep_view(self, record: dict, samples: list) -> None:
        """Reservoir sampling: every record is kept with probability views / records."""
        place = self.records - 1
        if len(self.sampled) < self.views:
            self.sampled.append((place, view(record, samples)))
        elif (k := self.rng.randrange(self.records)) < self.views:
            self.sampled[k] = (place, view(record, samples))

    def add_error(self, record: dict) -> None:
        error = record.get("error") or {}
        kind = str(error.get("type", "unknown"))
        self.errors[kind] += 1
        examples = self.error_examples.setdefault(kind, [])
        if len(examples) < ERROR_EXAMPLES:
            examples.append({"id": record.get("id"), "line": record.get("line"), "message": error.get("message")})


def samples_of(record: dict) -> list[tuple[str, str, dict]]:
    """(text, finish_reason, stats) of each sample of a record, in either output format."""
    if "response" in record:
        body = record["response"]["body"]
        extras = body["batchspec"]
        stats = extras["samples"] if "samples" in extras else [extras]
        texts = [c["message"]["content"] if "message" in c else c["text"] for c in body["choices"]]
        return [(t, c["finish_reason"], s) for t, c, s in zip(texts, body["choices"], stats)]
    samples = record.get("samples") or [record]
    return [(s["completion"], s["finish_reason"], s["stats"]) for s in samples]


def prompt_of(record: dict) -> str:
    """The prompt, or a chat's last message, cut to PREVIEW characters ("" when the record has none)."""
    if isinstance(record.get("prompt"), str):
        return record["prompt"][-PREVIEW:]
    messages = record.get("messages")
    content = messages[-1].get("content") if isinstance(messages, list) and messages and \
        isinstance(messages[-1], dict) else None
    return content[-PREVIEW:] if isinstance(content, str) else ""


def view(record: dict, samples: list) -> dict:
    """A row of the per-token view: its id, prompt and each sample's tokens by kind."""
    shown = []
    for text, finish_reason, stats in samples:
        trace = stats.get("trace")
        drafted = stats["draft_tokens"]
        shown.append({
            "finish_reason": finish_reason,
            "tokens": stats["completion_tokens"],
            "acceptance": stats["accepted_tokens"] / drafted if drafted else None,
            "pieces": token_pieces(text, trace) if trace else [("plain", text)],
        })
    return {"id": record.get("id") if "response" not in record else record.get("custom_id"),
            "prompt": prompt_of(record), "samples": shown}


def token_pieces(text: str, trace: dict) -> list[tuple[str, str]]:
    """(kind, text) per token with text. A step of g proposals of which a were accepted gave a
    draft tokens ("accepted") then one of the target's: "corrected" (a < g: it replaced the
    first rejected proposal), "bonus" (a = g > 0) or "target" (a plain step, g = 0). The last
    step may have been cut short by a stop or the token limit."""
    kinds = []
    for proposed, accepted in zip(trace["proposed"], trace["accepted"]):
        kinds += ["accepted"] * accepted
        kinds.append("corrected" if accepted < proposed else "bonus" if proposed else "target")
    starts = trace["text_offset"]
    ends = [*starts[1:], len(text)]
    return [(kind, text[start:end]) for kind, start, end in zip(kinds, starts, ends) if text[start:end]]


def digest(out: Path, errors: Path, views: int, seed: int) -> Digest:
    found = Digest(views=views, rng=random.Random(seed))
    for add, path in ((found.add, out), (found.add_error, errors)):
        for where, record in read_records(path):
            with foreign(where):
                add(record)
    return found


def png(fig) -> str:
    """A figure as a data: URI (the page needs no other file)."""
    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png", dpi=100)
    fig.clf()
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def plots(found: Digest) -> list[dict]:
    """The page's figures: throughput and acceptance over the run (traced records), and the
    per-row acceptance and accepted-length histograms."""
    plt = pyplot()
    figures = []
    points = found.timeline.points(TIME_BINS)
    if len(points) > 1:
        minutes = [m for m, _ in points]
        fig, ax = plt.subplots(figsize=(6, 3.2))
        ax.step(minutes, [sums[0] / found.timeline.width for _, sums in points], where="post")
        ax.set(xlabel="minutes", ylabel="tokens/s", title="throughput over the run (rows as they finished)")
        ax.set_ylim(bottom=0)
        figures.append({"title": "Throughput over the run", "src": png(fig)})
        if found.totals.draft_tokens:
            fig, ax = plt.subplots(figsize=(6, 3.2))
            ax.plot(*zip(*[(m, sums[2] / sums[1]) for m, sums in points if sums[1]]), marker=".")
            ax.set(xlabel="minutes", ylabel="accepted / proposed", title="acceptance over the run", ylim=(0, 1.02))
            figures.append({"title": "Acceptance over the run", "src": png(fig)})
    if found.totals.draft_tokens:
        fig, ax = plt.subplots(figsize=(6, 3.2))
        ax.bar([(i + 0.5) / ACCEPTANCE_BINS for i in range(ACCEPTANCE_BINS)], found.row_acceptance,
               width=1 / ACCEPTANCE_BINS, edgecolor="white")
        ax.set(xlabel="acceptance rate of the row", ylabel="rows", title="per-row acceptance")
        figures.append({"title": "Per-row acceptance", "src": png(fig)})
        fig, ax = plt.subplots(figsize=(6, 3.2))
        lengths = found.totals.accepted_length_histogram
        ax.bar(range(len(lengths)), lengths, edgecolor="white")
        ax.set(xlabel="proposals accepted in a step", ylabel="steps", title="accepted lengths")
        figures.append({"title": "Accepted lengths", "src": png(fig)})
    return figures


def overview(found: Digest, summary: dict) -> list[tuple[str, str]]:
    """The summary table: from the records, and from OUT.summary.json where the run left one."""
    models = summary.get("models", {})
    totals = found.totals
    rate = totals.accepted_tokens / totals.draft_tokens if totals.draft_tokens else None
    rows = [
        ("rows", str(found.records) + (f" ({found.samples} samples)" if found.samples != found.records else "")),
        ("errors", str(sum(found.errors.values()))),
        ("finish reasons", ", ".join(f"{k} {v}" for k, v in found.finish_reasons.most_common())),
        ("prompt tokens", str(totals.prompt_tokens)),
        ("completion tokens", str(totals.completion_tokens)),
        ("acceptance", f"{rate:.3f} ({totals.accepted_tokens} of {totals.draft_tokens} proposals)" if rate is not None
         else "no proposals (autoregressive)"),
        ("acceptance by source", by_source(totals.totals()) or "-"),
        ("steps per gamma", " ".join(f"{g}:{n}" for g, n in enumerate(totals.gamma_histogram) if n) or "-"),
    ]
    if summary:
        rows += [("target", str(models.get("target"))), ("draft", str(models.get("draft") or models.get("ngram"))),
                 ("dtype, device", f"{models.get('dtype')}, {models.get('device')}"),
                 ("last run", f"{summary.get('seconds')} s, {summary.get('tokens_per_s')} tokens/s, "
                  f"{'finished' if summary.get('finished') else 'stopped'} (exit {summary.get('exit_code')})")]
    return rows


def render(found: Digest, summary: dict, out: Path) -> str:
    env = jinja2.Environment(loader=jinja2.PackageLoader("batchspec"), autoescape=True)
    return env.get_template("report.html").render(
        out=str(out), overview=overview(found, summary), figures=plots(found), found=found,
        rows=[v for _, v in sorted(found.sampled, key=lambda item: item[0])],
        errors=[(kind, n, found.error_examples[kind]) for kind, n in found.errors.most_common()])


def report(out: str, html: str | None, views: int, seed: int) -> tuple[Path, Digest]:
    """Write the page for OUT (default: OUT's stem + .report.html) and return its path."""
    paths = OutputPaths.of(out)
    if not paths.out.is_file():
        raise UsageError(f"{out} is a folder: give a run's OUT" if paths.out.is_dir() else f"output not found: {out}")
    found = digest(paths.out, paths.errors, views, seed)
    summary = read_summary(paths.summary)
    target = Path(html) if html else paths.summary.with_name(paths.summary.name.removesuffix(".summary.json")
                                                                 + ".report.html")
    target.write_text(render(found, summary, paths.out), encoding="utf-8")
    return target, found
