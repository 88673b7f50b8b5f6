"""API keys in end-to-end tests: the admin key nodes are started with (EXO_API_KEYS) and keys an
admin adds at runtime."""

from __future__ import annotations

from typing import Any

import httpx

ADMIN = "admin-secret-for-tests"


def admin_client(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=120, headers={"Authorization": f"Bearer {ADMIN}"})


def add_key(admin: httpx.Client, **fields: Any) -> tuple[str, str]:
    """A new key with these fields (POST /keys): its id and its secret."""
    answer = admin.post("/keys", json=fields)
    assert answer.status_code == 200, answer.text
    return answer.json()["key"]["key_id"], answer.json()["secret"]
