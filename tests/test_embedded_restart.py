"""The embedded nats-server dies under a running node: the node restarts it on the same port,
reconnects and carries on, and nothing acknowledged is lost."""

from __future__ import annotations

import os
import re
import signal
import time

import httpx
import pytest

from tests.exo_process import ExoProcess
from tests.support.tiny_model import make_tiny_model
from tests.test_compose_topology import stream_events

pytestmark = pytest.mark.slow


def test_a_killed_embedded_server_is_restarted_and_nothing_acknowledged_is_lost(tmp_path):
    model = make_tiny_model(tmp_path / "model")
    node = ExoProcess(tmp_path / "node", {}).start()
    body = {"model": "local/tiny", "messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "max_tokens": 8}
    try:
        with httpx.Client(base_url=node.url, timeout=60) as http:
            assert http.post("/models/add", json={"model_id": "local/tiny", "path": str(model)}).status_code == 200
            assert http.post("/place_instance", json={"model_id": "local/tiny"}).status_code == 200
            expected = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
            nats_url = re.search(r"NATS at (\S+)", node.output()).group(1)
            before, _, _ = stream_events([nats_url])
            (ports_file,) = (node.data_dir / "nats" / "ports").glob("*.ports")
            server_pid = int(ports_file.stem.rsplit("_", 1)[1])
            os.kill(server_pid, signal.SIGKILL)
            killed_at = time.monotonic()
            while True:
                try:
                    reply = http.post("/v1/chat/completions", json=body)
                    if reply.status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() - killed_at < 30, node.output()[-2000:]
                time.sleep(0.2)
            assert reply.json()["choices"][0]["message"]["content"] == expected
            assert time.monotonic() - killed_at < 15
            after, _, _ = stream_events([nats_url])
            assert set(before) <= set(after)
            assert "restarting it on port" in node.output()
    finally:
        assert node.interrupt() == 0
