"""Prefill on one instance, decode on another (exo/runner/prefill_peer.py), both sides in this
process over real sockets with a real tiny model: a served cache continues as mlx-lm's own
generation; asks the server was not told to expect, or that are replayed, late, forged, changed on
the way or out of bounds are refused with the server's reason and nothing prefilled; an asker
refuses a cache signed by another key or changed on the way; a silent peer is timed out."""

from __future__ import annotations

import asyncio
import queue
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import mlx.core as mx
import msgspec
import nkeys
import pytest
from mlx_lm import load
from mlx_lm.generate import stream_generate
from mlx_lm.sample_utils import make_sampler

from exo.bus.chunk_signing import ChunkSigner
from exo.core.ids import ModelId, TaskId
from exo.runner import kv_transfer as kv
from exo.runner.kv_wire import TransferLimits
from exo.runner.prefill import PREFILL_STEP
from exo.runner.prefill_peer import NONCE_BYTES, PrefillAsk, PrefillRefused, PrefillServer, ask_prefill, encode_ask, sign_ask
from tests.support.tiny_model import make_tiny_model
from tests.test_kv_transfer import prompt_of

MODEL = ModelId("local/tiny")
TASK = TaskId("task-1")
DECODE_TOKENS = 24
T = TypeVar("T")


