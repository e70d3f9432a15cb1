"""`batchspec run` as users run it: a subprocess over JSONL, killed, signalled, resumed, locked."""

import os
import random
import shutil
import signal
import subprocess
import sys
import time

import orjson
import pytest
import torch
from click.testing import CliRunner

from batchspec.cli import main
from batchspec.job import with_warnings
from batchspec.models import load_pair
from batchspec.sink import OutputPaths, Sink
from batchspec.sources import Row, RowError

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
WORDS = "the cat sat on a mat and then it went home to read a small book about water in the old house".split()
ROWS = 200
BAD = [
    b'{"id": "bad-json", "prompt": "oops',
    b'{"id": "trailing", "prompt": "x"} junk',
    b"[1, 2, 3]",
    b'{"id": "no-prompt"}',
    b'{"id": "null-prompt", "prompt": null}',
    b'{"id": "number-prompt", "prompt": 42}',
    b'{"id": "latin1", "prompt": "caf\xe9"}',
    b'{"id": "row-7", "prompt": "a duplicate id"}',
]


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "batchspec", "run", *args]


def run_cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(cli(*args), env=ENV, capture_output=True, text=True, timeout=timeout)


def run_here(*args: str):
    """`batchspec run ARGS` in this process (no interpreter start-up of seconds), for runs whose
    process is not what a test is about: the exit code and stdout + stderr of a click Result."""
    return CliRunner().invoke(main, ["run", *args])


def write_input(path, rows: int = ROWS, seed: int = 0):
    rng = random.Random(seed)
    lines = [orjson.dumps({"id": f"row-{i}", "prompt": " ".join(rng.choices(WORDS, k=rng.randint(1, 30)))})
             for i in range(rows)]
    for k, bad in enumerate(BAD):  # bad lines spread through the file, and a blank line
        lines.insert(17 * (k + 1), bad)
    lines.insert(5, b"")
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def tiny_run_options(tiny_pair) -> list[str]:
    """`batchspec run` options for the tiny Llama pair, gamma 3 (--gamma auto chooses by timing,
    so its per-row statistics differ run to run), 24 new tokens, batches of 8, token ids."""
    target, draft = tiny_pair("llama")
    return ["--target", str(target), "--draft", str(draft), "--gamma", "3", "--max-new-tokens", "24",
            "--batch-size", "8", "--no-progress", "--token-ids"]


@pytest.fixture(scope="module")
def setup(tiny_pair, tmp_path_factory):
    root = tmp_path_factory.mktemp("job")
    target, _ = tiny_pair("llama")
    models = tiny_run_options(tiny_pair)
    source = write_input(root / "in.jsonl")
    reference = root / "reference.jsonl"
    result = run_cli(str(source), "--out", str(reference), *models)
    assert result.returncode == 3, result.stderr  # done, with rows in the error file
    return {"root": root, "models": models, "input": source, "reference": reference, "target": target}


def lines(path) -> list[bytes]:
    return sorted(path.read_bytes().splitlines()) if path.exists() else []


def sidecar(out, suffix):
    return out.with_name(out.name.removesuffix(".jsonl") + suffix)


def assert_same_as_reference(out, setup):
    assert lines(out) == lines(setup["reference"])
    assert lines(sidecar(out, ".errors.jsonl")) == lines(sidecar(setup["reference"], ".errors.jsonl"))
    ids = [orjson.loads(line)["id"] for line in lines(out)]
    assert len(ids) == len(set(ids)) == ROWS  # the second "row-7" is a duplicate_id error


def test_every_line_lands_in_exactly_one_file(setup):
    reference = setup["reference"]
    records = [orjson.loads(line) for line in lines(reference)]
    errors = [orjson.loads(line) for line in lines(sidecar(reference, ".errors.jsonl"))]
    assert {e["error"]["type"] for e in errors} == {
        "invalid_json", "trailing_data", "not_an_object", "missing_prompt", "invalid_prompt", "invalid_utf8",
        "duplicate_id",
    }
    non_blank = [n for n, line in enumerate(setup["input"].read_bytes().splitlines(), 1) if line.strip()]
    ok_ids = {r["id"] for r in records}
    error_lines = sorted(e["line"] for e in errors)
    assert len(records) + len(errors) == len(non_blank) and len(error_lines) == len(set(error_lines))
    assert len(ok_ids) == len(records)
    for r in records:
        assert set(r) == {"id", "prompt", "completion", "finish_reason", "stats", "token_ids"}
        assert r["finish_reason"] in ("stop", "length") and r["stats"]["completion_tokens"] == len(r["token_ids"])
    summary = orjson.loads(sidecar(reference, ".summary.json").read_bytes())
    assert summary["finished"] and summary["rows_ok"] == len(records) and summary["rows_error"] == len(errors)
    assert 0 < summary["acceptance_rate"] < 1 and summary["completion_tokens"] > 0
    assert {"models", "options", "versions", "padding_fraction", "wasted_cache_fraction"} <= set(summary)


