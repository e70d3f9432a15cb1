"""Ray Data as the engine: `--engine ray --workers 2` writes exactly a plain run's records, a
killed actor's batch is retried and every row lands once, a stopped run resumes skipping the done
ids, and the stage plugs into a user's own Ray Data pipeline. One local Ray for the session."""

import re
import signal
import subprocess
import sys

import orjson
import pytest

from batchspec.api import Generator
from test_job import ENV, cli, lines, run_here, sidecar, wait_for_records, write_input

ray = pytest.importorskip("ray", reason="the ray extra: pip install 'batchspec[ray]'")
ROWS = 48


@pytest.fixture(scope="session")
def ray_address(tmp_path_factory):
    """A local Ray head for the session (2 CPUs), which the CLI runs join with --ray-address."""
    temp = tmp_path_factory.mktemp("ray")
    # no token authentication, whatever ~/.ray/auth_token an earlier local cluster left (clients that join by
    # address do not read it)
    env = {**ENV, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    ray_cli = [sys.executable, "-m", "ray.scripts.scripts"]
    started = subprocess.run([*ray_cli, "start", "--head", "--num-cpus=2", "--include-dashboard=false",
                              f"--temp-dir={temp}", "--port=0"], env=env, capture_output=True, text=True, timeout=180)
    assert started.returncode == 0, started.stderr
    address = re.search(r"--address='([^']+)'", started.stdout + started.stderr).group(1)
    yield address
    subprocess.run([*ray_cli, "stop", "--force"], env=env, capture_output=True, timeout=120)


@pytest.fixture(scope="module")
def setup(tiny_pair, tmp_path_factory):
    root = tmp_path_factory.mktemp("ray-job")
    target, draft = tiny_pair("llama")
    models = ["--target", str(target), "--draft", str(draft), "--gamma", "3", "--max-new-tokens", "16",
              "--batch-size", "4", "--window", "8", "--no-progress", "--token-ids"]
    source = write_input(root / "in.jsonl", rows=ROWS)
    reference = root / "reference.jsonl"
    assert run_here(str(source), "--out", str(reference), *models).exit_code == 3
    return {"input": source, "models": models, "reference": reference, "target": target, "draft": draft}


def ray_run(setup, out, address, *more: str) -> list[str]:
    return cli(str(setup["input"]), "--out", str(out), *setup["models"], "--engine", "ray", "--workers", "2",
               "--ray-address", address, *more)


def assert_same_as_plain(out, setup) -> None:
    assert lines(out) == lines(setup["reference"])  # the same records, each row once
    assert lines(sidecar(out, ".errors.jsonl")) == lines(sidecar(setup["reference"], ".errors.jsonl"))


def test_two_ray_workers_write_a_plain_runs_records(setup, ray_address, tmp_path):
    out = tmp_path / "out.jsonl"
    result = subprocess.run(ray_run(setup, out, ray_address), env=ENV, capture_output=True, text=True, timeout=600)
    assert result.returncode == 3, result.stderr[-3000:]
    assert_same_as_plain(out, setup)
    summary = orjson.loads(sidecar(out, ".summary.json").read_bytes())
    assert summary["finished"] and summary["rows_ok"] == ROWS and summary["engine"]["workers"] == 2


def test_a_killed_actor_is_retried_and_every_row_lands_once(setup, ray_address, tmp_path):
    out = tmp_path / "out.jsonl"
    process = subprocess.Popen(ray_run(setup, out, ray_address), env=ENV, stderr=subprocess.PIPE, text=True)
    wait_for_records(out, 4, process, timeout=300)
    killed = subprocess.run(["pkill", "-9", "-f", "MapWorker"], capture_output=True)  # Ray Data's actors
    assert killed.returncode == 0, "no actor to kill"
    _, stderr = process.communicate(timeout=600)
    assert process.returncode == 3, stderr[-3000:]
    assert_same_as_plain(out, setup)


def test_a_stopped_ray_run_resumes_skipping_the_done_ids(setup, ray_address, tmp_path):
    out = tmp_path / "out.jsonl"
    process = subprocess.Popen(ray_run(setup, out, ray_address), env=ENV, stderr=subprocess.PIPE, text=True)
    wait_for_records(out, 4, process, timeout=300)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 75 and "Traceback" not in stderr, stderr[-3000:]
    done = len(lines(out))
    result = subprocess.run(ray_run(setup, out, ray_address), env=ENV, capture_output=True, text=True, timeout=600)
    assert result.returncode == 3 and f"{done} rows" in result.stderr, result.stderr[-3000:]
    assert_same_as_plain(out, setup)


def test_the_stage_in_a_users_own_pipeline(setup, ray_address):
    from batchspec.ray import GenerateStage

    rows = [{"id": f"r{k}", "prompt": prompt} for k, prompt in enumerate(["the cat sat", "a small book", "water"])]
    options = {"target": str(setup["target"]), "draft": str(setup["draft"]), "gamma": 3, "max_new_tokens": 8}
    ray.init(address=ray_address, log_to_driver=False)
    try:
        out = ray.data.from_items(rows).map_batches(GenerateStage, fn_constructor_kwargs=options, batch_size=2,
                                                    concurrency=1).take_all()
    finally:
        ray.shutdown()
    expected = {r["id"]: r for r in Generator(**options).generate(rows)}
    assert sorted(row["id"] for row in out) == ["r0", "r1", "r2"]
    for row in out:
        record = orjson.loads(row["record"])
        assert row["completion"] == expected[row["id"]]["completion"] == record["completion"]
        assert row["prompt"] == record["prompt"] and row["error"] == ""


def test_without_ray_the_extra_is_named(setup, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray fails
    result = run_here(str(setup["input"]), "--out", str(tmp_path / "out.jsonl"), *setup["models"], "--engine", "ray")
    assert result.exit_code == 2 and "pip install 'batchspec[ray]'" in result.output, result.output


