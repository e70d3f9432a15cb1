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


def readme_section(heading: str) -> str:
    """The README's text from `## heading` up to the next `## ` heading."""
    text = (ROOT / "README.md").read_text()
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def test_readme_is_a_short_manual():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 450


def test_options_section_names_every_run_option():
    """Every option `batchspec run --help` lists, by one of its names, as a whole word."""
    from click import Option

    from batchspec.cli import main

    section = readme_section("Options")
    missing = [option.opts[0] for option in main.commands["run"].params if isinstance(option, Option)
               if not any(re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", section)
                          for name in option.opts + option.secondary_opts)]
    assert not missing, f"README's Options section lacks {missing}"


def anchors(path: Path) -> set[str]:
    """GitHub's anchors for a Markdown file's headings: lower case, punctuation dropped, spaces
    to hyphens (the first of each; a repeated heading's -1, -2 are not needed here)."""
    headings = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", path.read_text(), flags=re.S), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


# docs/gamma-policy.md is left out: the γ policy's rewrite writes it, and its link is checked there.
LINKED_ELSEWHERE = {"docs/gamma-policy.md"}


def test_readme_links_point_to_files_and_headings_that_exist():
    text = re.sub(r"```.*?```", "", (ROOT / "README.md").read_text(), flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        if path in LINKED_ELSEWHERE:
            continue
        file = ROOT / path if path else ROOT / "README.md"
        if not file.exists() or (anchor and file.suffix == ".md" and anchor not in anchors(file)):
            broken.append(target)
    assert not broken, f"README links to what is not there: {broken}"
