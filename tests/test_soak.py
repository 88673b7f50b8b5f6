"""CI's short soak: bench/soak.py for 3 minutes with a NATS server killed every minute."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(420)
def test_three_minutes_of_load_with_a_nats_server_killed_every_minute():
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "soak.py"), "--duration", "180", "--fault-every", "60"],
        capture_output=True, text=True, timeout=400,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "State equals a replay of the log: True; hung requests: 0" in result.stdout
    assert result.stdout.count("kill -9 nats-") >= 4  # 3 kills, then their recovery lines
