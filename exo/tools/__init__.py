"""Operator tools, run as `exo <tool> ...`. Each module here has `main(argv: list[str]) -> int`."""

TOOLS: dict[str, str] = {}  # subcommand name -> module path, e.g. {"replay": "exo.tools.replay"}
