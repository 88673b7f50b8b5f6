"""What an exo process imports to start: the heavy libraries that only some requests need
(huggingface-hub for a download, numpy for vectors and audio, miniaudio) are imported on first
use, not by every node and CLI call at start-up (a node started on 1.7 s of CPU with them, 1.0 s
without: docs/scaling.md). A runner imports mlx-lm's trainer only to load an adapter."""

import subprocess
import sys

import pytest

HEAVY_FOR_A_NODE = ("huggingface_hub.hf_api", "numpy", "miniaudio", "transformers", "mlx_lm")


def modules_after(statement: str) -> set[str]:
    script = f"import sys; {statement}; print('\\n'.join(sys.modules))"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    return set(result.stdout.split())


@pytest.mark.parametrize("module", ["exo.node", "exo.main"])
def test_a_node_and_the_cli_start_without_the_heavy_libraries(module):
    loaded = modules_after(f"import {module}")
    assert module in loaded
    assert sorted(m for m in HEAVY_FOR_A_NODE if m in loaded) == []


def test_a_runner_starts_without_mlx_lms_trainer():
    loaded = modules_after("import exo.runner.__main__")
    assert "mlx_lm" in loaded  # it does need mlx-lm itself
    assert sorted(m for m in ("mlx_lm.tuner.trainer", "rich") if m in loaded) == []
