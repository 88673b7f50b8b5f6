"""Request migration, in process: a runner that takes a generation over from one that died
prefills the prompt plus the tokens already streamed (protocol.Resume) and goes on, so that what
the first run sent plus what the second sends is exactly one uninterrupted run's output: the same
text, token ids, counts and finish reason, greedy or seeded, at any cut; with stop strings that
were holding text back, penalties, reasoning, constraints, and on every rank of an instance.

A cut after k Outputs resumes with those Outputs' token ids, which is what the runner streamed:
each chunk carries the ids of the text it carries (ChunkMaker, checked here too)."""

from __future__ import annotations

import asyncio
import io
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import msgspec
import pytest
from mlx_lm.sample_utils import make_sampler

from exo.bus.subjects import token_subject
from exo.bus.token_publisher import chunk_msg_id
from exo.core.requests import ChatMessage, GenerationParams, ResponseFormat, TokenChunk
from exo.core.types import SamplingDefaults
from exo.runner.batch import Batcher
from exo.runner.decoding import GenerationResult, Output, TextStream
from exo.runner.engine import Engine
from exo.runner.process import ChunkMaker, Runner
from exo.runner.prompt_cache import PromptCache
from exo.runner.protocol import Generate, Resume
from exo.settings.services import RunnerSettings
from tests.support.qwen_model import EOS_PROMPT, make_qwen3_model
from tests.support.thinking_model import make_thinking_model
from tests.support.tiny_model import make_tiny_model
from tests.support.tool_model import WEATHER_TOOL, make_tool_model

pytestmark = pytest.mark.slow  # real inference, though in process and in well under a second a run

ASK = "Tell me about the sea."


def chat(text: str = ASK, **params: Any) -> GenerationParams:
    return GenerationParams(messages=[ChatMessage(role="user", content=text)], **{"temperature": 0, **params})


def engine_of(path: Path) -> Engine:
    engine = Engine()
    engine.load(str(path))
    return engine


def without_cache(engine: Engine) -> Engine:
    """The same model with its prompt cache off: a resumed run prefills everything."""
    other = Engine()
    other.model, other.tokenizer = engine.model, engine.tokenizer
    other.prompt_cache = PromptCache(engine.model, 0)
    return other


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Engine:
    return engine_of(make_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="module")
def bpe_engine(tmp_path_factory) -> Engine:
    """The tiny model with a bare ByteLevel decoder, so mlx-lm streams with its BPEStreamingDetokenizer:
    it drops the first token's leading space and holds a space, or a character's first bytes, back."""
    path = make_tiny_model(tmp_path_factory.mktemp("bpe") / "model")
    tokenizer = json.loads((path / "tokenizer.json").read_text())
    tokenizer["decoder"] = tokenizer["decoder"]["decoders"][0]
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    engine = engine_of(path)
    assert type(engine.tokenizer.detokenizer).__name__ == "BPEStreamingDetokenizer"
    return engine


def run(engine: Engine, params: GenerationParams, resume: Resume | None = None) -> tuple[list[Output], GenerationResult]:
    outs: list[Output] = []
    result = engine.generate(params, SamplingDefaults(), outs.append, lambda: False, resume=resume)
    return outs, result


def view(out: Output) -> tuple:
    return out.text, out.reasoning, out.completion_tokens, out.prompt_tokens, out.tokens, out.tool_calls


def ending(result: GenerationResult) -> tuple:
    return result.finish_reason, result.prompt_tokens, result.completion_tokens, result.stop_sequence


def streamed(outs: list[Output]) -> list[int]:
    return [token for out in outs for token in out.tokens]


def resume_after(k: int, outs: list[Output]) -> Resume:
    return Resume(token_ids=streamed(outs[:k]), next_index=k, attempt=1)


def check_resumes(engine: Engine, params: GenerationParams,
                  cuts: list[int] | None = None) -> tuple[list[Output], GenerationResult]:
    """Every cut (None: after every Output) resumes into exactly the rest of the uninterrupted run:
    Outputs, ids and ending. Also after the last Output: the earlier run lost only its end."""
    outs, whole = run(engine, params)
    cuts = list(range(1, len(outs))) if cuts is None else cuts
    assert len(outs) > max(cuts, default=0), "the run is shorter than the cuts"
    for k in [*cuts, len(outs)]:
        rest, result = run(engine, params, resume_after(k, outs))
        assert [view(o) for o in rest] == [view(o) for o in outs[k:]], f"cut after {k} outputs"
        assert "".join(o.text for o in outs[:k] + rest) == "".join(o.text for o in outs)
        assert ending(result) == ending(whole)
    return outs, whole


