"""The API's own settings, read once at start: API keys, the resume grace, the body size limit."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from exo.api.request_body import MAX_BODY_BYTES


@dataclass(frozen=True)
class ApiSettings:
    api_keys: frozenset[str] = frozenset()  # empty: no key needed
    # A streaming client that drops its connection has this long to resume before its
    # generation is cancelled (0: cancel at once).
    resume_grace_s: float = 5.0
    max_body_bytes: int = MAX_BODY_BYTES

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> ApiSettings:
        keys = frozenset(k.strip() for k in environ.get("EXO_API_KEYS", "").split(",") if k.strip())
        return cls(
            api_keys=keys,
            resume_grace_s=float(environ.get("EXO_RESUME_GRACE_S", "5")),
            max_body_bytes=int(environ.get("EXO_MAX_BODY_BYTES", str(MAX_BODY_BYTES))),
        )
