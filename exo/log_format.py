"""How the node's log lines look: plain text, or (EXO_LOG_FORMAT=json) one JSON object per line for
Loki, Elasticsearch or `jq`, with the ids a line names (passed as `extra=`) as fields of their own."""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# What every LogRecord carries: anything else on a record came in through `extra=`.
_RECORD_ATTRIBUTES = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line: time (ISO 8601, UTC), level, logger, node, message,
    the record's extra fields, and its exception (traceback text) if any."""

    def __init__(self, node: str) -> None:
        super().__init__()
        self._node = node

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname, "logger": record.name, "node": self._node, "message": record.getMessage(),
        }
        line.update((k, v) for k, v in vars(record).items() if k not in _RECORD_ATTRIBUTES and k not in line)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, default=str, ensure_ascii=False)  # newlines inside are escaped: one line


def configure_logging(level: str, log_format: str, node: str) -> None:
    """The root logger's handler (stderr) in the chosen format; `node` names this node in JSON lines."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter(node) if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler])
