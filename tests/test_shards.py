"""Shards: every row and every error line lands in exactly one shard; the union is one run."""

import pytest

from batchspec.errors import UsageError
from batchspec.shards import resolve, shard_of
from test_job import lines, run_cli, sidecar, write_input


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


def test_three_shards_make_one_run(tiny_pair, tmp_path):
    target, draft = tiny_pair("llama")
    models = ["--target", str(target), "--draft", str(draft), "--max-new-tokens", "8", "--no-progress"]
    source = write_input(tmp_path / "in.jsonl", rows=40)
    whole = tmp_path / "whole.jsonl"
    assert run_cli(str(source), "--out", str(whole), *models).returncode == 3
    parts = []
    for index in range(3):
        result = run_cli(str(source), "--out", str(tmp_path / "part-{shard}.jsonl"), *models,
                         "--num-shards", "3", "--shard-index", str(index))
        assert result.returncode in (0, 3), result.stderr
        parts.append(tmp_path / f"part-{index}.jsonl")
    assert all(lines(p) for p in parts)  # each shard got rows
    assert sorted(line for p in parts for line in lines(p)) == lines(whole)
    errors = sorted(line for p in parts for line in lines(sidecar(p, ".errors.jsonl")))
    assert errors == lines(sidecar(whole, ".errors.jsonl"))