def test_greedy_resumes_at_any_cut_into_the_uninterrupted_text(engine):
    params = chat(max_tokens=60)
    outs, whole = check_resumes(engine, params, [1, 7, 30, 59])
    assert ending(whole)[::2] == ("length", 60) and len(streamed(outs)) == 60
    prompt = engine.prompt_for(params)
    assert "".join(o.text for o in outs) == mlx_lm.generate(engine.model, engine.tokenizer, prompt, max_tokens=60)
    check_resumes(without_cache(engine), params, [1, 30])  # all of prompt + prior prefilled, none from the cache


def test_a_seeded_sampled_request_resumes_on_its_random_key_chain(engine):
    params = chat(max_tokens=60, temperature=0.8, seed=7)
    outs, _ = check_resumes(engine, params, [1, 7, 30, 59])
    mx.random.seed(7)  # mlx-lm's own seeded generation
    reference = mlx_lm.generate(engine.model, engine.tokenizer, engine.prompt_for(params), max_tokens=60,
                                sampler=make_sampler(temp=0.8))
    assert "".join(o.text for o in outs) == reference
    check_resumes(engine, chat(max_tokens=40, temperature=1.3, top_p=0.9, top_k=20, seed=2**64 - 1), [3, 20])


def test_penalties_and_logprobs_see_the_earlier_tokens_as_their_prefix(engine):
    params = chat(max_tokens=50, presence_penalty=1.5, frequency_penalty=0.5)
    outs, _ = check_resumes(engine, params, [1, 9, 33])
    assert "".join(o.text for o in outs) != "".join(o.text for o in run(engine, chat(max_tokens=50))[0])
    check_resumes(without_cache(engine), params, [9])
    params = chat(max_tokens=20, logprobs=True, top_logprobs=2)
    outs, _ = run(engine, params)
    rest, _ = run(engine, params, resume_after(5, outs))
    assert [o.logprobs[0].token for o in rest] == [o.logprobs[0].token for o in outs[5:]]
    for mine, theirs in zip(rest, outs[5:]):
        assert mine.logprobs[0].logprob == pytest.approx(theirs.logprobs[0].logprob, abs=1e-3)


def test_a_stop_string_cut_while_its_matcher_holds_text_back(engine):
    text = "".join(o.text for o in run(engine, chat(max_tokens=60))[0])
    late = next(text[i:i + 4] for i in range(36, 56) if text.find(text[i:i + 4]) == i)
    params = chat(max_tokens=60, stop=[late, "k~~", "n~~", "w~~"])  # a "k", "n" or "w" is held until what follows
    outs, whole = run(engine, params)
    assert ending(whole)[0] == "stop" and ending(whole)[3] == late
    decode = engine.tokenizer.decode
    holding = [k for k in range(1, len(outs)) if decode(streamed(outs[:k])) != "".join(o.text for o in outs[:k])]
    assert len(holding) >= 2, "no cut where the stop matcher holds text"
    check_resumes(engine, params, holding + [len(outs) - 1])
    # The earlier run had sent the output that met the stop string, not its end: nothing more to say.
    rest, result = run(engine, params, resume_after(len(outs), outs))
    assert "".join(o.text for o in rest) == "" and ending(result) == ending(whole)
    # max_tokens ends it while the matcher holds text: that goes out in the last token's Output.
    plain, _ = run(engine, chat(max_tokens=60))
    last = next(i for i, o in enumerate(plain) if len(o.text) > 1 and o.text[-1].isalpha() and i > 5)
    params = chat(max_tokens=last + 1, stop=[plain[last].text[-1] + "~~"])
    outs, whole = check_resumes(engine, params)
    assert ending(whole)[0] == "length" and outs[-1].text == plain[last].text


def test_resumed_text_keeps_the_leading_space_the_streaming_detokenizer_would_drop(bpe_engine):
    params = chat(max_tokens=60)
    outs, _ = run(bpe_engine, params)
    spaced = [k for k in range(1, len(outs)) if outs[k].text.startswith(" ")]
    assert spaced, "no output starts with a space"
    check_resumes(bpe_engine, params, spaced[:4] + [1])
    check_resumes(bpe_engine, chat(max_tokens=60, temperature=0.8, seed=7), [1, 7, 30])


def test_a_character_split_across_tokens_comes_out_whole_after_a_cut(bpe_engine):
    tokenizer = bpe_engine.tokenizer
    tokens = tokenizer.encode(" naïve café ☕ au lait", add_special_tokens=False)
    whole = TextStream(tokenizer)
    pieces = [whole.add(t) for t in tokens] + [whole.finish()]
    assert "".join(pieces) == "naïve café ☕ au lait"  # the first token's space dropped, as mlx-lm streams
    split = [j for j in range(1, len(tokens)) if "".join(pieces[:j]) != tokenizer.decode(tokens[:j]).lstrip()]
    assert split, "no cut inside a character"
    for j in range(1, len(tokens)):
        stream = TextStream(tokenizer)
        for token in tokens[:j]:  # the earlier run's
            stream.add(token)
        assert "".join([stream.add(t) for t in tokens[j:]] + [stream.finish()]) == "".join(pieces[j:])
    fresh = TextStream(tokenizer)  # what a detokenizer that starts at the cut makes of the rest
    assert "".join([fresh.add(t) for t in tokens[split[0]:]] + [fresh.finish()]) != "".join(pieces[split[0]:])


