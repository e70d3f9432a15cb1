"""Shards: every row and every error line lands in exactly one shard; the union is one run."""

import re
import shutil
import subprocess
import sys

import orjson
import pytest
from click.testing import CliRunner

from batchspec.cli import main
from batchspec.errors import UsageError
from batchspec.shards import resolve, shard_of
from batchspec.status import status
from test_job import ENV, cli, lines, run_here, sidecar, write_input


def test_each_id_has_one_stable_shard():
    ids = [f"row-{k}" for k in range(3000)]
    counts = [0, 0, 0]
    for i in ids:
        counts[shard_of(i, 3)] += 1
    assert sum(counts) == 3000 and min(counts) > 900  # balanced
    assert [shard_of(i, 3) for i in ids] == [shard_of(i, 3) for i in ids]


def test_slurm_array_defaults_and_placeholder():
    env = {"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_MIN": "4", "SLURM_ARRAY_TASK_COUNT": "3"}
    assert resolve(None, None, "out/part-{shard:05d}.jsonl", env) == (3, 1, "out/part-00001.jsonl")
    assert resolve(None, None, "out.jsonl", {}) == (1, 0, "out.jsonl")
    assert resolve(2, 1, "p{shard}.jsonl", env) == (2, 1, "p1.jsonl")  # the command line wins
    with pytest.raises(UsageError, match="placeholder"):
        resolve(3, 0, "out.jsonl", {})
    with pytest.raises(UsageError, match="0..2"):
        resolve(3, 3, "p{shard}.jsonl", {})


@pytest.fixture(scope="module")
def sharded(tiny_pair, tmp_path_factory):
    """One input run whole and as 3 shards."""
    root = tmp_path_factory.mktemp("shards")
    target, draft = tiny_pair("llama")
    models = ["--target", str(target), "--draft", str(draft), "--gamma", "3", "--max-new-tokens", "8", "--no-progress"]
    source = write_input(root / "in.jsonl", rows=40)
    whole = root / "whole.jsonl"
    shards = [["--out", str(root / "part-{shard}.jsonl"), "--num-shards", "3", "--shard-index", str(index)]
              for index in range(3)]
    runs = [subprocess.Popen(cli(str(source), *models, *args), env=ENV, stderr=subprocess.PIPE, text=True)
            for args in [["--out", str(whole)], *shards]]  # side by side, as an array's tasks run
    errors = [run.communicate(timeout=300)[1] for run in runs]
    codes = [run.returncode for run in runs]
    assert codes[0] == 3 and set(codes) <= {0, 3}, errors
    return root, source, whole


def test_three_shards_make_one_run(sharded):
    root, _, whole = sharded
    parts = [root / f"part-{index}.jsonl" for index in range(3)]
    assert all(lines(p) for p in parts)  # each shard got rows
    assert sorted(line for p in parts for line in lines(p)) == lines(whole)
    errors = sorted(line for p in parts for line in lines(sidecar(p, ".errors.jsonl")))
    assert errors == lines(sidecar(whole, ".errors.jsonl"))


def test_another_shard_count_refuses_to_resume(sharded, tiny_pair):
    root, source, _ = sharded
    target, draft = tiny_pair("llama")
    result = run_here(str(source), "--out", str(root / "part-{shard}.jsonl"), "--target", str(target), "--draft",
                      str(draft), "--gamma", "3", "--max-new-tokens", "8", "--num-shards", "2", "--shard-index", "0")
    assert result.exit_code == 2 and "num_shards" in result.output  # its rows would belong to other shards


def merge(*args):
    return subprocess.run([sys.executable, "-m", "batchspec", "merge", *args], env=ENV, capture_output=True, text=True)


def test_merge_restores_one_output_in_input_order(sharded, tmp_path):
    root, source, whole = sharded
    merged = tmp_path / "merged.jsonl"
    result = merge(str(root / "part-{shard}.jsonl"), "--out", str(merged), "--order-by-input", str(source))
    assert result.returncode == 0, result.stderr
    assert lines(merged) == lines(whole) and lines(sidecar(merged, ".errors.jsonl")) == lines(
        sidecar(whole, ".errors.jsonl"))
    ids = [orjson.loads(line)["id"] for line in merged.read_bytes().splitlines()]
    order = [orjson.loads(line)["id"] for line in source.read_bytes().splitlines() if line.startswith(b'{"id":"row')]
    assert ids == [i for i in order if i in set(ids)]  # input order, each id once
    summary = orjson.loads(sidecar(merged, ".summary.json").read_bytes())
    assert summary["finished"] and summary["rows_ok"] == len(ids) and 0 < summary["acceptance_rate"] < 1


