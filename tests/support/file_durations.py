"""Each test file's seconds in a full run, for ordering the suite: longest files first, so that
pytest-xdist's two workers (CI's two cores) end together instead of one waiting on a long file
scheduled last. Regenerate after a full run that wrote a JUnit report:

    uv run pytest --junitxml=/tmp/junit.xml && uv run python -m tests.support.file_durations /tmp/junit.xml

A file missing from the table (a new one) counts as short; the order only affects the run's length."""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

TABLE = Path(__file__).resolve().parent.parent / "file_durations.json"


def load() -> dict[str, float]:
    try:
        table = json.loads(TABLE.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(table, dict):
        return {}
    # a hand-edited or merged table may hold anything: only "file": seconds counts, the rest is ignored
    return {name: float(seconds) for name, seconds in table.items()
            if isinstance(name, str) and isinstance(seconds, (int, float)) and not isinstance(seconds, bool)
            and 0 <= seconds < 1e6}


def from_junit(report: Path) -> dict[str, float]:
    """Seconds per test file (setup, call and teardown) from a JUnit XML report."""
    seconds: dict[str, float] = {}
    for case in ElementTree.parse(report).iter("testcase"):
        module = case.get("classname", "").split(".")
        index = next((i for i, part in enumerate(module) if part.startswith("test_")), None)
        if index is not None:
            name = "/".join(module[: index + 1]) + ".py"
            seconds[name] = seconds.get(name, 0.0) + float(case.get("time", 0))
    return {name: round(value, 1) for name, value in sorted(seconds.items(), key=lambda item: -item[1])}


if __name__ == "__main__":
    TABLE.write_text(json.dumps(from_junit(Path(sys.argv[1])), indent=1) + "\n")
