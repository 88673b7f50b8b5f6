"""mlx_lm.server as a process on a free port: the reference for tests and benches that compare
exo with mlx-lm's own server (its prompt cache included)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.support.exo_process import free_port


def start_mlx_lm_server(model_dir: Path, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "mlx_lm", "server", "--model", str(model_dir), "--port", str(port)],
        stdout=open(log, "wb"), stderr=subprocess.STDOUT, env={**os.environ},
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/v1/models", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"mlx_lm.server did not start: {log.read_text()[-2000:]}")
