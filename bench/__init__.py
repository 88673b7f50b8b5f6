"""Benchmarks, run as modules from the repository root (`uv run python -m bench.scale --help`), so that
`exo`, `tests.support` and the other benches import without sys.path edits."""
