"""What every benchmark records beside its figures."""
from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def git_commit() -> str | None:
    """The checkout's short commit id, "+changes" when the tree differs from it (a copy sent to the GPU
    machine can carry an older .git than its files), or None where there is no git."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True,
                              timeout=10).stdout.strip()
    try:
        commit = git("rev-parse", "--short", "HEAD") or None
        return commit and commit + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return None
