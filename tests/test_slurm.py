"""jobs/slurm_array.sbatch and jobs/merge.sbatch on a real SLURM: Debian's slurmctld and slurmd,
installed if missing, started here on a generated one-node config (12 CPUs, three fake GPUs
backed by character devices, requeued jobs restart after 10 s, the scheduler looking for
eligible jobs every 2 s instead of 60), stopped at the end. Without root
or apt-get the tests skip and say why."""

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from debian import install
from test_job import ENV, lines, run_here, sidecar, write_input

REPO = Path(__file__).resolve().parents[1]
TOOLS = ("slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "sinfo")
NODE = "batchspec-ci"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_config(root: Path) -> Path:
    for name in ("state", "spool"):
        (root / name).mkdir()
    gpus = "".join(f"NodeName={NODE} Name=gpu File={device}\n" for device in ("/dev/null", "/dev/zero", "/dev/full"))
    (root / "gres.conf").write_text(gpus)
    config = root / "slurm.conf"
    config.write_text(f"""ClusterName=batchspecci
SlurmctldHost={socket.gethostname().split(".")[0]}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
AuthInfo=cred_expire=10
CredType=cred/none
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
GresTypes=gpu
NodeName={NODE} NodeAddr=127.0.0.1 CPUs=12 RealMemory=8000 Gres=gpu:3 State=UNKNOWN
PartitionName=ci Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
    return config


class Slurm:
    """A running one-node cluster; run() calls its commands with this cluster's config."""

    def __init__(self, root: Path):
        self.root = root
        self.env = {**ENV, "SLURM_CONF": str(write_config(root)), "OMP_NUM_THREADS": "1",
                    "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
        self.daemons = [subprocess.Popen(command, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                        for command in (["slurmctld", "-D", "-c"], ["slurmd", "-D", "-N", NODE])]
        self.wait_for(lambda: self.run("sinfo", "-h", "-o", "%T").stdout.strip() == "idle", 60, "the node to be idle")

    def run(self, *command, cwd=None) -> subprocess.CompletedProcess:
        return subprocess.run(command, env=self.env, cwd=cwd, capture_output=True, text=True, timeout=60)

    def sbatch(self, *args, cwd) -> str:
        result = self.run("sbatch", "--parsable", *args, cwd=cwd)
        assert result.returncode == 0, result.stderr
        return result.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> str:
        return self.run("scontrol", "show", "job", job_id).stdout

    def wait_until_idle(self, timeout: float = 300) -> None:
        self.wait_for(lambda: not self.run("squeue", "-h").stdout.strip(), timeout, "the queue to empty")

    def wait_for(self, condition, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                logs = "".join((self.root / f).read_text()[-2000:] for f in ("slurmctld.log", "slurmd.log")
                               if (self.root / f).exists())
                raise AssertionError(f"timed out waiting for {what}\n{self.run('squeue').stdout}\n{logs}")
            time.sleep(0.5)

    def stop(self) -> None:
        self.run("scancel", "--full", "--user", "root")
        for daemon in self.daemons:
            daemon.terminate()
        for daemon in self.daemons:
            try:
                daemon.wait(timeout=30)
            except subprocess.TimeoutExpired:
                daemon.kill()


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    reason = ("SLURM test needs root to start slurmctld/slurmd" if os.geteuid() != 0 else
              install(["slurmctld", "slurmd", "slurm-client"], list(TOOLS), "the SLURM test"))
    if reason:
        pytest.skip(reason)
    cluster = Slurm(tmp_path_factory.mktemp("slurm"))
    yield cluster
    cluster.stop()


def job_setup(tiny_pair, root: Path, rows: int) -> tuple[Path, list[str], Path]:
    """An input, model options and the unsharded run of it (the reference) under root."""
    target, draft = tiny_pair("llama")
    models = ["--target", str(target), "--draft", str(draft), "--gamma", "3", "--max-new-tokens", "24",
              "--batch-size", "2"]
    (root / "logs").mkdir()
    source = write_input(root / "in.jsonl", rows=rows)
    whole = root / "whole.jsonl"
    assert run_here(str(source), "--out", str(whole), *models, "--no-progress").exit_code == 3
    return source, models, whole


def submit(slurm: Slurm, root: Path, source: Path, models: list[str]) -> tuple[str, str]:
    """The README's two commands: the 3-task array, then the merge after it."""
    template = "out/part-{shard:05d}.jsonl"
    array = slurm.sbatch("--array=0-2", str(REPO / "jobs/slurm_array.sbatch"), str(source), template, *models,
                         cwd=root)
    merge = slurm.sbatch(f"--dependency=afterok:{array}", str(REPO / "jobs/merge.sbatch"), template,
                         "out/all.jsonl", "--order-by-input", str(source), cwd=root)
    return array, merge


def assert_merged_equals_unsharded(root: Path, whole: Path, rows: int) -> None:
    merged = root / "out/all.jsonl"
    assert merged.exists(), "".join(p.read_text() for p in sorted((root / "logs").iterdir()))
    assert lines(merged) == lines(whole)  # the same greedy completions, each row once
    assert lines(sidecar(merged, ".errors.jsonl")) == lines(sidecar(whole, ".errors.jsonl"))
    ids = [orjson.loads(line)["id"] for line in merged.read_bytes().splitlines()]
    assert len(ids) == len(set(ids)) == rows


def test_array_then_merge_equals_one_unsharded_run(slurm, tiny_pair, tmp_path):
    source, models, whole = job_setup(tiny_pair, tmp_path, rows=60)
    array, merge = submit(slurm, tmp_path, source, models)
    slurm.wait_until_idle()
    assert_merged_equals_unsharded(tmp_path, whole, rows=60)
    logs = sorted(p.name for p in (tmp_path / "logs").iterdir())
    assert logs == [f"batchspec-{array}_{task}.log" for task in range(3)] + [f"batchspec-merge-{merge}.log"]
    assert all(re.search("batchspec exited with code [03]$", (tmp_path / "logs" / name).read_text(), re.M)
               for name in logs[:3])
    assert "JobState=COMPLETED" in slurm.job(merge)


def test_preempted_task_is_requeued_and_resumes(slurm, tiny_pair, tmp_path):
    source, models, whole = job_setup(tiny_pair, tmp_path, rows=300)
    array, _ = submit(slurm, tmp_path, source, models)
    task = f"{array}_1"
    part = tmp_path / "out/part-00001.jsonl"
    slurm.wait_for(lambda: len(lines(part)) >= 3, 120, f"{task} to write records")
    signalled = slurm.run("scancel", "--signal=USR1", "--batch", task)  # what --signal=B:USR1@120 sends
    assert signalled.returncode == 0, signalled.stderr
    slurm.wait_until_idle()  # a requeued job may start again after cred_expire (10 s here, 120 by default)
    log = (tmp_path / "logs" / f"batchspec-{task}.log").read_text()
    assert "exited with code 75" in log and "requeueing" in log  # it really was stopped mid-run
    assert "restart 1" in log and "resuming" in log and log.rstrip().endswith("exited with code 3")
    assert_merged_equals_unsharded(tmp_path, whole, rows=300)
