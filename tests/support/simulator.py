"""The scale simulator's process (tests/support/simulated_nodes.py run as one process for many
nodes) and the fake model its nodes serve: shared by tests/test_scale.py and bench/scale.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support.cluster import wait_until

FAKE_MODEL = "sim/fake"


def fake_model_dir(root: Path) -> Path:
    """A model folder the simulated runners never read: its config.json for the card's shape, and a
    sparse weights file for its size (1 MB: room for ten instances on any node)."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "model.safetensors", "wb") as weights:
        weights.truncate(10**6)
    (root / "config.json").write_text(json.dumps({
        "model_type": "llama", "num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 4096, "torch_dtype": "float16"}))
    return root


class SimulatorProcess:
    def __init__(self, nats_url: str, nodes: int, data_dir: Path, log_path: Path, delay_ms: float = 5.0) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.support.simulated_nodes", "--nats", nats_url, "--nodes", str(nodes),
             "--data-dir", str(data_dir), "--delay-ms", str(delay_ms)], stdout=self._log, stderr=subprocess.STDOUT)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float) -> None:
        wait_until(lambda: "simulated nodes ready" in self.output() or self.process.poll() is not None, timeout,
                   what="simulated nodes ready")
        assert self.process.poll() is None, self.output()

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self._log.close()
