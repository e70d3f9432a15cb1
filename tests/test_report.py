"""`batchspec run --trace` and `batchspec report`: the trace agrees with the row's statistics and
text, the page opens in a real headless browser (Debian's chromium, installed when missing), and
a 200k-row output is read in bounded memory."""

import subprocess
import sys
from collections import Counter
from html.parser import HTMLParser
from types import SimpleNamespace

import orjson
import pytest
from click.testing import CliRunner
from PIL import Image

from batchspec.cli import main
from batchspec.report import Timeline, digest, overview, token_pieces
from batchspec.sink import OutputPaths
from debian import install
from test_job import lines, run_here, tiny_run_options, write_input


@pytest.fixture(scope="module")
def traced(tiny_pair, tmp_path_factory):
    """A spec run (gamma 3) of 12 rows, one of them with n = 2, and the bad lines, with --trace."""
    root = tmp_path_factory.mktemp("report")
    models = tiny_run_options(tiny_pair)
    source = write_input(root / "in.jsonl", rows=12)
    with open(source, "ab") as f:
        request = {"custom_id": "two", "method": "POST", "url": "/v1/completions",
                   "body": {"prompt": "the cat sat on the mat and then", "n": 2, "max_tokens": 20}}
        f.write(orjson.dumps(request) + b"\n")
    out = root / "out.jsonl"
    result = run_here(str(source), "--out", str(out), *models, "--trace")
    assert result.exit_code == 3, result.output  # done, with error records
    return SimpleNamespace(out=out, models=models)


def test_the_trace_tells_each_tokens_origin(traced):
    """Per step: the proposals and the accepted count add up to the row's statistics, the steps
    give exactly its tokens, and the text offsets cut its completion into its tokens' texts."""
    records = [orjson.loads(line) for line in lines(traced.out)]
    samples = [s for r in records for s in r.get("samples", [r])]
    assert len(records) == 13 and len(samples) == 14
    for sample in samples:
        stats, trace = sample["stats"], sample["stats"]["trace"]
        steps = stats["target_forwards"]  # the first step's forward is the prefill
        assert len(trace["proposed"]) == len(trace["accepted"]) == steps
        assert trace["proposed"][0] == 0 and all(trace["proposed"][1:])  # gamma 3 after the prefill's plain step
        assert sum(trace["accepted"]) == stats["accepted_tokens"] and sum(trace["proposed"]) == stats["draft_tokens"]
        spec = [(g, a) for g, a in zip(trace["proposed"], trace["accepted"]) if g]
        assert Counter(a for _, a in spec) == Counter(dict(enumerate(stats["accepted_length_histogram"]))) - Counter()
        steps_tokens = sum(a + 1 for a in trace["accepted"])  # the last step may be cut short
        assert steps_tokens - trace["accepted"][-1] - 1 < stats["completion_tokens"] <= steps_tokens
        assert len(trace["text_offset"]) == len(sample["token_ids"]) == stats["completion_tokens"]
        assert "".join(text for _, text in token_pieces(sample["completion"], trace)) == sample["completion"]
        assert trace["finished_at"] > 1.7e9
    kinds = Counter(kind for s in samples for kind, _ in token_pieces(s["completion"], s["stats"]["trace"]))
    assert kinds["accepted"] and kinds["corrected"] and kinds["bonus"] and kinds["target"] <= len(samples)


def test_token_pieces_by_kind():
    """Steps (proposed, accepted): (2, 1) accepted + corrected, (0, 0) a plain step, (2, 2)
    accepted x2 + bonus, (3, 1) cut after its accepted token; a token that completes no
    character (the first half of "é") shows nothing and the next one shows it."""
    trace = {"proposed": [2, 0, 2, 3], "accepted": [1, 0, 2, 1], "text_offset": [0, 1, 2, 3, 4, 4, 6]}
    assert token_pieces("abcdéfg", trace) == [("accepted", "a"), ("corrected", "b"), ("target", "c"),
                                                ("accepted", "d"), ("bonus", "éf"), ("accepted", "g")]
    assert token_pieces("abc", trace)[-1] == ("target", "c")  # a stop string cut the text


class Page(HTMLParser):
    """Counts of the rows of the token view and of each token kind in them."""

    def __init__(self):
        super().__init__()
        self.rows, self.kinds, self.in_sample, self.images = 0, Counter(), 0, 0

    def handle_starttag(self, tag, attrs):
        classes = (dict(attrs).get("class") or "").split()
        self.rows += tag == "section" and "row" in classes
        self.images += tag == "img" and dict(attrs).get("src", "").startswith("data:image/png;base64,")
        if tag == "div" and "sample" in classes:
            self.in_sample = True
        if tag == "span" and "tok" in classes and self.in_sample:
            self.kinds.update(c for c in classes if c != "tok")

    def handle_endtag(self, tag):
        if tag == "div":
            self.in_sample = False


