"""`batchspec run --devices cuda:0,cuda:1,...`: one worker process per device on one machine.

Worker i runs shard i of N (an ordinary resumable `batchspec run` with its own lock, errors and
summary) into OUT's shard folder, out.shards/part-{shard}.jsonl, logging to part-{shard}.log
there. When every worker has finished, the shards are merged into OUT. A worker that dies is
reported with its log; the other workers go on, and rerunning the same command resumes its shard.
"""

import os
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from dataclasses import fields, replace
from pathlib import Path

from batchspec.config import RunConfig, as_toml, is_stream
from batchspec.errors import (EXIT_INTERRUPTED, EXIT_OK, EXIT_ROW_ERRORS, STOP_SIGNALS, StopSignals, UsageError,
                              UserError, say)
from batchspec.merge import merge
from batchspec.sink import OutputPaths, locked, output_paths, written
from batchspec.sources import input_size
from batchspec.stats import progress_bar


def parse_devices(devices: str) -> list[str]:
    names = [d.strip() for d in devices.split(",")]
    if not all(names):
        raise UsageError(f"--devices wants a comma-separated list like cuda:0,cuda:1, got {devices!r}")
    return names


def shard_folder(out: str) -> Path:
    """out/run.jsonl -> out/run.shards/"""
    return OutputPaths.of(out).lock.with_suffix(".shards")


def check_devices_options(cfg: RunConfig) -> None:
    if cfg.num_shards is not None or "SLURM_ARRAY_TASK_COUNT" in os.environ:
        raise UsageError("--devices makes its own shards, one per device; it cannot be combined with --num-shards "
                         "or a SLURM array (give each array task one device instead)")
    if "{shard" in cfg.out:
        raise UsageError("with --devices, --out is the merged output: drop its {shard} placeholder")
    if is_stream(cfg.input):
        raise UsageError("--devices has every worker read the input: give a file, not a stream (stdin, a FIFO)")


def check_resumable(paths: OutputPaths, config_file: Path, count: int) -> None:
    """OUT must be new or begun by --devices with as many devices (the shards hold other rows)."""
    if paths.fingerprint.exists():
        raise UsageError(f"{paths.out} was started by a run without --devices; resume it the same way, "
                         "or pass --overwrite to start over")
    if written(paths.out) and not config_file.exists():
        raise UsageError(f"{paths.out} exists and was not started by batchspec; choose another --out, or pass "
                         "--overwrite to replace it")
    if config_file.exists():
        before = tomllib.loads(config_file.read_text())["num_shards"]
        if before != count:
            raise UsageError(f"{paths.out} was started on {before} devices; resume it on {before}, "
                             "or pass --overwrite to start over")


class Worker:
    """One `batchspec run` child process for shard `index` on `device`, logging to a file."""

    def __init__(self, index: int, device: str, config_file: Path, cfg: RunConfig, env: dict):
        self.index, self.device = index, device
        self.log = config_file.with_name(f"part-{index}.log")
        command = [sys.executable, "-m", "batchspec", "run", cfg.input, "--config", str(config_file),
                   "--device", device, "--shard-index", str(index)]
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL)

    def last_words(self) -> str:
        lines = self.log.read_text(errors="replace").strip().splitlines()
        return lines[-1] if lines else "(empty log)"

    def exit_code(self) -> int:
        """Its exit code; a worker killed by a stop signal counts as interrupted (a forwarded signal
        can land after it dropped its handlers, on its way out: its shard resumes either way)."""
        code = self.process.returncode
        return EXIT_INTERRUPTED if -code in STOP_SIGNALS else code

    def failure(self, count: int) -> str:
        code = self.process.returncode
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        return (f"worker {self.index} ({self.device}, shard {self.index} of {count}) {how}: {self.last_words()}\n"
                f"  log: {self.log}")


