"""CI's short soak: bench/soak.py for 90 s, the NATS server leading the event stream killed
twice and kept down 24 s each time, longer than the 20 s recovery allowed: the criteria fail with
one replica (compose's --replicas 3 changed to 1; see bench/soak.py for each criterion)."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(360)
def test_load_with_the_event_stream_leader_killed_twice_and_kept_down():
    result = subprocess.run(
        [sys.executable, "-m", "bench.soak", "--duration", "90", "--fault-every", "44", "--restart-after", "24"],
        capture_output=True, text=True, timeout=340, cwd=ROOT,
    )
    verdicts = [line for line in result.stdout.splitlines() if line.startswith(("PASS: ", "FAIL: "))]
    assert result.returncode == 0, "\n".join(verdicts) or result.stdout[-3000:] + result.stderr[-3000:]
    assert "State equals a replay of the log: True; hung requests: 0" in result.stdout
    assert not [v for v in verdicts if v.startswith("FAIL")], verdicts
    # Each criterion was checked: replicas, a recovery per kill (two), throughput, failures, cards,
    # exact text, replay, hangs.
    kills = sum(v.startswith("PASS: kill -9 nats-") for v in verdicts)
    assert kills == 2 and len(verdicts) == kills + 7, verdicts
