"""Careless and hostile input through the CLI: every line becomes one record or one error record,
the job goes on with bounded time and memory, no traceback; OUT is batchspec's own or refused;
no code a model folder ships is run; a stop ends the run with 75 while it waits on its input."""

import gzip
import os
import shutil
import signal
import subprocess
import sys
import time

import orjson
import pytest

from hostile_lines import LINES
from test_job import ENV, cli, run_here, sidecar

# `batchspec run` in a child that reports its own peak RSS (KiB) on its last stderr line
MEASURED = ("import resource, sys\nfrom batchspec.cli import main\ntry:\n    main(sys.argv[1:])\nfinally:\n"
            "    print(f'maxrss={resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}', file=sys.stderr)")


def measured_run(*args: str, timeout: int = 300) -> tuple[subprocess.CompletedProcess, int, float]:
    """(the finished process, its peak RSS in MiB, its wall seconds)."""
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", MEASURED, "run", *args], env=ENV, capture_output=True, text=True,
                            timeout=timeout)
    peak = int(result.stderr.rsplit("maxrss=", 1)[1]) >> 10
    return result, peak, time.monotonic() - started


@pytest.fixture(scope="module")
def models(tiny_pair) -> list[str]:
    target, draft = tiny_pair("llama")
    return ["--target", str(target), "--draft", str(draft), "--gamma", "2", "--max-new-tokens", "4", "--no-progress"]


def test_every_hostile_line_gets_one_record_or_error_and_the_job_goes_on(models, tmp_path):
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(b"\n".join(text for text, _ in LINES.values()) + b"\n")
    result, peak, seconds = measured_run(str(source), "--out", str(out), "--keep-all-fields", *models)
    assert result.returncode == 3, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    records = {r["id"]: r for r in map(orjson.loads, out.read_bytes().splitlines())}
    errors = {e["line"]: e for e in map(orjson.loads, sidecar(out, ".errors.jsonl").read_bytes().splitlines())}
    for number, (name, (_, kind)) in enumerate(LINES.items(), start=1):
        if kind is None:
            assert number not in errors, (name, errors.get(number))
        else:
            assert errors[number]["error"]["type"] == kind, (name, errors[number])
    assert len(records) + len(errors) == len(LINES)  # each line once, in one file
    huge = errors[list(LINES).index("huge integer id") + 1]["error"]["message"]
    assert "give the id as a string" in huge, huge
    small = tmp_path / "small.jsonl"
    small.write_bytes(LINES["plain"][0] + b"\n" + LINES["chat"][0] + b"\n")
    baseline, baseline_peak, _ = measured_run(str(small), "--out", str(tmp_path / "small-out.jsonl"), *models)
    assert baseline.returncode == 0, baseline.stderr[-2000:]
    assert peak - baseline_peak < 300, (peak, baseline_peak)  # MiB: the 50 MB line is skipped, never held whole
    assert seconds < 120


def test_a_trusted_request_template_runs_bounded(models, tmp_path):
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(b"\n".join([
        LINES["request template (untrusted)"][0],  # 'x' * 10**9
        orjson.dumps({"custom_id": "loops", "body": {"messages": [{"role": "user", "content": "x"}], "chat_template":
                      "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"}}),
        orjson.dumps({"custom_id": "fine", "body": {"messages": [{"role": "user", "content": "the cat"}],
                                                    "chat_template": "{{ messages[0].content }}"}}),
    ]) + b"\n")
    result, peak, seconds = measured_run(str(source), "--out", str(out), "--trust-request-chat-template", *models)
    assert result.returncode == 3 and "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [orjson.loads(line) for line in sidecar(out, ".errors.jsonl").read_bytes().splitlines()]
    assert [(e["line"], e["error"]["type"]) for e in errors] == [(1, "invalid_request"), (2, "invalid_request")]
    assert "bounds" in errors[1]["error"]["message"]
    assert [orjson.loads(line)["id"] for line in out.read_bytes().splitlines()] == ["fine"]
    assert peak < 2048 and seconds < 120  # MiB: the 1 GB string was the child's to fail on


# --- OUT is ours or refused ------------------------------------------------------------------