def worker_env(devices: list[str]) -> dict:
    """The workers' environment, without the BATCHSPEC_<OPTION> variables: their options come
    from the resolved config file alone (a BATCHSPEC_DEVICES there would start workers of
    workers, a BATCHSPEC_OUT would beat the file's shard OUT). CPU workers share the cores
    instead of each taking all of them."""
    options = {"BATCHSPEC_" + name.upper() for name in (*(f.name for f in fields(RunConfig)), "config")}
    env = {k: v for k, v in os.environ.items() if k not in options}
    cpu_workers = sum(d == "cpu" for d in devices)
    if cpu_workers and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // cpu_workers))
    return env


class LineCounter:
    """Complete lines of a growing file, reading only what was appended since the last call."""

    def __init__(self, path: Path):
        self.path, self.offset, self.lines = path, 0, 0

    def __call__(self) -> int:
        if self.path.exists():
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
            complete = data.rfind(b"\n") + 1
            self.lines += data.count(b"\n", 0, complete)
            self.offset += complete
        return self.lines


def run_on_devices(cfg: RunConfig) -> int:
    devices = parse_devices(cfg.devices)
    check_devices_options(cfg)
    paths = output_paths(cfg.out, cfg.input_files())
    folder = shard_folder(str(paths.out))
    template = str(folder / "part-{shard}.jsonl")
    config_file = folder / "run.toml"
    with locked(paths):
        if cfg.overwrite:
            shutil.rmtree(folder, ignore_errors=True)
            for path in paths.all():
                path.unlink(missing_ok=True)
        else:
            check_resumable(paths, config_file, len(devices))
        folder.mkdir(parents=True, exist_ok=True)
        shared = replace(cfg, out=template, num_shards=len(devices), devices=None, device="auto", overwrite=False,
                         progress=False)
        config_file.write_text(as_toml(shared.run_options()) + "\n")
        env = worker_env(devices)
        workers = [Worker(i, device, config_file, shared, env) for i, device in enumerate(devices)]
        named = ", ".join(f"{w.device} pid {w.process.pid}" for w in workers)
        say(f"started {len(workers)} workers ({named}); their logs: {folder}/part-*.log")
        wait(workers, template, input_size(cfg.input, cfg.split, cfg.subset), cfg.progress)
        return finish(workers, template, str(paths.out))


def wait(workers: list[Worker], template: str, total_rows: int | None, progress: bool) -> None:
    """Until every worker has exited; stop signals are passed on to them (each then stops between
    two decode steps, as a single run does)."""

    def forward(signum):
        for w in workers:
            if w.process.poll() is None:
                w.process.send_signal(signum)

    shard_paths = [OutputPaths.of(template.format(shard=w.index)) for w in workers]
    counters = [LineCounter(path) for paths in shard_paths for path in (paths.out, paths.errors)]
    bar = progress_bar(total_rows, progress)
    with StopSignals(forward):
        while any(w.process.poll() is None for w in workers):
            time.sleep(0.5)
            bar.update(sum(c() for c in counters) - bar.n)
    bar.close()


def finish(workers: list[Worker], template: str, out: str) -> int:
    """Merge when every worker finished; else report the ones that did not."""
    failed = [w for w in workers if w.exit_code() not in (EXIT_OK, EXIT_ROW_ERRORS)]
    if failed:
        say("\n".join(w.failure(len(workers)) for w in failed))
        say(f"{len(failed)} of {len(workers)} workers did not finish; rerun the same command to resume their shards")
        codes = {w.exit_code() for w in failed}
        if codes == {EXIT_INTERRUPTED}:
            return EXIT_INTERRUPTED
        raise (UsageError if codes == {UsageError.exit_code} else UserError)(f"{out} was not merged")
    summary = merge(template, out, overwrite=True)  # OUT is this run's: checked before the workers started
    rate = summary["acceptance_rate"]
    say(f"done: {summary['rows_ok']} rows ok, {summary['rows_error']} errors, {summary['completion_tokens']} tokens"
        + (f", acceptance {rate:.3f}" if rate is not None else "")
        + f"\n  output     {out} (merged from {len(workers)} workers' shards in {Path(template).parent})")
    return EXIT_ROW_ERRORS if summary["rows_error"] else EXIT_OK
