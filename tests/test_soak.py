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
    verdicts = [line for line in result.stdout.splitlines() if line.startswith(("PASS: ", "FAIL: "))]
    assert not [v for v in verdicts if v.startswith("FAIL")], verdicts
    # Each criterion was checked: a recovery per kill (two in 3 minutes), throughput, failures,
    # cards, exact text, replay, hangs.
    kills = sum(v.startswith("PASS: kill -9 nats-") for v in verdicts)
    assert kills == 2 and len(verdicts) == kills + 6, verdicts