def test_completions_equal_target_generate(setup):
    """End to end, through tokenization and bucketing: token ids equal the target alone."""
    pair = load_pair(str(setup["target"]), dtype="float32", device="cpu")
    records = [orjson.loads(line) for line in lines(setup["reference"])]
    for r in records[:: max(1, len(records) // 40)]:
        ids = pair.tokenizer(r["prompt"], return_tensors="pt")["input_ids"]
        with torch.inference_mode():
            out = pair.target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24,
                                       pad_token_id=0)
        assert out[0, ids.shape[1] :].tolist() == r["token_ids"]
        assert r["completion"] == pair.tokenizer.decode(r["token_ids"], skip_special_tokens=True)


def wait_for_records(out, count: int, process, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        if out.exists() and out.read_bytes().count(b"\n") >= count:
            return
        time.sleep(0.002)


@pytest.mark.parametrize("moment", [0, 1, ROWS // 2])
def test_kill_9_then_resume_gives_the_uninterrupted_result(setup, tmp_path, moment):
    out = tmp_path / "out.jsonl"
    process = subprocess.Popen(cli(str(setup["input"]), "--out", str(out), *setup["models"]), env=ENV,
                               stderr=subprocess.DEVNULL)
    wait_for_records(out, moment, process)
    process.kill()
    assert process.wait() == -signal.SIGKILL  # it really died mid-run
    written = out.read_bytes().count(b"\n") if out.exists() else 0
    assert written < ROWS
    result = run_here(str(setup["input"]), "--out", str(out), *setup["models"])  # the resume: in process
    assert result.exit_code == 3, result.output
    assert_same_as_reference(out, setup)


def test_n_samples_survive_kill_9_and_resume(setup, tmp_path):
    """--n 3, sampled: one record per row holding its 3 samples, each seeded on its own; a run
    killed mid-way and resumed writes what the uninterrupted run wrote."""
    small = write_input(tmp_path / "small.jsonl", rows=12)
    args = [*setup["models"], "--n", "3", "--temperature", "1.0", "--batch-size", "9", "--max-new-tokens", "12"]
    reference, out = tmp_path / "reference.jsonl", tmp_path / "out.jsonl"
    assert run_here(str(small), "--out", str(reference), *args).exit_code == 3
    records = [orjson.loads(line) for line in lines(reference)]
    assert all(len(r["samples"]) == 3 and "completion" not in r for r in records)
    assert all(r["stats"]["completion_tokens"] == sum(len(s["token_ids"]) for s in r["samples"]) for r in records)
    assert sum(len({tuple(s["token_ids"]) for s in r["samples"]}) == 3 for r in records) > len(records) // 2
    from datasets import load_dataset  # the samples load as a dataset's list column

    loaded = load_dataset("json", data_files=str(reference), split="train")
    assert [len(samples) for samples in loaded["samples"]] == [3] * len(records)
    single = tmp_path / "single.jsonl"  # the first of n samples is what n = 1 gives
    assert run_here(str(small), "--out", str(single), *setup["models"], *args[-6:]).exit_code == 3
    firsts = {r["id"]: r["samples"][0]["token_ids"] for r in records}
    assert {r["id"]: r["token_ids"] for r in map(orjson.loads, lines(single))} == firsts
    process = subprocess.Popen(cli(str(small), "--out", str(out), *args), env=ENV, stderr=subprocess.DEVNULL)
    wait_for_records(out, 3, process)
    process.kill()
    assert process.wait() == -signal.SIGKILL
    assert out.read_bytes().count(b"\n") < len(records)
    assert run_here(str(small), "--out", str(out), *args).exit_code == 3
    assert lines(out) == lines(reference)


def test_torn_last_line_is_dropped_and_redone(setup, tmp_path):
    out = tmp_path / "out.jsonl"
    reference_lines = setup["reference"].read_bytes().splitlines(keepends=True)
    out.write_bytes(b"".join(reference_lines[:10]) + reference_lines[10][:25])  # killed mid-write
    shutil.copy(sidecar(setup["reference"], ".run.json"), sidecar(out, ".run.json"))
    result = run_here(str(setup["input"]), "--out", str(out), *setup["models"])
    assert result.exit_code == 3, result.output
    assert "resuming" in result.output
    assert_same_as_reference(out, setup)
    assert sidecar(out, ".lock").read_text() == ""  # no pid of a run that ended, though this process lives on


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGUSR1])
def test_stop_signal_exits_75_then_rerun_completes(setup, tmp_path, signum):
    out = tmp_path / "out.jsonl"
    process = subprocess.Popen(cli(str(setup["input"]), "--out", str(out), *setup["models"]), env=ENV,
                               stderr=subprocess.PIPE, text=True)
    wait_for_records(out, 3, process)
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 75, stderr
    assert "Traceback" not in stderr and "resume" in stderr
    summary = orjson.loads(sidecar(out, ".summary.json").read_bytes())
    assert summary["finished"] is False and summary["exit_code"] == 75
    assert all(orjson.loads(line) for line in out.read_bytes().splitlines())  # nothing torn
    assert out.read_bytes().count(b"\n") < ROWS
    assert run_here(str(setup["input"]), "--out", str(out), *setup["models"]).exit_code == 3
    assert_same_as_reference(out, setup)
    assert orjson.loads(sidecar(out, ".summary.json").read_bytes())["finished"] is True


@pytest.mark.parametrize("dry", [False, True])
def test_a_stop_while_torch_loads_ends_the_run_before_its_first_batch(setup, tmp_path, monkeypatch, dry):
    """A stop signal can come while the job's modules load (seconds of torch and transformers: a
    worker of --devices that its parent passes a stop to at once). The command records it from
    before that import, and the run ends before its first batch: exit 75, with its summary (a
    dry run, which writes none, before its first row)."""
    import importlib.abc

    import batchspec

    class Loading(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "batchspec.job":  # the signal comes as the job's module loads
                os.kill(os.getpid(), signal.SIGUSR1)
            return None  # then the usual finders load it

    met = []  # what a signal that no run's handler caught met
    previous = signal.signal(signal.SIGUSR1, lambda *_: met.append(True))
    monkeypatch.delitem(sys.modules, "batchspec.job", raising=False)
    monkeypatch.delattr(batchspec, "job", raising=False)
    monkeypatch.setattr(sys, "meta_path", [Loading(), *sys.meta_path])
    try:
        result = run_here(str(setup["input"]), "--out", str(tmp_path / "out.jsonl"), *setup["models"],
                          *["--dry-run"] * dry)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert result.exit_code == 75 and not met, result.output
    if dry:
        assert "dry run of" not in result.output
        return
    summary = orjson.loads((tmp_path / "out.summary.json").read_bytes())
    assert summary["exit_code"] == 75 and summary["rows_in_output"] == 0


def test_second_writer_is_refused_at_once(setup, tmp_path):
    out = tmp_path / "out.jsonl"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from batchspec.sink import OutputPaths, locked\n"
         "with locked(OutputPaths.of(sys.argv[1])):\n    print('locked', flush=True); time.sleep(120)", str(out)],
        env=ENV, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        result = run_cli(str(setup["input"]), "--out", str(out), *setup["models"])
    finally:
        holder.kill()
        holder.wait()
    assert result.returncode == 1
    assert f"(pid {holder.pid}) is writing" in result.stderr and "Traceback" not in result.stderr
    assert not out.exists()


def test_changed_options_refuse_to_resume_unless_overwrite(setup, tmp_path):
    out = tmp_path / "out.jsonl"
    small = write_input(tmp_path / "small.jsonl", rows=6)
    assert run_here(str(small), "--out", str(out), *setup["models"]).exit_code == 3
    changed = [*setup["models"], "--max-new-tokens", "5"]
    result = run_cli(str(small), "--out", str(out), *changed)  # the installed command's refusal
    assert result.returncode == 2 and "max_new_tokens" in result.stderr and "--overwrite" in result.stderr
    for other in (["--output-format", "openai"], ["--logprobs", "2"]):  # records of another shape
        result = run_here(str(small), "--out", str(out), *setup["models"], *other)
        assert result.exit_code == 2 and "--overwrite" in result.output
    assert run_here(str(small), "--out", str(out), *changed, "--overwrite").exit_code == 3
    assert all(len(orjson.loads(line)["token_ids"]) <= 5 for line in out.read_bytes().splitlines())


def test_options_from_environment_and_clean_stdout(setup, tmp_path):
    out = tmp_path / "out.jsonl"
    small = write_input(tmp_path / "small.jsonl", rows=6)
    env = {**ENV, "BATCHSPEC_MAX_NEW_TOKENS": "3", "BATCHSPEC_MODE": "ar"}
    models = [a for a in setup["models"] if a not in ("--max-new-tokens", "24")]
    result = subprocess.run(cli(str(small), "--out", str(out), *models), env=env, capture_output=True, text=True)
    assert result.returncode == 3 and result.stdout == ""
    records = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert records and all(len(r["token_ids"]) <= 3 and r["stats"]["draft_tokens"] == 0 for r in records)
    assert "rows" in result.stderr and "tok/s" in result.stderr


def test_a_usage_error_exits_2_without_traceback(setup, tmp_path):
    """The installed command's path; the cases below run in process."""
    result = run_cli(str(setup["input"]), "--out", str(tmp_path / "o.jsonl"), "--target", str(setup["target"]),
                     "--no-progress", "--draft", "/nonexistent/model")
    assert result.returncode == 2 and "cannot load" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("args, message", [
    (["--mode", "spec"], "needs a --draft"),
    (["--gamma", "0"], "--gamma"),
    (["--gamma", "fast"], "--gamma"),
    (["--mode", "ar", "--ngram"], "--ngram"),
    (["--draft", "ngram", "--ngram-min", "5", "--ngram-max", "2"], "--ngram-min"),
    (["--mode", "ar", "--stop", ""], "--stop strings must not be empty"),
    (["--mode", "ar", "--logit-bias", "7"], "expected ID=BIAS"),
    (["--mode", "ar", "--logit-bias", "123456789=1"], "--logit-bias names token ids the tokenizer does not have"),
    (["--mode", "ar", "--chat-template-kwargs", '{"tools": []}'], "cannot set 'tools'"),
])
def test_usage_errors_exit_2_without_traceback(setup, tmp_path, args, message):
    result = run_here(str(setup["input"]), "--out", str(tmp_path / "o.jsonl"), "--target", str(setup["target"]),
                      "--no-progress", *args)
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output


def test_a_missing_input_is_one_line_and_exit_2(tmp_path):
    missing = tmp_path / "nope.jsonl"
    result = run_here(str(missing), "--out", str(tmp_path / "o.jsonl"), "--mode", "ar")
    assert result.exit_code == 2 and result.output == f"batchspec: error: input not found: {missing}\n"


def test_ngram_and_hybrid_drafts_write_the_target_alones_records(setup, tmp_path):
    """--draft ngram (no draft model loaded) and --ngram beside the draft model (hybrid): the same
    token ids as --mode ar, each row saying which source proposed how often."""
    source = tmp_path / "copy.jsonl"
    rows = [{"id": f"r{i}", "prompt": " ".join(WORDS[i : i + 8] * 3)} for i in range(12)]  # each repeats itself
    source.write_bytes(b"\n".join(orjson.dumps(r) for r in rows) + b"\n")
    common = ["--target", str(setup["target"]), "--max-new-tokens", "16", "--batch-size", "4", "--gamma", "3",
              "--no-progress", "--token-ids", "--ngram-min", "1", "--ngram-max", "3"]
    draft = setup["models"][setup["models"].index("--draft") + 1]
    runs = {"ar": ["--mode", "ar"], "ngram": ["--draft", "ngram"], "hybrid": ["--draft", draft, "--ngram"]}
    records, summaries = {}, {}
    for name, args in runs.items():
        out = tmp_path / f"{name}.jsonl"
        result = run_here(str(source), "--out", str(out), *common, *args)
        assert result.exit_code == 0, result.output
        records[name] = {r["id"]: r for r in map(orjson.loads, out.read_bytes().splitlines())}
        summaries[name] = orjson.loads(sidecar(out, ".summary.json").read_bytes())
    token_ids = {name: {k: r["token_ids"] for k, r in rows.items()} for name, rows in records.items()}
    for name in ("ngram", "hybrid"):
        assert token_ids[name] == token_ids["ar"]
        assert summaries[name]["ngram_steps"] == sum(r["stats"]["ngram_steps"] for r in records[name].values()) > 0
        assert summaries[name]["models"]["ngram"] == [1, 3]
        proposed = {source: [sum(r["stats"]["source_tokens"].get(source, [0, 0])[i] for r in records[name].values())
                             for i in (0, 1)] for source in summaries[name]["acceptance_by_source"]}
        assert summaries[name]["acceptance_by_source"] == {s: kept / made for s, (made, kept) in proposed.items()}
        assert sum(made for made, _ in proposed.values()) == summaries[name]["draft_tokens"]
    assert summaries["ngram"]["models"]["draft"] is None and summaries["ngram"]["model_steps"] == 0
    assert summaries["hybrid"]["models"]["draft"] == draft
    assert set(summaries["hybrid"]["acceptance_by_source"]) == {  # each source that proposed, its own acceptance
        source for source in ("model", "ngram") if summaries["hybrid"][f"{source}_steps"]}
    assert summaries["ar"]["ngram_steps"] == summaries["ar"]["model_steps"] == 0
    assert summaries["ar"]["acceptance_by_source"] == {}


def test_compile_writes_the_same_records_and_says_what_it_compiled(setup, tmp_path):
    """--compile (compiling every step shape at once): ar's records as without it; the summary
    counts the shapes compiled and the seconds spent."""
    source = tmp_path / "in.jsonl"
    source.write_bytes(b"".join(orjson.dumps({"id": i, "prompt": " ".join(WORDS[i : i + 3 + i])}) + b"\n"
                                for i in range(6)))
    common = ["--target", str(setup["target"]), "--mode", "ar", "--max-new-tokens", "12", "--batch-size", "4",
              "--no-progress", "--token-ids"]
    records = {}
    for name, args in {"eager": [], "compiled": ["--compile", "--compile-after", "0"]}.items():
        out = tmp_path / f"{name}.jsonl"
        result = run_cli(str(source), "--out", str(out), *common, *args)
        assert result.returncode == 0, result.stderr
        records[name] = lines(out)
    assert records["compiled"] == records["eager"]
    summary = orjson.loads(sidecar(out, ".summary.json").read_bytes())["compile"]
    assert summary["compiled_shapes"] > 0 and summary["compile_seconds"] > 0 and summary["dynamic_cache"] == []
    assert "step shapes compiled" in result.stdout + result.stderr


def test_generation_options_for_every_row(setup, tmp_path):
    """--stop, --logprobs and the processing options reach every row (that they belong to the
    run's fingerprint: test_changed_options_refuse_to_resume_unless_overwrite)."""
    small, out = write_input(tmp_path / "small.jsonl", rows=12), tmp_path / "out.jsonl"
    reference = {r["id"]: r for r in map(orjson.loads, lines(setup["reference"]))}
    options = ["--stop", " the", "--stop", "zzz", "--logprobs", "2", "--repetition-penalty", "1.5",
               "--frequency-penalty", "0.5", "--presence-penalty", "0.2", "--min-new-tokens", "2",
               "--logit-bias", "5=-100"]
    assert run_here(str(small), "--out", str(out), *setup["models"], *options).exit_code == 3
    records = [orjson.loads(line) for line in lines(out)]
    assert sum(r["token_ids"] != reference[r["id"]]["token_ids"] for r in records) >= len(records) // 2
    for r in records:
        assert " the" not in r["completion"] and 5 not in r["token_ids"] and len(r["token_ids"]) >= 2
        assert [e["token_id"] for e in r["logprobs"]] == r["token_ids"]
        assert all(len(e["top_logprobs"]) == 2 and e["logprob"] <= 0 for e in r["logprobs"])
    assert any(r["finish_reason"] == "stop" and " the" in reference[r["id"]]["completion"] for r in records)


def test_context_overflow_is_an_error_record_unless_truncated(setup, tmp_path):
    long_prompt = " ".join(["water"] * 40)
    source = tmp_path / "long.jsonl"
    source.write_bytes(orjson.dumps({"id": "long", "prompt": long_prompt}) + b"\n"
                       + orjson.dumps({"id": "short", "prompt": "the cat"}) + b"\n")
    models = ["--target", str(setup["target"]), "--mode", "ar", "--no-progress", "--max-new-tokens", "1000"]
    out = tmp_path / "out.jsonl"
    assert run_here(str(source), "--out", str(out), *models).exit_code == 3  # in process: a whole run, no start-up
    error = orjson.loads(sidecar(out, ".errors.jsonl").read_bytes())
    assert error["id"] == "long" and error["error"]["type"] == "too_long" and "1024" in error["error"]["message"]
    for side in ("left", "right"):
        out = tmp_path / f"out-{side}.jsonl"
        assert run_here(str(source), "--out", str(out), *models, "--truncate", side).exit_code == 0
        assert {orjson.loads(line)["id"] for line in out.read_bytes().splitlines()} == {"long", "short"}


def test_dry_run_needs_no_weights(setup, tmp_path):
    no_weights = tmp_path / "target-no-weights"
    shutil.copytree(setup["target"], no_weights, ignore=shutil.ignore_patterns("*.safetensors"))
    out = tmp_path / "out.jsonl"
    result = run_here(str(setup["input"]), "--out", str(out), "--target", str(no_weights), "--dry-run")
    assert result.exit_code == 3, result.output
    assert f"{ROWS} rows ok, {len(BAD)} errors" in result.output
    assert "duplicate_id: 1" in result.output and "batches: " in result.output
    assert not out.exists() and not list(tmp_path.glob("out*"))


def test_option_fields_on_plain_rows_are_warned_once(setup, tmp_path):
    """A plain row's fields named like request options (max_tokens, stop, tools, ...) are data,
    not applied: the run says so once, at the first such row, and names its keys; the configured
    prompt/id fields and rows without such keys raise nothing."""
    source = tmp_path / "plain.jsonl"
    rows = [{"id": "a", "prompt": "x", "topic": "maths"},
            {"id": "b", "prompt": "y", "max_tokens": 3, "stop": ".", "source": "web"},
            {"id": "c", "messages": [{"role": "user", "content": "z"}], "temperature": 0.2, "tools": []}]
    source.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    dry = ("--out", str(tmp_path / "o.jsonl"), "--target", str(setup["target"]), "--dry-run", "--no-progress")
    result = run_here(str(source), *dry)
    assert result.exit_code == 0
    assert result.output.count("warning: ") == 1
    assert "input row 2 has 'max_tokens', 'stop' beside its prompt" in result.output
    source.write_bytes(orjson.dumps({"stop": "x", "n": 2, "prompt": "y"}) + b"\n")  # stop holds the prompt
    result = run_here(str(source), *dry, "--prompt-field", "stop", "--id-field", "n")
    assert result.exit_code == 0 and "warning: " not in result.output


def max_rss_kib(args) -> int:
    process = subprocess.Popen(cli(*args), env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(process.pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    return usage.ru_maxrss


def test_memory_stays_flat_on_100k_lines(setup, tmp_path):
    """A dry run streams the input in windows: 10x the lines must not need 10x the memory."""
    sizes = {}
    for rows in (10_000, 100_000):
        path = tmp_path / f"in-{rows}.jsonl"
        with open(path, "wb") as f:
            for i in range(rows):
                f.write(orjson.dumps({"id": i, "prompt": f"the cat sat on mat number {i}"}) + b"\n")
        sizes[rows] = max_rss_kib([str(path), "--out", str(tmp_path / "o.jsonl"), "--target", str(setup["target"]),
                                   "--dry-run", "--window", "512"])
    assert sizes[100_000] < sizes[10_000] + 24 * 1024, sizes  # under 24 MiB more (8 bytes an id are kept)


def test_rows_without_the_id_field_named_are_warned_of_once(capsys):
    """--id-field qid and rows without it: their ids are line numbers, said once (the default
    "id" absent is the documented line number, said nothing)."""
    rows = [Row("1", 1, "a", {"prompt": "a"}), Row("x", 2, "b", {"qid": "x", "prompt": "b"}), Row("3", 3, "c", {})]
    assert list(with_warnings(iter(rows), "qid")) == rows
    assert capsys.readouterr().err.count("input row 1 has no field 'qid' (--id-field)") == 1
    list(with_warnings(iter(rows)))
    assert "--id-field" not in capsys.readouterr().err


def test_a_stream_sent_again_with_a_good_row_where_a_bad_line_was_decodes_it(tmp_path):
    """Stdin has no identity to resume by but its rows' ids: a line that was bad is skipped when
    it is bad again, and a row there now (another stream) is decoded, not silently skipped; a
    row whose own error is on file (it failed decoding) is not decoded twice."""
    paths = OutputPaths.of(str(tmp_path / "out.jsonl"))
    paths.errors.write_bytes(b'{"id": null, "line": 1, "error": {"type": "invalid_json", "message": "x"}}\n'
                             b'{"id": "z", "line": 2, "error": {"type": "too_long", "message": "x"}}\n')
    sink = Sink(paths)
    try:
        assert sink.is_done(RowError(1, None, "invalid_json", "x")) and sink.is_done(Row("z", 2, "p", {}))
        assert not sink.is_done(Row("y", 1, "p", {})) and not sink.is_done(Row("w", 2, "p", {}))
    finally:
        sink.close()