@pytest.fixture
def plain_input(tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_bytes(LINES["plain"][0] + b"\n")
    return source


def refused(result, *words: str) -> None:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and all(w in result.output for w in words), result.output


@pytest.mark.parametrize("through_link", [False, True])
def test_a_foreign_out_is_refused_and_left_as_it_was(models, plain_input, tmp_path, through_link):
    foreign = tmp_path / "notes.txt"
    foreign.write_bytes(b"my notes, no newline at the end")
    out = tmp_path / "out.jsonl"
    if through_link:
        out.symlink_to(foreign)
    refused(run_here(str(plain_input), "--out", str(out if through_link else foreign), *models), "--overwrite")
    assert foreign.read_bytes() == b"my notes, no newline at the end"
    assert not sidecar(foreign, ".run.json").exists() and not (tmp_path / "notes.txt.run.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "notes.txt"] + ["out.jsonl"] * through_link


def test_an_out_whose_fingerprint_is_gone_is_not_adopted(models, plain_input, tmp_path):
    out = tmp_path / "out.jsonl"
    assert run_here(str(plain_input), "--out", str(out), *models).exit_code == 0
    before = out.read_bytes()
    sidecar(out, ".run.json").unlink()
    refused(run_here(str(plain_input), "--out", str(out), "--max-new-tokens", "8", *models), "not started by batchspec")
    assert out.read_bytes() == before
    assert run_here(str(plain_input), "--out", str(out), *models, "--overwrite").exit_code == 0


def test_a_symlinked_out_of_ours_resumes_through_the_link(models, plain_input, tmp_path):
    real = tmp_path / "real" / "out.jsonl"
    real.parent.mkdir()
    assert run_here(str(plain_input), "--out", str(real), *models).exit_code == 0
    link = tmp_path / "out.jsonl"
    link.symlink_to(real)
    result = run_here(str(plain_input), "--out", str(link), *models)
    assert result.exit_code == 0 and "resuming" in result.output, result.output
    assert len(real.read_bytes().splitlines()) == 1 and link.is_symlink()


@pytest.mark.parametrize("how", ["same path", "symlink", "hard link", "openai input"])
def test_out_equal_to_the_input_is_refused(models, tmp_path, how):
    source = tmp_path / "in.jsonl"
    first = LINES["request template (untrusted)"][0] if how == "openai input" else LINES["plain"][0]
    source.write_bytes(first + b"\n")
    out = {"same path": source, "openai input": source, "symlink": tmp_path / "link.jsonl",
           "hard link": tmp_path / "hard.jsonl"}[how]
    if how == "symlink":
        out.symlink_to(source)
    elif how == "hard link":
        os.link(source, out)
    refused(run_here(str(source), "--out", str(out), *models), "an input of this run")
    assert source.read_bytes() == first + b"\n"


def test_merge_will_not_replace_a_file_it_did_not_write(tmp_path):
    foreign = tmp_path / "all.jsonl"
    foreign.write_text("precious\n")
    result = run_here_command("merge", str(tmp_path / "part-{shard}.jsonl"), "--out", str(foreign))
    refused(result, "--overwrite")
    assert foreign.read_text() == "precious\n"


def run_here_command(*args: str):
    from click.testing import CliRunner

    from batchspec.cli import main

    return CliRunner().invoke(main, list(args))


@pytest.mark.parametrize("command", ["status", "merge", "report"])
@pytest.mark.parametrize("garbage", ["line", "summary"])
def test_status_merge_and_report_name_a_file_they_cannot_read(tmp_path, command, garbage):
    out = tmp_path / "part-0.jsonl"
    out.write_bytes(b"[1, 2]\n" if garbage == "line" else b"")
    sidecar(out, ".summary.json").write_bytes(b"not json" if garbage == "summary" else
                                              b'{"finished": true, "options": {"num_shards": 1, "shard_index": 0, '
                                              b'"output_format": "batchspec"}}')
    args = {"status": [str(out)], "report": [str(out)],
            "merge": [str(tmp_path / "part-{shard}.jsonl"), "--out", str(tmp_path / "all.jsonl")]}[command]
    result = run_here_command(command, *args)
    assert result.exit_code == 2, result.output
    assert "is not what batchspec writes" in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1


# --- no code from a model folder ---------------------------------------------------------------


def test_a_model_that_needs_its_own_code_is_refused_whatever_stdin_says(tiny_pair, plain_input, tmp_path):
    target, _ = tiny_pair("llama")
    folder = tmp_path / "evil"
    shutil.copytree(target, folder)
    marker = tmp_path / "ran"
    config = orjson.loads((folder / "config.json").read_bytes())
    config.update(model_type="evil", architectures=["EvilForCausalLM"],
                  auto_map={"AutoConfig": "configuration_evil.EvilConfig",
                            "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"})
    (folder / "config.json").write_bytes(orjson.dumps(config))
    code = f"open({str(marker)!r}, 'w').write('ran')\nfrom transformers import LlamaConfig as EvilConfig\n"
    (folder / "configuration_evil.py").write_text(code)
    (folder / "modeling_evil.py").write_text(code + "from transformers import LlamaForCausalLM as EvilForCausalLM\n")
    process = subprocess.run(cli(str(plain_input), "--out", str(tmp_path / "out.jsonl"), "--target", str(folder),
                                 "--mode", "ar", "--no-progress"), env=ENV, input="y\ny\ny\n", capture_output=True,
                             text=True, timeout=300)
    assert process.returncode == 2, process.stderr
    assert "never runs a model's own code" in process.stderr and "Traceback" not in process.stderr
    assert not marker.exists()


# --- streams, signals, loose ends ---------------------------------------------------------------


def test_a_fifo_is_read_as_a_stream(models, tmp_path):
    fifo, out = tmp_path / "in.fifo", tmp_path / "out.jsonl"
    os.mkfifo(fifo)
    process = subprocess.Popen(cli(str(fifo), "--out", str(out), *models), env=ENV, stderr=subprocess.PIPE, text=True)
    with open(fifo, "wb") as writer:
        writer.write(LINES["plain"][0] + b"\n" + LINES["chat"][0] + b"\n")
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr
    assert sorted(orjson.loads(line)["id"] for line in out.read_bytes().splitlines()) == ["chat", "plain"]


@pytest.mark.parametrize("dry_run", [False, True])
def test_a_stop_while_waiting_on_input_ends_the_run_with_75(models, tmp_path, dry_run):
    fifo, out = tmp_path / "in.fifo", tmp_path / "out.jsonl"
    os.mkfifo(fifo)
    process = subprocess.Popen(cli(str(fifo), "--out", str(out), *models, *(["--dry-run"] if dry_run else [])),
                               env=ENV, stderr=subprocess.PIPE, text=True)
    writer = open_writer(fifo, process)  # a writer that never writes: the run waits on its input
    try:
        time.sleep(0.5)  # into the read
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
    finally:
        os.close(writer)
    assert process.returncode == 75, stderr
    assert "Traceback" not in stderr


def open_writer(fifo, process, timeout: float = 120) -> int:
    """A write end of the FIFO, opened once the run has opened its read end (it reads its input)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        try:
            return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # ENXIO: no reader yet
            time.sleep(0.05)
    raise AssertionError(f"the run never opened its input (exit {process.poll()})")


def test_stdin_is_an_input(models, tmp_path):
    out = tmp_path / "out.jsonl"
    process = subprocess.run(cli("-", "--out", str(out), *models), env=ENV, input=LINES["plain"][0] + b"\n",
                             capture_output=True, timeout=300)
    assert process.returncode == 0, process.stderr
    assert orjson.loads(out.read_bytes())["id"] == "plain"


def test_a_corrupt_gz_is_one_line_of_error(models, tmp_path):
    source = tmp_path / "in.jsonl.gz"
    source.write_bytes(gzip.compress(b"\n".join(LINES["plain"][0] for _ in range(2000)))[:300])  # cut short
    result = run_here(str(source), "--out", str(tmp_path / "out.jsonl"), *models)
    assert result.exit_code == 2 and "cannot read" in result.output and "Traceback" not in result.output, result.output
    summary = orjson.loads((tmp_path / "out.summary.json").read_bytes())  # written at the end of every run
    assert summary["finished"] is False and summary["exit_code"] == 2


@pytest.mark.parametrize("args, words", [
    (["--temperature", "nan"], "not a finite number"),
    (["--top-p", "nan"], "not a finite number"),
    (["--repetition-penalty", "inf"], "not a finite number"),
    (["--min-new-tokens", "9", "--max-new-tokens", "3"], "--min-new-tokens 9 is over --max-new-tokens 3"),
    (["--compile-after", "5"], "--compile-after says when --compile compiles: give --compile too"),
    (["--seed", str(10**23)], "is not in the range"),  # the summary's JSON holds 64 bits
    (["--device", "tpu"], "unknown device 'tpu'; choose auto, cpu, cuda or cuda:N"),
])
def test_loose_options_are_usage_errors_before_any_load(plain_input, tmp_path, args, words):
    refused(run_here(str(plain_input), "--out", str(tmp_path / "out.jsonl"), *args), words)


def test_too_long_does_not_suggest_truncate_when_it_is_given(models, tmp_path):
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(orjson.dumps({"id": "long", "prompt": "the cat " * 3000}) + b"\n")
    for given in ([], ["--truncate", "left", "--max-new-tokens", "5000"]):
        result = run_here(str(source), "--out", str(out), *models, *given, "--overwrite")
        message = orjson.loads(sidecar(out, ".errors.jsonl").read_bytes())["error"]["message"]
        assert ("--truncate" in message) is not bool(given), message
        assert ("--max-new-tokens 5000 leaves no room for a prompt" in result.output) is bool(given), result.output


def test_an_out_that_is_not_a_regular_file_is_refused(models, plain_input, tmp_path):
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    refused(run_here(str(plain_input), "--out", str(fifo), *models), "not a regular file")
    assert not (tmp_path / "out.fifo.run.json").exists()
    inside = str(plain_input / "out.jsonl")
    refused(run_here(str(plain_input), "--out", inside, *models), "which is a file, not a folder")


@pytest.mark.parametrize("option", ["--chat-template", "--json-schema", "--grammar", "--config"])
def test_a_settings_file_that_is_a_fifo_is_refused_at_once(plain_input, tmp_path, option):
    fifo = tmp_path / "settings.fifo"
    os.mkfifo(fifo)
    refused(run_here(str(plain_input), "--out", str(tmp_path / "out.jsonl"), option, str(fifo)), "not a regular file")