def test_report_in_a_headless_browser(traced, tmp_path):
    reason = install(["chromium"], ["chromium"], "the report's browser test")
    if reason:
        pytest.skip(reason)
    page = tmp_path / "report.html"
    result = CliRunner().invoke(main, ["report", str(traced.out), "--html", str(page), "--rows", "8"])
    assert result.exit_code == 0, result.output
    assert f"wrote {page}: 13 rows (8 shown), 8 errors" in result.output
    html = page.read_text()
    assert "http://" not in html and "https://" not in html  # opens from disk, no network
    browser = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
               "--window-size=1200,1600"]
    shot = tmp_path / "shot.png"
    run = subprocess.run([*browser, f"--screenshot={shot}", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert shot.exists(), run.stderr[-2000:]
    with Image.open(shot) as image:
        assert image.size == (1200, 1600)
        assert len(image.convert("RGB").getcolors(maxcolors=1 << 20)) > 200  # text, plots, coloured tokens
    dom = subprocess.run([*browser, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120).stdout
    parsed = Page()
    parsed.feed(dom)
    assert parsed.rows == 8 and parsed.images == 4
    assert parsed.kinds["accepted"] and parsed.kinds["corrected"] and parsed.kinds["bonus"], parsed.kinds
    for kind in ("invalid_json", "missing_prompt"):
        assert f"<td>{kind}</td>" in dom


def test_a_200k_row_report_in_bounded_memory(traced, tmp_path):
    """The records of a 200k-row output (the real ones, repeated under new ids) are read in one
    pass holding a bounded sample, bins and counters: the process grows by far less than the file."""
    real = [orjson.loads(line) for line in lines(traced.out) if b'"samples"' not in line]
    out, count = tmp_path / "big.jsonl", 200_000
    with open(out, "wb") as f:
        for start in range(0, count, 10_000):
            f.write(b"".join(orjson.dumps(real[i % len(real)] | {"id": f"r{i}"}) + b"\n"
                             for i in range(start, start + 10_000)))
    measure = f"""
import orjson
from pathlib import Path
from batchspec.report import digest
def memory_kib(field):
    return next(int(l.split()[1]) for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(field))
before = memory_kib("VmRSS:")
found = digest(Path({str(out)!r}), Path("none.errors.jsonl"), views=200, seed=0)
print(orjson.dumps({{"grew_kib": memory_kib("VmHWM:") - before, "records": found.records,
                    "sampled": len(found.sampled), "tokens": found.totals.completion_tokens,
                    "binned": sum(sums[0] for sums in found.timeline.bins.values())}}).decode())
"""
    result = subprocess.run([sys.executable, "-c", measure], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    found = orjson.loads(result.stdout)
    assert found["records"] == count and found["sampled"] == 200
    assert found["tokens"] == found["binned"] == sum(r["stats"]["completion_tokens"] for r in real) * count // len(real)
    assert found["grew_kib"] * 1024 < min(out.stat().st_size // 10, 32 << 20), found


def test_a_report_of_openai_batch_output(traced, tmp_path):
    """--output-format openai: the same rows and statistics, the trace in body["batchspec"]."""
    out = tmp_path / "openai.jsonl"
    source = write_input(tmp_path / "in.jsonl", rows=4)
    assert run_here(str(source), "--out", str(out), *traced.models, "--trace", "--output-format",
                    "openai").exit_code == 3
    found = digest(out, OutputPaths.of(str(out)).errors, views=10, seed=0)
    bodies = [orjson.loads(line)["response"]["body"] for line in lines(out)]
    assert found.records == found.samples == 5 and sum(found.errors.values()) == 7  # "row-7" is no duplicate here
    assert found.totals.completion_tokens == sum(b["usage"]["completion_tokens"] for b in bodies)
    shown = {row["id"]: "".join(text for _, text in row["samples"][0]["pieces"]) for _, row in found.sampled}
    assert shown == {orjson.loads(line)["custom_id"]: b["choices"][0]["text"] for line, b in zip(lines(out), bodies)}


def test_timeline_bins_stay_bounded():
    """A week of rows, one a second, in at most 256 bins, every token kept."""
    timeline = Timeline()
    for second in range(0, 7 * 86400, 7):
        timeline.add(1.7e9 + second, 3, 2, 1)
    assert len(timeline.bins) <= 256 and timeline.width >= 7 * 86400 / 256
    assert sum(sums[0] for sums in timeline.bins.values()) == 3 * len(range(0, 7 * 86400, 7))
    points = timeline.points(40)
    assert len(points) <= 40 and points[0][0] == 0


def test_the_overview_shows_acceptance_by_source(traced):
    """The report's summary table: each source's acceptance, from the records' source_tokens."""
    paths = OutputPaths.of(str(traced.out))
    shown = dict(overview(digest(paths.out, paths.errors, views=0, seed=0), {}))
    records = [orjson.loads(line) for line in lines(traced.out)]
    made, kept = (sum(s["stats"]["source_tokens"]["model"][i] for r in records for s in r.get("samples", [r]))
                  for i in (0, 1))
    assert made and shown["acceptance by source"].startswith(f"model {kept / made:.3f} in ")