def test_merge_refuses_missing_or_unfinished_shards(sharded, tmp_path):
    root, _, _ = sharded
    partial = tmp_path / "partial"
    partial.mkdir()
    for index in (0, 2):  # shard 1 missing
        for suffix in (".jsonl", ".errors.jsonl", ".summary.json"):
            shutil.copy(root / f"part-{index}{suffix}", partial / f"part-{index}{suffix}")
    merged = tmp_path / "merged.jsonl"
    result = merge(str(partial / "part-{shard}.jsonl"), "--out", str(merged))
    assert result.returncode == 3 and "shard 1 is missing" in result.stderr and not merged.exists()
    summary = partial / "part-2.summary.json"
    summary.write_bytes(summary.read_bytes().replace(b'"finished": true', b'"finished": false'))
    result = merge(str(partial / "part-{shard}.jsonl"), "--out", str(merged))
    assert result.returncode == 3 and "part-2.jsonl is unfinished" in result.stderr
    expected = sorted(lines(partial / "part-0.jsonl") + lines(partial / "part-2.jsonl"))
    with open(partial / "part-2.jsonl", "ab") as f:  # a record twice, then a line torn by a kill
        f.write((partial / "part-0.jsonl").read_bytes().splitlines(keepends=True)[0] + b'{"id": "row-')
    result = merge(str(partial / "part-{shard}.jsonl"), "--out", str(merged), "--allow-partial")
    assert result.returncode == 0, result.stderr
    assert lines(merged) == expected
    assert orjson.loads(sidecar(merged, ".summary.json").read_bytes())["finished"] is False


def test_status_reads_each_shard(sharded, tmp_path):
    root, _, _ = sharded
    for suffix in (".jsonl", ".errors.jsonl", ".summary.json", ".run.json"):
        shutil.copy(root / f"part-1{suffix}", tmp_path / f"part-1{suffix}")
    out = tmp_path / "part-1.jsonl"
    kept = out.read_bytes().splitlines(keepends=True)
    out.write_bytes(b"".join(kept[:5]) + kept[5][:10])  # 5 rows and a line being written
    summary = tmp_path / "part-1.summary.json"
    summary.write_bytes(summary.read_bytes().replace(b'"finished": true', b'"finished": false'))
    (tmp_path / "part-1.lock").write_text("999999999")  # a pid that is not alive
    states = status(str(tmp_path / "part-1.jsonl"))
    assert len(states) == 1 and states[0]["state"] == "stopped"
    assert states[0]["rows"] == 5 and states[0]["remaining"] == len(kept) - 5
    every = status(str(root / "part-{shard}.jsonl"))
    assert [s["state"] for s in every] == ["finished"] * 3 and all(s["remaining"] == 0 for s in every)
    assert [s["rows"] for s in every] == [len(lines(root / f"part-{i}.jsonl")) for i in range(3)]
    assert all(0 < s["acceptance"] < 1 and s["tok/s"] > 0 for s in every)
    shown = subprocess.run([sys.executable, "-m", "batchspec", "status", str(root / "part-{shard}.jsonl")],
                           env=ENV, capture_output=True, text=True)
    assert shown.returncode == 0 and shown.stdout.count("finished") == 3
    speeds = [line.split()[5] for line in shown.stdout.splitlines()[1:]]
    assert all(re.fullmatch(r"\d+\.\d", speed) for speed in speeds), shown.stdout  # tok/s, one decimal


def test_status_before_any_shard_started_and_of_a_folder(tmp_path):
    """A template no file matches yet is said so (exit 0: a cron check before the array starts);
    a folder is a usage error, one line, no traceback."""
    runner = CliRunner()
    early = runner.invoke(main, ["status", str(tmp_path / "part-{shard:05d}.jsonl")])
    assert early.exit_code == 0 and "has started (no file matches it)" in early.output, early.output
    folder = runner.invoke(main, ["status", str(tmp_path)])
    assert folder.exit_code == 2 and "is a folder" in folder.output and "Traceback" not in folder.output


def test_merge_of_a_name_without_a_shard_placeholder_is_a_usage_error(tmp_path):
    result = CliRunner().invoke(main, ["merge", str(tmp_path / "out.jsonl"), "--out", str(tmp_path / "all.jsonl")])
    assert result.exit_code == 2 and "has no {shard} placeholder" in result.output, result.output


def test_merge_never_writes_over_a_shard_it_reads(sharded):
    """--overwrite replaces an earlier output, never one of the shards being merged."""
    root, _, _ = sharded
    before = (root / "part-0.jsonl").read_bytes()
    result = CliRunner().invoke(main, ["merge", str(root / "part-{shard}.jsonl"), "--out", str(root / "part-0.jsonl"),
                                       "--overwrite"])
    assert result.exit_code == 2 and "is a shard's own file" in result.output, result.output
    assert (root / "part-0.jsonl").read_bytes() == before
