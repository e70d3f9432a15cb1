"""Debian packages a test needs (SLURM, chromium): installed with apt-get when missing."""

import os
import shutil
import subprocess


def install(packages: list[str], commands: list[str], what: str) -> str | None:
    """Install `packages` unless every one of `commands` is already there; the reason `what`
    cannot run here (no root, no apt-get, the install failed), or None."""
    if all(shutil.which(command) for command in commands):
        return None
    if os.geteuid() != 0:
        return f"{what} needs root to install {', '.join(packages)}"
    if not shutil.which("apt-get"):
        return f"{', '.join(packages)} is not installed and there is no apt-get to install it"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    command = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages]
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    if result.returncode:  # stale package lists: refresh once
        subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True)
        result = subprocess.run(command, env=env, capture_output=True, text=True)
    if result.returncode:
        return f"apt-get could not install {', '.join(packages)}: {result.stderr.strip()[-400:]}"
    return None
