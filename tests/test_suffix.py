"""--draft suffix through the job: exact (greedy equals the target alone, a killed run resumes to
the same records), and its index of earlier completions is the run's, shared by its batches."""

import signal
import subprocess

import orjson
import pytest

from batchspec import Generator
from test_job import ENV, cli, lines, run_here, wait_for_records, write_input


@pytest.fixture(scope="module")
def setup(tiny_pair, tmp_path_factory):
    root = tmp_path_factory.mktemp("suffix")
    target, draft = tiny_pair("llama")
    source = write_input(root / "in.jsonl", rows=60)
    common = ["--target", str(target), "--max-new-tokens", "24", "--batch-size", "4", "--no-progress", "--token-ids"]
    reference = root / "ar.jsonl"
    assert run_here(str(source), "--out", str(reference), *common, "--mode", "ar").exit_code == 3
    return {"input": source, "common": common, "reference": reference, "target": target, "draft": draft}


def token_ids(path) -> dict:
    return {r["id"]: r["token_ids"] for r in map(orjson.loads, lines(path))}


@pytest.mark.parametrize("drafter", [["--draft", "suffix"], ["--suffix"]], ids=["suffix", "model beside suffix"])
def test_greedy_suffix_drafting_equals_the_target_alone(setup, tmp_path, drafter):
    out = tmp_path / "out.jsonl"
    drafter = [*drafter, "--draft", str(setup["draft"])] if drafter == ["--suffix"] else drafter
    result = run_here(str(setup["input"]), "--out", str(out), *setup["common"], *drafter)
    assert result.exit_code == 3, result.output
    assert token_ids(out) == token_ids(setup["reference"])
    summary = orjson.loads(out.with_name("out.summary.json").read_bytes())
    assert summary["suffix_steps"] > 0  # the suffix drafter proposed


def test_a_killed_suffix_run_resumes_to_the_same_records(setup, tmp_path):
    """The index starts empty on the resume: the records do not depend on what it holds."""
    out = tmp_path / "out.jsonl"
    args = [*setup["common"], "--draft", "suffix"]
    process = subprocess.Popen(cli(str(setup["input"]), "--out", str(out), *args), env=ENV, stderr=subprocess.DEVNULL)
    wait_for_records(out, 8, process)
    process.kill()
    assert process.wait() == -signal.SIGKILL
    assert run_here(str(setup["input"]), "--out", str(out), *args).exit_code == 3
    assert token_ids(out) == token_ids(setup["reference"])


def test_the_index_is_the_runs_and_later_batches_draft_from_it(setup):
    """Batches of one row: the second of two identical prompts copies the first's completion from
    the index (its own text has no such continuation): every proposal accepted, fewer target
    forwards; every row's completion is in the index at the end."""
    generator = Generator(target=str(setup["target"]), draft="suffix", max_new_tokens=24, batch_size=1, window=1)
    rows = [{"id": "first", "prompt": "the cat sat on a mat"}, {"id": "again", "prompt": "the cat sat on a mat"},
            {"id": "other", "prompt": "water in the old house"}]
    first, again, other = generator.generate(rows)
    assert again["completion"] == first["completion"]
    assert again["stats"]["suffix_steps"] > 0 and again["stats"]["accepted_tokens"] == again["stats"]["draft_tokens"]
    assert again["stats"]["target_forwards"] < first["stats"]["target_forwards"]
    assert len(generator.decode_config.suffix) == 3