def test_reasoning_resumes_in_its_block(tmp_path):
    thinking = engine_of(make_thinking_model(tmp_path / "model"))
    outs, _ = check_resumes(thinking, chat(max_tokens=30), [1, 2, 10])
    assert outs[0].reasoning and outs[-1].text


def test_a_tool_call_resumes(tmp_path):
    tools = engine_of(make_tool_model(tmp_path / "model"))
    params = chat("What is the weather in Paris?", max_tokens=32, tools=[WEATHER_TOOL])
    outs, whole = check_resumes(tools, params)
    assert outs[-1].tool_calls and ending(whole)[0] == "stop"


def test_an_eos_ends_a_resumed_run_whether_it_was_streamed_or_not(tmp_path):
    qwen = engine_of(make_qwen3_model(tmp_path / "model"))
    messages = [ChatMessage(**m) for m in EOS_PROMPT]
    eos = qwen.tokenizer.eos_token_id
    # An EOS step that sends nothing: its id is not streamed, and a resumed run samples it again.
    outs, whole = check_resumes(qwen, GenerationParams(messages=messages, max_tokens=40, temperature=0), [1, 2])
    assert ending(whole)[0] == "stop" and eos not in streamed(outs)
    # A stop string held the last text back: it goes out at the EOS, with its id (then a resumed run sends nothing).
    params = GenerationParams(messages=messages, max_tokens=40, temperature=0, stop=[">~~"])
    outs, whole = check_resumes(qwen, params, [1])
    assert ending(whole)[0] == "stop" and streamed(outs)[-1] == eos and outs[-1].text


def test_a_constrained_request_resumes_with_its_grammar_where_it_was(engine):
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "tags"], "properties": {
        "name": {"type": "string", "minLength": 30, "maxLength": 40},
        "tags": {"type": "array", "items": {"enum": ["calm", "rough"]}, "minItems": 3, "maxItems": 5}}}
    params = chat(max_tokens=80, response_format=ResponseFormat(type="json_schema", json_schema=schema))
    outs, whole = check_resumes(engine, params, [1, 4, 12, 35, 50])
    answer = json.loads("".join(o.text for o in outs))
    assert len(answer["tags"]) >= 3 and ending(whole)[0] == "stop"  # the grammar's own end: EOS


def test_every_rank_prefills_what_rank_0_announces(engine):
    class Recorder:  # rank 0's side of the lockstep, without a group
        leads = True

        def __init__(self) -> None:
            self.told: list = []

        def announce(self, message) -> None:
            self.told.append(message)

        def start(self, sampler, is_cancelled):
            return sampler, is_cancelled

    params = chat(max_tokens=40, temperature=0.8, seed=7)
    outs, whole = run(engine, params)
    leader, follower = without_cache(engine), without_cache(engine)
    leader.lockstep = Recorder()  # type: ignore[assignment]
    rest, result = run(leader, params, resume_after(12, outs))
    (told,) = leader.lockstep.told  # type: ignore[union-attr]
    assert told.resume_tokens == streamed(outs[:12])
    followed: list[Output] = []
    again = follower.generate(told.params, told.defaults, followed.append, lambda: False, told.task_id, told)
    assert [view(o) for o in followed] == [view(o) for o in rest] == [view(o) for o in outs[12:]]
    assert ending(again) == ending(result) == ending(whole)


def test_the_batch_path_gives_the_same_token_ids(engine):
    params = chat(max_tokens=30, stop=["k~~"])

    async def batched() -> list[Output]:
        outs: list[Output] = []
        batcher = Batcher(engine, 4, ThreadPoolExecutor(max_workers=1))
        await batcher.run(asyncio.get_running_loop(), params, SamplingDefaults(), outs.append, lambda: False, "t")
        return outs

    assert [view(o) for o in asyncio.run(batched())] == [view(o) for o in run(engine, params)[0]]


