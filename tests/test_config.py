"""--config job.toml: every run option, precedence CLI > environment > file > defaults."""

import subprocess
import sys

import orjson
import pytest
from click.testing import CliRunner

from batchspec.cli import main
from batchspec.config import RunConfig
from batchspec.sink import changed_options
from test_job import ENV, write_input


def batchspec(*args, env=None):
    return subprocess.run([sys.executable, "-m", "batchspec", "run", *args], env={**ENV, **(env or {})},
                          capture_output=True, text=True)


def setting(output: str, key: str) -> str:
    return next(line.split(" = ", 1)[1] for line in output.splitlines() if line.startswith(f"{key} = "))


def test_precedence_and_round_trip(tmp_path):
    config = tmp_path / "job.toml"
    config.write_text('[run]\ninput = "in.jsonl"\nout = "o.jsonl"\nmax-new-tokens = 5\nmode = "ar"\n'
                      'keep_fields = ["topic", "score"]\n')
    from_file = batchspec("--config", str(config), "--print-config")
    assert from_file.returncode == 0, from_file.stderr
    assert setting(from_file.stdout, "max_new_tokens") == "5" and setting(from_file.stdout, "mode") == '"ar"'
    assert setting(from_file.stdout, "keep_fields") == '["topic", "score"]'
    env = {"BATCHSPEC_MAX_NEW_TOKENS": "7"}
    assert setting(batchspec("--config", str(config), "--print-config", env=env).stdout, "max_new_tokens") == "7"
    cli = batchspec("--config", str(config), "--max-new-tokens", "9", "--print-config", env=env)
    assert setting(cli.stdout, "max_new_tokens") == "9"
    saved = tmp_path / "resolved.toml"
    saved.write_text(from_file.stdout)
    assert batchspec("--config", str(saved), "--print-config").stdout == from_file.stdout


def test_unknown_keys_are_a_usage_error(tmp_path):
    config = tmp_path / "job.toml"
    config.write_text('max_new_tokenz = 5\n')
    result = batchspec("in.jsonl", "--out", "o.jsonl", "--config", str(config))
    assert result.returncode == 2 and "unknown option(s): max_new_tokenz" in result.stderr
    config.write_text('max_new_tokens = 3.7\nbatch_size = true\ntemperature = 1\n')  # a float option takes an int
    result = CliRunner().invoke(main, ["run", "in.jsonl", "--out", "o.jsonl", "--config", str(config)])
    assert result.exit_code == 2 and "batch_size = True, max_new_tokens = 3.7: give a whole number" in result.output


def test_a_config_file_drives_a_run(tiny_pair, tmp_path):
    target, _ = tiny_pair("llama")
    source = write_input(tmp_path / "in.jsonl", rows=6)
    out = tmp_path / "out.jsonl"
    config = tmp_path / "job.toml"
    config.write_text(f'input = "{source}"\nout = "{out}"\ntarget = "{target}"\nmode = "ar"\n'
                      'max_new_tokens = 4\ntoken_ids = true\nprogress = false\n')
    result = batchspec("--config", str(config))
    assert result.returncode == 3, result.stderr  # the input has bad lines
    records = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert len(records) == 7  # 6 rows, and "row-7" of the bad lines is no duplicate in a 6-row file
    assert all(len(r["token_ids"]) <= 4 and r["stats"]["draft_tokens"] == 0 for r in records)


def test_a_fingerprint_from_before_an_option_existed_still_resumes(tmp_path):
    """An option added since OUT was started is unchanged while the run leaves it unset; set,
    or any other change, is named."""
    (tmp_path / "in.jsonl").write_text("{}\n")
    now = RunConfig(input=str(tmp_path / "in.jsonl"), out="o.jsonl").fingerprint()
    before = {**now, "options": {k: v for k, v in now["options"].items() if k != "tools_field"}}
    assert changed_options(before, now) == []
    with_tools = RunConfig(input=str(tmp_path / "in.jsonl"), out="o.jsonl", tools_field="tools").fingerprint()
    assert changed_options(before, with_tools) == ["tools_field"]
    longer = RunConfig(input=str(tmp_path / "in.jsonl"), out="o.jsonl", max_new_tokens=5).fingerprint()
    assert changed_options(now, longer) == ["max_new_tokens"]


@pytest.mark.parametrize("option", ["json_schema", "grammar", "chat_template"])
def test_a_file_an_option_names_edited_between_runs_is_a_change(tmp_path, option):
    """A resumed run would mix outputs under two schemas (grammars, templates): what the file
    says is named as changed, not only where it is."""
    (tmp_path / "in.jsonl").write_text("{}\n")
    named = tmp_path / "named"
    named.write_text('{"type": "string"}')
    config = RunConfig(input=str(tmp_path / "in.jsonl"), out="o.jsonl", **{option: str(named)})
    before = config.fingerprint()
    assert changed_options(before, config.fingerprint()) == []
    named.write_text('{"type": "integer"}')
    assert changed_options(before, config.fingerprint()) == [option]
