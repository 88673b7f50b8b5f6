"""README's layering, enforced: only exo/bus imports `nats` (the rest holds exo.bus.connection's
Connection and catches exo.bus.errors' BROKER_ERRORS), and the pure core imports no service."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.support.layering import ALLOWED_ARROWS, BEGIN, arrows_markdown, with_arrows_table
from tests.support.source import parse_python

EXO = Path(__file__).resolve().parents[1] / "exo"


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(parse_python(path)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            if node.module == "exo":  # `from exo import event_loop`: the module is exo.event_loop
                names.update(f"exo.{alias.name}" for alias in node.names)
    return names


def importers_of(prefix: str, outside: str) -> dict[str, list[str]]:
    found = {}
    for path in sorted(EXO.rglob("*.py")):
        package = path.relative_to(EXO).parts[0]
        if package == outside:
            continue
        hits = sorted(m for m in imported_modules(path) if m == prefix or m.startswith(prefix + "."))
        if hits:
            found[str(path.relative_to(EXO.parent))] = hits
    return found


def test_only_the_bus_package_imports_nats():
    assert importers_of("nats", outside="bus") == {}


def test_the_check_sees_an_import_of_nats(tmp_path, monkeypatch):
    """The walk above is not vacuous: a file outside exo/bus that imports nats is reported."""
    assert imported_modules(EXO / "bus" / "connection.py") >= {"nats", "nats.aio.client"}
    stray = tmp_path / "stray.py"
    stray.write_text("from nats.errors import Error\n")
    assert imported_modules(stray) == {"nats.errors"}


def test_the_pure_core_imports_no_service_and_no_io_library():
    for path in sorted((EXO / "core").rglob("*.py")):
        outside = {m for m in imported_modules(path) if m.split(".")[0] not in CORE_MAY_IMPORT and not m.startswith("exo.core")}
        assert outside == set(), path


# The standard library parts the core uses, and msgspec: no asyncio, no sockets, no clock, no mlx.
CORE_MAY_IMPORT = {"__future__", "collections", "dataclasses", "enum", "functools", "hashlib", "itertools", "json",
                   "math", "msgspec", "re", "typing", "collections.abc",
                   "fnmatch",  # exo/core/keys.py: a key's model patterns
                   "llguidance"}  # exo/core/grammar.py: schemas to grammars, pure computation


def test_no_arrow_runs_back_up():
    crossing = {}
    for path in sorted(EXO.rglob("*.py")):
        package = path.relative_to(EXO).parts[0].removesuffix(".py")  # exo/memory.py is "memory"
        if package not in ALLOWED_ARROWS:
            continue  # exo/node.py, exo/main.py: the wiring on top
        reached = {m.split(".")[1] for m in imported_modules(path) if m.startswith("exo.") and m.count(".") >= 1}
        wrong = reached - ALLOWED_ARROWS[package] - {package}
        if wrong:
            crossing[str(path.relative_to(EXO.parent))] = sorted(wrong)
    assert crossing == {}


def test_docs_architecture_shows_the_allowed_arrows():
    document = (EXO.parent / "docs" / "architecture.md").read_text()
    assert with_arrows_table(document) == document, "run `uv run python -m tests.support.layering docs/architecture.md`"


def test_the_arrows_table_renders_each_package_with_what_it_may_import():
    rows = arrows_markdown().splitlines()
    assert len(rows) == 2 + len(ALLOWED_ARROWS) + 1  # header, rule, one row per package, the wiring on top
    assert "| `exo/core` | nothing else of exo |" in rows
    assert "| `exo/runner` | `bus`, `core`, `event_loop`, `memory`, `settings`, `telemetry` |" in rows
    assert "| `exo/event_loop.py` | nothing else of exo |" in rows
    with pytest.raises(ValueError, match="no layers block"):
        with_arrows_table(f"a table lost its end marker: {BEGIN}")


def test_only_the_tools_use_the_log_tooling():
    """exo/bus/tooling (raw log reading, inspection) serves `exo replay`, `inspect` and `events`;
    the node's own packages do without it."""
    users = {str(path.relative_to(EXO.parent)) for path in sorted(EXO.rglob("*.py"))
             if any(m.startswith("exo.bus.tooling") for m in imported_modules(path))}
    allowed = {u for u in users if u.startswith(("exo/tools/", "exo/bus/tooling/"))}
    assert users - allowed == set() and allowed  # the tools do use it: the walk can see an import


SURFACES = ("openai", "anthropic", "ollama", "cluster")  # exo/api/<surface>/: one package per API surface


def test_api_surfaces_stand_apart_on_the_shared_modules():
    """A surface imports the shared modules of exo/api and never another surface; the shared modules
    import no surface (exo/api/app.py, which registers every route, is the one exception)."""
    crossing = {}
    for path in sorted((EXO / "api").rglob("*.py")):
        parts = path.relative_to(EXO / "api").parts
        own = parts[0] if len(parts) > 1 and parts[0] in SURFACES else None
        if path.name == "app.py" and own is None:
            continue
        reached = {m.split(".")[2] for m in imported_modules(path) if m.startswith("exo.api.") and m.count(".") >= 2}
        wrong = (reached & set(SURFACES)) - {own}
        if wrong:
            crossing[str(path.relative_to(EXO.parent))] = sorted(wrong)
    assert crossing == {}
    assert imported_modules(EXO / "api" / "app.py") >= {"exo.api.openai", "exo.api.cluster"}  # the walk sees them