def test_chunks_carry_the_ids_of_their_text_and_go_on_from_the_resumed_index(engine):
    outs, whole = run(engine, chat(max_tokens=60, stop=["k~~"]))
    chunks = ChunkMaker("task", Resume(token_ids=[1, 2], next_index=7, attempt=2))
    sent: list[TokenChunk] = []
    for n, out in enumerate(outs):  # 8 ms a token: the coalescer holds text for 20 ms
        sent += chunks.add(out, n * 0.008)
    sent += chunks.rest(whole, len(outs) * 0.008)
    assert len(sent) < len(outs) and [c.index for c in sent] == list(range(7, 7 + len(sent)))
    assert {c.attempt for c in sent} == {2} and chunks.index == 7 + len(sent)
    assert [t for c in sent for t in c.token_ids] == streamed(outs)
    taken = 0
    for j in range(1, len(sent) + 1):  # every prefix of the chunks is the text of a prefix of the outputs
        ids = [t for c in sent[:j] for t in c.token_ids]
        while len(streamed(outs[:taken])) < len(ids):
            taken += 1
        assert streamed(outs[:taken]) == ids
        assert "".join(c.text for c in sent[:j]) == "".join(o.text for o in outs[:taken])


def test_content_sent_ahead_of_new_reasoning_keeps_its_own_ids():
    chunks = ChunkMaker("task")
    sent = chunks.add(Output("a", 1, 5, [], [], tokens=[10]), 0.0)
    sent += chunks.add(Output("b", 2, 5, [], [], tokens=[11]), 0.001)  # held
    sent += chunks.add(Output("", 3, 5, [], [], reasoning="r", tokens=[12]), 0.002)  # "b" goes now, alone
    sent += chunks.rest(GenerationResult("length", 5, 3), 0.003)
    assert [(c.text, c.reasoning, c.token_ids, c.index, c.attempt) for c in sent] == [
        ("a", "", [10], 0, 0), ("b", "", [11], 1, 0), ("", "r", [12], 2, 0)]


def test_a_resumed_request_takes_the_single_path_and_its_chunk_ids_name_the_run():
    plain = Generate(task_id="t", params=chat("x"))
    resumed = Generate(task_id="t", params=chat("x"), resume=Resume(token_ids=[5], next_index=1, attempt=1))
    runner = Runner(None, None, RunnerSettings(max_batch=4))
    assert runner._batched(plain) and not runner._batched(resumed)
    chunk = TokenChunk(command_id="cmd", index=3)
    assert chunk_msg_id(chunk) == "cmd:3"  # a first run's ids as they always were
    assert chunk_msg_id(TokenChunk(command_id="cmd", index=3, attempt=1)) == "cmd:a1:3"
    assert chunk_msg_id(TokenChunk(command_id="cmd", index=3, attempt=2, finish_reason="stop")) == "cmd:a2:3:stop"


async def test_a_runner_resumes_from_the_chunks_another_runner_streamed(nc, tmp_path, monkeypatch):
    """The runner end to end, with a real NATS for its chunks: a second runner given the first k
    chunks' ids (as a migration builds its Resume) sends the rest of the first run's text, its
    chunks numbered on from k and marked with the attempt."""
    chunks: list[TokenChunk] = []

    async def on_chunk(msg: Any) -> None:
        chunks.append(msgspec.json.decode(msg.data, type=TokenChunk))

    subscription = await nc.subscribe(token_subject("mig"), cb=on_chunk)
    runner = Runner(nc, io.BytesIO(), RunnerSettings(stream_interval_ms=0.5))  # several chunks, coalesced or not
    runner._engine.load(str(make_tiny_model(tmp_path / "model")))
    publisher = asyncio.create_task(runner._replies.publish())
    loop, params = asyncio.get_running_loop(), chat(max_tokens=40, temperature=0.8, seed=7, stop=["k~~"])
    await runner._generate(loop, Generate(task_id="mig", params=params))
    await nc.flush()
    first, chunks[:] = list(chunks), []
    assert first[-1].finish_reason == "length" and len(first) > 4
    for k in (1, len(first) // 2, len(first) - 1):
        resume = Resume(token_ids=[t for c in first[:k] for t in c.token_ids], next_index=k, attempt=k)
        await runner._generate(loop, Generate(task_id="mig", params=params, resume=resume))
        await nc.flush()
        second, chunks[:] = list(chunks), []
        assert "".join(c.text for c in first[:k] + second) == "".join(c.text for c in first)
        assert [c.index for c in second] == list(range(k, k + len(second))) and {c.attempt for c in second} == {k}
        assert (second[-1].finish_reason, second[-1].token_count) == (first[-1].finish_reason, first[-1].token_count)
    publisher.cancel()
    await subscription.unsubscribe()


def test_token_ids_that_are_not_the_models_are_refused_before_any_work(engine):
    """Resume tokens come back from JetStream, where any holder of exo's credential could have
    written them: an id outside the vocabulary (or negative) is a 400 naming it, not a crash."""
    from exo.runner.decoding import RequestRefused

    vocab = engine.model.args.vocab_size
    for bad in (vocab, -1, 10**12):
        with pytest.raises(RequestRefused, match=f"token id {bad}"):
            run(engine, chat(max_tokens=8), Resume(token_ids=[1, bad], next_index=1, attempt=1))
