"""The README's quickstart works as written: its run command, on the embedded default pair."""

import os
import re
import subprocess
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[1]


def quickstart_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    return [line for block in re.findall(r"```bash\n(.*?)```", section, re.S) for line in block.splitlines() if line]


def test_quickstart_names_the_three_commands():
    commands = quickstart_commands()
    assert commands[0] == "make install" and commands[-1] == "make test"
    assert commands[1].startswith(".venv/bin/batchspec run sample_data/")
    assert (ROOT / ".ci" / "run").read_text().strip().endswith("make test")  # CI runs the README's test command


def test_quickstart_run_command_as_written(tmp_path):
    """Run in a scratch folder that sees the repository's .venv and sample_data, so out.jsonl
    lands there and not in the checkout."""
    for name in (".venv", "sample_data"):
        (tmp_path / name).symlink_to(ROOT / name)
    command = quickstart_commands()[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(command, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / command.split("--out ")[1].split()[0]
    records = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    source_rows = (ROOT / command.split()[2]).read_text().splitlines()
    assert len(records) == len(source_rows)
    assert all(r["completion"].strip() for r in records)
    summary = orjson.loads(out.with_name("out.summary.json").read_bytes())
    assert summary["finished"] and sum(summary["gamma_histogram"]) > 0  # the speculative loop ran, gamma auto
    if summary["draft_tokens"]:  # auto speculated (whether it pays depends on this machine's step costs)
        assert summary["acceptance_rate"] > 0  # the draft proposes what the target sometimes keeps
    assert "tok/s" in result.stderr and "acceptance" in result.stderr
