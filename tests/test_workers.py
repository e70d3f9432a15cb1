"""`batchspec run --devices`: one worker process per device, merged at the end; proven with two
CPU workers against the single-process run of the same input."""

import os
import re
import signal
import subprocess
from types import SimpleNamespace

import orjson
import pytest

from batchspec.workers import Worker, finish

from test_job import (ENV, assert_same_as_reference, cli, run_cli, run_here, setup,  # noqa: F401
                      sidecar, wait_for_records)


def devices_run(setup, out) -> list[str]:
    return cli(*devices_args(setup, out))


def devices_args(job: dict, out, devices: str = "cpu,cpu") -> list[str]:
    """`batchspec run`'s arguments for the job's input on CPU workers; the parent runs in this
    process (run_here) where only the workers' processes are what a test is about."""
    return [str(job["input"]), "--out", str(out), *job["models"], "--devices", devices]


def shard_summaries(out, shards=(0, 1)) -> list[dict]:
    folder = out.with_suffix(".shards")
    return [orjson.loads((folder / f"part-{i}.summary.json").read_bytes()) for i in shards]


def test_two_cpu_workers_make_one_run(setup, tmp_path):
    out = tmp_path / "out.jsonl"
    sidecar(out, ".run.json").write_text("{}")  # OUT begun by a run without --devices
    refused = run_here(*devices_args(setup, out))
    assert refused.exit_code == 2 and "without --devices" in refused.output
    result = subprocess.run([*devices_run(setup, out), "--overwrite"], env=ENV, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 3, result.stderr
    assert_same_as_reference(out, setup)
    summaries = shard_summaries(out)
    assert [(s["options"]["num_shards"], s["options"]["shard_index"]) for s in summaries] == [(2, 0), (2, 1)]
    assert all(s["finished"] and s["rows_ok"] > 0 and s["models"]["device"] == "cpu" for s in summaries)
    pids = set(re.findall(r"cpu pid (\d+)", result.stderr))
    assert len(pids) == 2  # two worker processes
    merged = orjson.loads(sidecar(out, ".summary.json").read_bytes())
    assert merged["finished"] and merged["rows_ok"] == sum(s["rows_ok"] for s in summaries)
    assert "merged from 2 workers" in result.stderr
    refused = run_here(*devices_args(setup, out, "cpu,cpu,cpu"))  # shards of another size: their rows differ
    assert refused.exit_code == 2 and "started on 2 devices" in refused.output


def test_a_dead_worker_is_reported_and_its_shard_resumes(setup, tmp_path):
    out = tmp_path / "out.jsonl"
    parent = subprocess.Popen(devices_run(setup, out), env=ENV, stderr=subprocess.PIPE, text=True)
    part = out.with_suffix(".shards") / "part-1.jsonl"
    wait_for_records(part, 2, parent)
    os.kill(int(sidecar(part, ".lock").read_text()), signal.SIGKILL)
    _, stderr = parent.communicate(timeout=300)
    assert parent.returncode == 1, stderr
    assert "worker 1 (cpu, shard 1 of 2) was killed by SIGKILL" in stderr
    assert "rerun the same command" in stderr and "Traceback" not in stderr
    assert not out.exists()  # nothing merged
    assert shard_summaries(out, [0])[0]["finished"]  # the other worker went on to the end
    result = run_here(*devices_args(setup, out))
    assert result.exit_code == 3, result.output
    assert_same_as_reference(out, setup)


def test_a_stop_signal_reaches_every_worker(setup, tmp_path):
    out = tmp_path / "out.jsonl"
    parent = subprocess.Popen(devices_run(setup, out), env=ENV, stderr=subprocess.PIPE, text=True)
    wait_for_records(out.with_suffix(".shards") / "part-0.jsonl", 2, parent)
    parent.send_signal(signal.SIGUSR1)
    _, stderr = parent.communicate(timeout=300)
    assert parent.returncode == 75, stderr
    summaries = shard_summaries(out)
    assert summaries[0]["exit_code"] == 75  # the signal came while worker 0 was decoding
    assert all(s["exit_code"] == 75 or s["finished"] for s in summaries)  # worker 1 may have finished first
    assert not out.exists()
    result = run_here(*devices_args(setup, out))
    assert result.exit_code == 3, result.output
    assert_same_as_reference(out, setup)


def test_a_worker_the_stop_signal_kills_on_its_way_out_counts_as_interrupted(tmp_path):
    """The forwarded signal can land after a worker dropped its handlers: it dies of it, and the
    run is still resumable (75), not failed (1)."""
    workers = []
    for index, code in enumerate((-signal.SIGUSR1, 75)):
        worker = Worker.__new__(Worker)  # a finished process, without starting one
        worker.index, worker.device, worker.log = index, "cpu", tmp_path / f"part-{index}.log"
        worker.process = SimpleNamespace(returncode=code)
        worker.log.write_text("stopping\n")
        workers.append(worker)
    killed, stopped = workers
    assert finish([killed, stopped], str(tmp_path / "part-{shard}.jsonl"), str(tmp_path / "out.jsonl")) == 75
    assert killed.exit_code() == 75 and not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize(("args", "message"), [
    (["--num-shards", "2", "--shard-index", "0"], "cannot be combined"),
    (["--out", "part-{shard}.jsonl"], "drop its {shard} placeholder"),
    (["--devices", "cpu,,cpu"], "comma-separated list"),
])
def test_devices_usage_errors(setup, tmp_path, args, message):
    """In process: caught before any worker starts."""
    result = run_here(str(setup["input"]), "--out", str(tmp_path / "out.jsonl"), "--devices", "cpu,cpu", *args)
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output


def test_workers_usage_errors_stop_the_run(setup, tmp_path):
    """Every worker exits 2, so does the run, and nothing is merged."""
    result = run_cli(str(setup["input"]), "--out", str(tmp_path / "out.jsonl"), "--devices", "cpu,cpu", "--target",
                     "no/such-model")
    assert result.returncode == 2 and "not merged" in result.stderr and "Traceback" not in result.stderr
