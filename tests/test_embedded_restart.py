"""The embedded nats-server dies under a running node: the node restarts it on the same port,
reconnects and carries on, and nothing acknowledged is lost."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from tests.support.ack_recorder import AckRecorder
from tests.support.exo_process import ExoProcess
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
            nats_url = node.nats_url()
            before, _, _ = stream_events([nats_url])
            (ports_file,) = (node.data_dir / "nats" / "ports").glob("*.ports")
            server_pid = int(ports_file.stem.rsplit("_", 1)[1])
            with AckRecorder([nats_url]) as acks:
                while len(acks.acked) < 20:
                    time.sleep(0.01)
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
                served_at = time.monotonic()
                while not acks.acks_between(served_at, float("inf")):
                    assert time.monotonic() - served_at < 30, "no ack after the restart"
                    time.sleep(0.05)
            assert reply.json()["choices"][0]["message"]["content"] == expected
            assert time.monotonic() - killed_at < 15
            after, _, _ = stream_events([nats_url])
            assert set(before) <= set(after)
            # Every publish the server acknowledged around the kill, up to its last ack before it
            # died and from the restarted server, is in the log at the sequence it was given.
            assert acks.acks_between(killed_at - 1, killed_at) and acks.missing_from(after) == []
            assert "restarting it on port" in node.output()
    finally:
        assert node.interrupt() == 0


def test_a_stream_across_server_kills_gives_the_exact_text_or_an_error(tmp_path):
    """kill -9 the embedded nats-server five times while a long answer streams: the text the
    client gets equals mlx-lm's, or the stream ends with an error; never a clean finish with
    text missing. At least one stream comes through every kill with the exact text.

    The kills are placed by tokens, not by time: at 1/8, 2/8 ... 5/8 of the answer's tokens
    (mlx-lm's own token boundaries), so they land mid-stream however fast the machine is."""
    import json

    import mlx_lm

    model = make_tiny_model(tmp_path / "model")
    reference_model, tokenizer = mlx_lm.load(str(model))
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    node = ExoProcess(tmp_path / "node", {}).start()
    outcomes = []
    try:
        with httpx.Client(base_url=node.url, timeout=120) as http:
            assert http.post("/models/add", json={"model_id": "local/tiny", "path": str(model)}).status_code == 200
            assert http.post("/place_instance", json={"model_id": "local/tiny", "wait": 60}).status_code == 200
            for max_tokens in (1500, 1200):
                pieces = [step.text for step in mlx_lm.stream_generate(reference_model, tokenizer, prompt,
                                                                        max_tokens=max_tokens)]
                expected = "".join(pieces)  # what mlx_lm.generate returns
                assert len(pieces) == max_tokens, len(pieces)
                # The text's length once token n has streamed, for the kills' tokens.
                kill_at = [len("".join(pieces[:max_tokens * k // 8])) for k in range(1, 6)]
                body = {"model": "local/tiny", "messages": messages, "temperature": 0, "max_tokens": max_tokens,
                        "stream": True}
                text, finish, error, kills = [], None, None, 0
                received = 0  # characters of text so far
                with http.stream("POST", "/v1/chat/completions", json=body) as response:
                    for line in response.iter_lines():
                        if kills < len(kill_at) and received >= kill_at[kills]:
                            kills += kill_the_server(node)  # 0 while it is being restarted: the next line tries again
                        if not line.startswith("data: {"):
                            continue
                        data = json.loads(line[6:])
                        if "error" in data:
                            error = data["error"]
                            continue
                        choice = data["choices"][0]
                        text.append(choice["delta"].get("content") or "")
                        received += len(text[-1])
                        finish = choice["finish_reason"] or finish
                exact = error is None and finish == "length" and "".join(text) == expected
                outcomes.append({"max_tokens": max_tokens, "kills": kills, "finish": finish, "exact": exact,
                                 "error": error and error["message"][:80]})
                assert kills >= 1, f"no kill landed mid-stream: {outcomes}"
                if error is None:  # a clean finish: the exact text, having come through the kills
                    assert exact and kills >= 2, f"a clean finish without the exact text, or too few kills: {outcomes}"
    finally:
        node.interrupt()
    exact_streams = sum(outcome["exact"] for outcome in outcomes)
    print(f"{exact_streams} of {len(outcomes)} streams exact across the kills: {outcomes}")
    assert exact_streams >= 1, f"no stream came through the kills with the exact text (every one errored): {outcomes}"


def kill_the_server(node: ExoProcess) -> int:
    """SIGKILL the node's running nats-server: 1, or 0 while it is still being restarted."""
    ports = list((node.data_dir / "nats" / "ports").glob("*.ports"))
    if len(ports) != 1:
        return 0
    try:
        os.kill(int(ports[0].stem.rsplit("_", 1)[1]), signal.SIGKILL)
    except ProcessLookupError:  # the one just killed: its file is not gone yet
        return 0
    return 1
