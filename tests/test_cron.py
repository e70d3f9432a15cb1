"""jobs/cron.sh: resumes OUT, never overlaps a running call, rotates its log; and the example
configs under jobs/configs are valid run options."""

import fcntl
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from test_job import ENV, lines, run_cli, setup  # noqa: F401 (setup is a fixture)

REPO = Path(__file__).resolve().parents[1]
CRON = REPO / "jobs" / "cron.sh"


def cron(setup, out, **env) -> subprocess.CompletedProcess:
    environment = {**ENV, "BATCHSPEC": str(Path(sys.executable).parent / "batchspec"), **env}
    return subprocess.run(["bash", str(CRON), str(setup["input"]), str(out), *setup["models"]], env=environment,
                          capture_output=True, text=True, timeout=300)


def test_cron_resumes_skips_while_locked_and_rotates(setup, tmp_path):
    out = tmp_path / "out.jsonl"
    log = tmp_path / "out.cron.log"
    log.write_text("old log\n" * 20)  # 160 bytes: past the limit below, so this call rotates it
    with open(tmp_path / "out.cron.lock", "w") as held:  # a previous call still running
        fcntl.flock(held, fcntl.LOCK_EX)
        skipped = cron(setup, out, BATCHSPEC_LOG_BYTES="100")
        assert skipped.returncode == 0 and not skipped.stdout + skipped.stderr
        assert not out.exists() and log.read_text() == "old log\n" * 20  # nothing ran, nothing rotated
    result = cron(setup, out, BATCHSPEC_LOG_BYTES="100")
    assert result.returncode == 3 and not result.stdout + result.stderr  # cron mails any output
    assert lines(out) == lines(setup["reference"])
    assert (tmp_path / "out.cron.log.1").read_text() == "old log\n" * 20
    assert "exit code 3" in log.read_text() and "done" in log.read_text()
    again = cron(setup, out)
    assert again.returncode == 3 and lines(out) == lines(setup["reference"])  # resumed: nothing redone
    assert "already done" in log.read_text().split("start:")[-1]


@pytest.mark.parametrize("config", sorted((REPO / "jobs" / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_example_configs_are_valid(config, tmp_path):
    result = run_cli("in.jsonl", "--out", str(tmp_path / "out.jsonl"), "--config", str(config), "--print-config")
    assert result.returncode == 0, result.stderr
    wanted = tomllib.loads(config.read_text())["run"]
    resolved = tomllib.loads(result.stdout)
    assert {key: resolved[key] for key in wanted} == wanted
