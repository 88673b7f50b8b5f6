"""Operator tools, run as `exo <tool> ...`. Each module here has `main(argv: list[str]) -> int`."""

# subcommand name -> module path
TOOLS: dict[str, str] = {
    "replay": "exo.tools.replay",
    "events": "exo.tools.events",
    "inspect": "exo.tools.inspect",
    "nats-context": "exo.tools.nats_context",
    "keys": "exo.tools.keys",
    "node": "exo.tools.nodes",
    "token": "exo.tools.tokens",
}