class ModelThread:
    """One thread runs mlx for the whole process, as a runner's model thread does. Not a
    ThreadPoolExecutor: mlx (0.32) may abort the process when a thread that used mlx-lm's
    thread-local generation stream exits, which an executor's threads do at interpreter exit."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]]] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="model", daemon=True).start()

    def _run(self) -> None:
        while True:
            future, work = self._jobs.get()
            try:
                future.set_result(work())
            except Exception as error:
                future.set_exception(error)

    async def run(self, work: Callable[[], T]) -> T:
        future: Future[T] = Future()
        self._jobs.put((future, work))
        return await asyncio.wrap_future(future)


MODEL_THREAD = ModelThread()


def new_signer(node_id: str) -> ChunkSigner:
    return ChunkSigner(node_id, bytes(nkeys.encode_seed(secrets.token_bytes(32), nkeys.PREFIX_BYTE_USER)))


SERVER_KEY, ASKER_KEY = new_signer("prefill-node"), new_signer("decode-node")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    return load(str(make_tiny_model(tmp_path_factory.mktemp("prefill_peer") / "tiny")))


@dataclass
class Served:
    server: PrefillServer
    port: int
    prefilled: list[TaskId]  # every task the prefill ran for

    def expect(self, task_id: TaskId = TASK, *, asker: ChunkSigner = ASKER_KEY, deadline: float = 0.0) -> None:
        self.server.expect(task_id, asker.node_id, asker.public_key, deadline or time.monotonic() + 60)


def as_asked(task_id: TaskId, tokens: list[int]) -> tuple[TaskId, list[int]]:
    return task_id, tokens


@asynccontextmanager
async def serving(model: Any, *, signer: ChunkSigner = SERVER_KEY, max_tokens: int = 4096,
                  clock: Callable[[], float] = time.monotonic, prefills_as: Callable[[TaskId, list[int]], Any] = as_asked,
                  **options: Any) -> AsyncIterator[Served]:
    """A prefill server on 127.0.0.1 whose prefill is the one a runner runs, on a model thread.
    `prefills_as`: the task and tokens it really prefills for an ask (a faulty or lying server's)."""
    prefilled: list[TaskId] = []

    def prefill_and_encode(task_id: TaskId, tokens: list[int]) -> kv.Encoded:
        task_id, tokens = prefills_as(task_id, tokens)
        cache, pending = kv.prefill_for_transfer(model, tokens)
        return kv.encode_cache(task_id, MODEL, pending, cache)

    async def prefill(task_id: TaskId, tokens: list[int]) -> kv.Encoded:
        prefilled.append(task_id)
        return await MODEL_THREAD.run(lambda: prefill_and_encode(task_id, tokens))

    options.setdefault("announce_grace_s", 0.2)  # an unannounced task is refused this much later
    server = PrefillServer(MODEL, prefill, signer, max_tokens=max_tokens, vocab_size=model.args.vocab_size,
                           clock=clock, **options)
    port = await server.start("127.0.0.1")
    try:
        yield Served(server, port, prefilled)
    finally:
        await server.close()


async def ask(port: int, model: Any, tokens: list[int], *, task_id: TaskId = TASK, signer: ChunkSigner = ASKER_KEY,
              model_id: ModelId = MODEL, timeout_s: float = 30) -> tuple[Any, list[bytes]]:
    limits = kv.limits_for(model, MODEL, max_bytes=1 << 26, max_tokens=4096)
    return await ask_prefill("127.0.0.1", port, task_id=task_id, model_id=model_id, tokens=tokens, signer=signer,
                             server_public_key=SERVER_KEY.public_key, limits=limits, timeout_s=timeout_s)


async def refusal(port: int, model: Any, tokens: list[int], **options: Any) -> str:
    with pytest.raises(PrefillRefused) as refused:
        await ask(port, model, tokens, **options)
    return str(refused.value)


@pytest.mark.parametrize("length", [10, 300])
async def test_a_served_prefill_continues_as_mlx_lm_s_own_generation(tiny, length):
    model, tokenizer = tiny
    tokens = prompt_of(tokenizer, length)
    async with serving(model) as side:
        side.expect()
        header, payloads = await ask(side.port, model, tokens)
    assert side.prefilled == [TASK] and (header.cached_tokens, header.pending_tokens) == (length - 1, tokens[-1:])
    greedy = make_sampler(temp=0.0)
    cache = kv.rebuild_cache(header, payloads)
    continued = [r.token for r in kv.continue_generation(model, tokenizer, header, cache, max_tokens=DECODE_TOKENS,
                                                         sampler=greedy)]
    reference = [r.token for r in stream_generate(model, tokenizer, mx.array(tokens), max_tokens=DECODE_TOKENS,
                                                  sampler=greedy, prefill_step_size=PREFILL_STEP)]
    assert continued == reference and len(reference) > 1


async def test_an_ask_that_comes_before_its_announcement_waits_for_it(tiny):
    """Both sides follow the same task.created event, on different nodes: either may be first."""
    model, tokenizer = tiny
    tokens = prompt_of(tokenizer, 10)
    async with serving(model, announce_grace_s=5.0) as side:
        asked = asyncio.create_task(ask(side.port, model, tokens))
        await asyncio.sleep(0.5)
        assert not asked.done() and side.prefilled == []
        side.expect()
        announced = time.monotonic()
        header, _ = await asked
        assert time.monotonic() - announced < 2.5  # served on the announcement, not at the grace's end
    assert side.prefilled == [TASK] and header.cached_tokens == len(tokens) - 1


REFUSALS: dict[str, tuple[dict[str, Any], dict[str, Any], str]] = {
    # case: (server options, ask options, the server's reason)
    "an unexpected task": ({}, {"task_id": TaskId("task-2")},
                           "task task-2 is not expected here (never announced, or past its deadline)"),
    "an ask signed by another key": ({}, {"signer": new_signer("decode-node")},
                                     "the ask's signature is not node decode-node's"),
    "an ask from another node": ({}, {"signer": new_signer("intruder")},
                                 "task task-1 is expected from node decode-node, not intruder"),
    "another model": ({}, {"model_id": ModelId("other/model")},
                      "this server prefills model 'local/tiny', not 'other/model'"),
    "too many tokens": ({"max_tokens": 8}, {}, "a prompt of 10 tokens; this server prefills 1 to 8"),
    "no tokens": ({}, {"tokens": []}, "a prompt of 0 tokens; this server prefills 1 to 4096"),
    "a token outside the vocabulary": ({}, {"tokens": [5, 10**6]},
                                       "token id 1000000 is outside this model's vocabulary (363)"),
}


@pytest.mark.parametrize("case", REFUSALS)
async def test_an_ask_the_server_may_not_serve_is_refused_with_its_reason(tiny, case):
    model, tokenizer = tiny
    server_options, ask_options, reason = REFUSALS[case]
    ask_options = dict(ask_options)
    tokens = ask_options.pop("tokens", prompt_of(tokenizer, 10))
    async with serving(model, **server_options) as side:
        side.expect()
        assert await refusal(side.port, model, tokens, **ask_options) == f"the prefill server refused: {reason}"
        assert side.prefilled == []
        await ask(side.port, model, [5, 6, 7])  # the refused ask did not use the expectation up
    assert side.prefilled == [TASK]


async def test_each_expected_task_is_served_once(tiny):
    model, tokenizer = tiny
    async with serving(model) as side:
        side.expect()
        await ask(side.port, model, prompt_of(tokenizer, 10))
        assert await refusal(side.port, model, prompt_of(tokenizer, 10)) == \
            "the prefill server refused: task task-1 was served already"
    assert side.prefilled == [TASK]


async def test_an_expectation_past_its_deadline_is_forgotten(tiny):
    model, _ = tiny
    now = [0.0]
    async with serving(model, clock=lambda: now[0]) as side:
        side.expect(TaskId("early"), deadline=10)
        side.expect(TaskId("late"), deadline=10)
        now[0] = 9
        await ask(side.port, model, [5, 6, 7], task_id=TaskId("early"))
        now[0] = 11
        assert await refusal(side.port, model, [5, 6, 7], task_id=TaskId("late")) == \
            "the prefill server refused: task late is not expected here (never announced, or past its deadline)"
    assert side.prefilled == [TaskId("early")]


class TamperingProxy:
    """Between one asker and the server: relays the greeting, the ask through `change_ask` (its
    msgpack), then the server's whole answer through `change_answer`."""

    def __init__(self, server_port: int, *, change_ask: Callable[[bytes], bytes] = lambda b: b,
                 change_answer: Callable[[bytes], bytes] = lambda b: b) -> None:
        self._server_port, self._change_ask, self._change_answer = server_port, change_ask, change_answer

    @asynccontextmanager
    async def running(self) -> AsyncIterator[int]:
        proxy = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        async with proxy:
            yield proxy.sockets[0].getsockname()[1]

    async def _relay(self, asker_reader: asyncio.StreamReader, asker_writer: asyncio.StreamWriter) -> None:
        server_reader, server_writer = await asyncio.open_connection("127.0.0.1", self._server_port)
        asker_writer.write(await server_reader.readexactly(4 + NONCE_BYTES))
        head = await asker_reader.readexactly(8)
        body = self._change_ask(await asker_reader.readexactly(int.from_bytes(head[4:], "big")))
        server_writer.write(head[:4] + len(body).to_bytes(4, "big") + body)
        asker_writer.write(self._change_answer(await server_reader.read()))  # the server closes after its trailer
        await asker_writer.drain()
        asker_writer.close()
        server_writer.close()


async def test_an_ask_changed_on_the_way_is_refused(tiny):
    model, tokenizer = tiny
    tokens = prompt_of(tokenizer, 10)

    def other_last_token(body: bytes) -> bytes:
        signed = msgspec.msgpack.decode(body, type=PrefillAsk)
        return msgspec.msgpack.encode(msgspec.structs.replace(signed, tokens=[*tokens[:-1], tokens[-1] + 1]))

    async with serving(model) as side, TamperingProxy(side.port, change_ask=other_last_token).running() as port:
        side.expect()
        assert await refusal(port, model, tokens) == "the prefill server refused: the ask's signature is not node decode-node's"
    assert side.prefilled == []


def flip_a_byte_of_the_last_array(answer: bytes) -> bytes:
    # The answer ends with the end marker (4 bytes) and the signature (4 + 88); the last array is 1,152 bytes.
    at = len(answer) - 200
    return answer[:at] + bytes([answer[at] ^ 1]) + answer[at + 1:]


async def test_the_asker_refuses_a_cache_changed_on_the_way(tiny):
    model, tokenizer = tiny
    tokens = prompt_of(tokenizer, 10)
    async with serving(model) as side:
        side.expect()
        async with TamperingProxy(side.port).running() as port:
            await ask(port, model, tokens)  # the proxy itself changes nothing
        side.expect()
        async with TamperingProxy(side.port, change_answer=flip_a_byte_of_the_last_array).running() as port:
            refused = await refusal(port, model, tokens)
    assert refused.startswith("the cache's signature is not the prefill server's"), refused
    assert side.prefilled == [TASK, TASK]


async def test_the_asker_refuses_a_cache_signed_by_another_key(tiny):
    model, tokenizer = tiny
    async with serving(model, signer=new_signer("prefill-node")) as side:
        side.expect()
        refused = await refusal(side.port, model, prompt_of(tokenizer, 10))
    assert refused.startswith("the cache's signature is not the prefill server's"), refused


async def silent_peer(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection that takes the server's greeting (so holds one of its connections) and says nothing."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    assert (await reader.readexactly(4 + NONCE_BYTES))[:4] == b"EXPF"
    return reader, writer


async def test_a_silent_peer_is_timed_out_and_does_not_block_an_asker(tiny):
    model, tokenizer = tiny
    tokens = prompt_of(tokenizer, 10)
    # 2 s: what follows the first silent peer's greeting must happen while it is still open, on a loaded machine too
    async with serving(model, read_timeout_s=2, max_connections=2) as side:
        first_reader, first_writer = await silent_peer(side.port)
        side.expect()
        await ask(side.port, model, tokens)  # served while the silent peer holds the other connection
        second_reader, second_writer = await silent_peer(side.port)
        side.expect()
        assert await refusal(side.port, model, tokens) == "the prefill server refused: busy: 2 prefill connections open"
        for reader in (first_reader, second_reader):
            answer = await asyncio.wait_for(reader.read(), 5)
            assert answer[:4] == b"EXNO" and answer[8:] == b"no complete ask within 2 s", answer
        await ask(side.port, model, tokens)  # both silent peers were closed
        first_writer.close()
        second_writer.close()
    assert side.prefilled == [TASK, TASK]


async def test_the_asker_gives_up_on_a_server_that_does_not_answer():
    async def say_nothing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()

    mute = await asyncio.start_server(say_nothing, "127.0.0.1", 0)
    async with mute:
        port = mute.sockets[0].getsockname()[1]
        limits = TransferLimits(model_id=MODEL, layers=(), max_bytes=0, max_tokens=0)
        started = time.monotonic()
        with pytest.raises(PrefillRefused, match=r"^no complete answer from the prefill server .* within 0.3 s$"):
            await ask_prefill("127.0.0.1", port, task_id=TASK, model_id=MODEL, tokens=[5], signer=ASKER_KEY,
                              server_public_key=SERVER_KEY.public_key, limits=limits, timeout_s=0.3)
    assert time.monotonic() - started < 2


NOT_ASKS = {
    b"GET / HTTP/1.1\r\n\r\n": b"not a prefill ask (it starts with b'GET ')",
    b"EXPA" + (1 << 31).to_bytes(4, "big"): b"the ask is 2147483648 bytes, more than the 8388608 allowed",
    b"EXPA" + (3).to_bytes(4, "big") + b"abc": b"not a prefill ask: Expected `object`, got `int`",
}


@pytest.mark.parametrize("sent", NOT_ASKS)
async def test_a_stream_that_is_not_an_ask_is_refused_before_it_is_read_further(tiny, sent):
    """The server's answer comes although the peer keeps its connection open."""
    model, _ = tiny
    async with serving(model) as side:
        reader, writer = await asyncio.open_connection("127.0.0.1", side.port)
        await reader.readexactly(4 + NONCE_BYTES)
        writer.write(sent)
        answer = await asyncio.wait_for(reader.read(), 5)
        writer.close()
    assert answer[:4] == b"EXNO" and answer[8:] == NOT_ASKS[sent]
    assert side.prefilled == []


LIES: dict[str, tuple[Callable[[TaskId, list[int]], Any], str]] = {
    "another task's cache": (lambda task_id, tokens: (TaskId("task-9"), tokens),
                             "the cache is of task task-9 of model 'local/tiny'; task task-1 of model 'local/tiny' "
                             "was asked for"),
    "a shorter prompt's cache": (lambda task_id, tokens: (task_id, tokens[:-1]),
                                 "the cache holds 8 tokens with [5] pending; the prompt has 10 tokens ending in [6]"),
}


@pytest.mark.parametrize("case", LIES)
async def test_the_asker_refuses_a_signed_cache_of_something_else_than_it_asked(tiny, case):
    model, _ = tiny
    prefills_as, reason = LIES[case]
    async with serving(model, prefills_as=prefills_as) as side:
        side.expect()
        assert await refusal(side.port, model, [9, 9, 9, 9, 9, 9, 9, 9, 5, 6]) == reason


async def test_a_failed_prefill_is_refused_with_its_error_in_printable_text(tiny):
    model, _ = tiny

    def out_of_memory(task_id: TaskId, tokens: list[int]) -> Any:
        raise RuntimeError("out of memory\n[fake log line]")

    async with serving(model, prefills_as=out_of_memory) as side:
        side.expect()
        assert await refusal(side.port, model, [5, 6, 7]) == \
            "the prefill server refused: the prefill of task task-1 failed: out of memory?[fake log line]"


async def test_an_ask_signed_for_another_connection_is_refused(tiny):
    """The signature covers the server's nonce: an ask seen once cannot be replayed."""
    model, _ = tiny
    async with serving(model) as side:
        side.expect()
        first_reader, first_writer = await asyncio.open_connection("127.0.0.1", side.port)
        nonce = (await first_reader.readexactly(4 + NONCE_BYTES))[4:]
        signed = sign_ask(PrefillAsk(task_id=TASK, model_id=MODEL, tokens=[5, 6, 7], asker=ASKER_KEY.node_id,
                                     signature=""), nonce, ASKER_KEY)
        reader, writer = await asyncio.open_connection("127.0.0.1", side.port)
        await reader.readexactly(4 + NONCE_BYTES)
        writer.write(encode_ask(signed))
        answer = await asyncio.wait_for(reader.read(), 5)
        first_writer.close()
        writer.close()
    assert answer[8:] == b"the ask's signature is not node decode-node's" and side.prefilled == []
