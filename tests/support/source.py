"""Reading exo's own source as syntax trees, for the tests that check the code's shape."""

from __future__ import annotations

import ast
import gc
from pathlib import Path


def parse_python(path: Path) -> ast.Module:
    """The module's tree. Collection is paused meanwhile: CPython 3.11 raises "SystemError: AST
    constructor recursion depth mismatch" when a finalizer run by the collector while it builds the
    tree parses source itself (3.11's traceback does, for its carets: in a full run, a task another
    test dropped logged its exception as it was collected; 3,300 of 3,300 parses so disturbed failed
    in a reproduction, none with collection paused)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return ast.parse(path.read_text(), str(path))
    finally:
        if enabled:
            gc.enable()
