"""Small filesystems for tests of full and small disks: a tmpfs mounted for one test (root only),
skipped with the reason elsewhere, required in CI (EXO_REQUIRE_MOUNT=1)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


def mounted_tmpfs(path: Path, size: str) -> Iterator[Path]:
    path.mkdir(parents=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        reason = f"cannot mount a tmpfs for a small disk: {done.stderr.strip() or done.returncode}"
        if os.environ.get("EXO_REQUIRE_MOUNT") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
