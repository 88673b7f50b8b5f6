"""Guided decoding beyond JSON schema: vLLM's `guided_regex`, `guided_choice`, `guided_grammar`
(Lark or GBNF) and `structured_outputs`, llama.cpp's `grammar` (GBNF), on chat and completions.
Each greedy answer matches its regex / is one of its choices / is a sentence of its grammar, and
equals, token for token, mlx-lm's own generation constrained by llguidance from the same text
(tests/support/llguidance_reference.py and llguidance.grammar_from: none of exo's grammar code),
alone and batched (through the API, and in one in-process Batcher); what cannot be enforced, is
too big or comes twice is a 400 naming the field."""

from __future__ import annotations

import asyncio
import json
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import llguidance
import mlx_lm
import msgspec
import pytest

from exo.api.structured import openai_constraint
from exo.core.requests import ChatMessage, GenerationParams, ResponseFormat
from exo.core.types import SamplingDefaults
from exo.runner.batch import Batcher
from exo.runner.decoding import Output, RequestRefused
from exo.runner.engine import Engine
from tests.support.e2e import Reference, one_model_node, place
from tests.support.llguidance_reference import Constrained
from tests.support.tiny_model import TINY_MODEL_ID, make_tiny_model

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Describe the sea in a few words."}]
PROMPT = "The sea today"
LIMIT = 60  # every language below is finite and shorter than this


@dataclass(frozen=True)
class Case:
    """A request's constraint field(s), the same constraint as llguidance reads it, and a Python
    regex every sentence of it matches (what the answer is checked against, beside the reference)."""

    name: str
    fields: dict[str, Any]
    grammar: str  # llguidance's, built here from the same text
    language: str


CHOICES = ["calm", "rough sea", 'a "grey" swell', "blue\\green", "\u00e9t\u00e9 \U0001f30a"]
LARK = 'start: "The sea is " adj (", " adj)? "."\nadj: "calm" | "grey" | "deep" | "wide"'
GBNF = 'root ::= "waves: " num ("," num){0,3}\nnum ::= [0-9] [0-9]?'
REGEX = r"[a-z]{2,8}-[0-9]{1,3}( [a-z]{1,6}){0,3}\."
SHORT_REGEX = r"(yes|no|maybe), [0-9]{2}"
CASES = [
    Case("guided_regex", {"guided_regex": REGEX}, llguidance.grammar_from("regex", REGEX), REGEX),
    Case("guided_choice", {"guided_choice": CHOICES}, llguidance.grammar_from("choice", json.dumps(CHOICES)),
         "|".join(map(re.escape, CHOICES))),
    Case("guided_grammar lark", {"guided_grammar": LARK}, llguidance.grammar_from("lark", LARK),
         r"The sea is (calm|grey|deep|wide)(, (calm|grey|deep|wide))?\."),
    Case("guided_grammar gbnf", {"guided_grammar": GBNF}, llguidance.grammar_from("gbnf", GBNF),
         r"waves: [0-9]{1,2}(,[0-9]{1,2}){0,3}"),
    Case("llama.cpp grammar", {"grammar": GBNF}, llguidance.grammar_from("gbnf", GBNF),
         r"waves: [0-9]{1,2}(,[0-9]{1,2}){0,3}"),
    Case("structured_outputs regex", {"structured_outputs": {"regex": SHORT_REGEX}},
         llguidance.grammar_from("regex", SHORT_REGEX), SHORT_REGEX),
    Case("structured_outputs choice", {"structured_outputs": {"choice": CHOICES[:2]}},
         llguidance.grammar_from("choice", json.dumps(CHOICES[:2])), "calm|rough sea"),
]

model_dir, node = one_model_node(TINY_MODEL_ID, make_tiny_model)


@pytest.fixture(scope="module")
def ref(http, model_dir) -> Reference:
    place(http, TINY_MODEL_ID)
    return Reference(model_dir)


def constrained(ref: Reference, grammar: str, prompt: str | None = None) -> str:
    """mlx-lm's greedy output constrained by llguidance itself (the chat prompt unless `prompt`)."""
    return mlx_lm.generate(ref.model, ref.tokenizer, prompt or ref.chat_prompt(MESSAGES), max_tokens=LIMIT,
                           logits_processors=[Constrained(ref.tokenizer, grammar)])


def chat(http, fields: dict[str, Any]) -> dict:
    reply = http.post("/v1/chat/completions", json={"model": TINY_MODEL_ID, "messages": MESSAGES, "max_tokens": LIMIT,
                                                     "temperature": 0} | fields)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]


def test_the_model_alone_writes_none_of_these_languages(ref):
    free = ref.chat(MESSAGES, LIMIT)  # so a matching answer is the constraint's work
    assert not any(re.fullmatch(case.language, free) for case in CASES), free


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_each_constraint_matches_its_language_and_equals_mlx_lm_constrained_by_llguidance(http, ref, case):
    choice = chat(http, case.fields)
    content = choice["message"]["content"]
    assert re.fullmatch(case.language, content), content
    assert choice["finish_reason"] == "stop"
    assert content == constrained(ref, case.grammar)


def test_completions_take_the_same_fields(http, ref):
    for case in CASES[:4]:
        reply = http.post("/v1/completions", json={"model": TINY_MODEL_ID, "prompt": PROMPT, "max_tokens": LIMIT,
                                                    "temperature": 0} | case.fields)
        assert reply.status_code == 200, reply.text
        text = reply.json()["choices"][0]["text"]
        assert re.fullmatch(case.language, text), (case.name, text)
        assert text == constrained(ref, case.grammar, PROMPT), case.name


def test_batched_requests_keep_their_own_constraints(http, ref):
    alone = [constrained(ref, case.grammar) for case in CASES]
    with ThreadPoolExecutor(len(CASES)) as pool:
        together = list(pool.map(lambda case: chat(http, case.fields)["message"]["content"], CASES))
    assert all(re.fullmatch(case.language, text) for case, text in zip(CASES, together)), together
    assert together == alone


@pytest.mark.parametrize(("fields", "param", "says"), [
    ({"guided_regex": "[0-9"}, "guided_regex", "unclosed character class"),
    ({"guided_grammar": 'start: "a" | b'}, "guided_grammar", 'unknown name: "b"'),
    ({"grammar": 'root ::= "a'}, "grammar", "not a GBNF grammar"),
    ({"grammar": 'start: "a"'}, "grammar", "not a GBNF grammar"),  # llama.cpp's field takes GBNF only, as llama.cpp
    ({"structured_outputs": {"grammar": "start: x"}}, "structured_outputs.grammar", 'unknown name: "x"'),
    ({"guided_choice": []}, "guided_choice", "a non-empty list of strings"),
    ({"guided_json": "not json"}, "guided_json", "a JSON schema"),
    ({"json_schema": {"type": "object", "if": {}}}, "json_schema", '"if"'),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag", "not supported"),
    ({"guided_regex": "a" * 4095}, "guided_regex", "at most 4096 bytes"),
    ({"guided_choice": ["x"] * 257}, "guided_choice", "at most 256 choices"),
    ({"guided_choice": ["ok", "x" * 1023]}, "guided_choice[1]", "at most 1024 bytes"),
    ({"guided_choice": [f"{n:03}" + "x" * 250 for n in range(140)]}, "guided_choice", "at most 32768 bytes"),
    ({"guided_grammar": 'start: "a"\n' + "// filler\n" * 3300}, "guided_grammar", "at most 32768 bytes"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "guided_regex and guided_choice cannot be combined"),
    ({"response_format": {"type": "json_object"}, "grammar": 'root ::= "a"'}, "grammar",
     "response_format and grammar cannot be combined"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice",
     "structured_outputs.regex and structured_outputs.choice cannot be combined"),
])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_constraints_that_cannot_be_enforced_are_too_big_or_twice_are_400_naming_the_field(http, ref, path, fields,
                                                                                          param, says):
    base = {"model": TINY_MODEL_ID} | ({"messages": MESSAGES} if path == "/v1/chat/completions" else {"prompt": PROMPT})
    response = http.post(path, json=base | fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error


def test_one_batch_keeps_each_requests_constraint(model_dir, ref):
    """In-process, so every request surely decodes in the same mlx-lm BatchGenerator (exo/runner/batch.py)."""
    engine = Engine()
    engine.load(str(model_dir))
    requests = [GenerationParams(messages=[ChatMessage(**m) for m in MESSAGES], max_tokens=LIMIT, temperature=0,
                                 response_format=openai_constraint(case.fields)) for case in CASES]

    async def in_one_batch() -> list[str]:
        batcher = Batcher(engine, len(requests), ThreadPoolExecutor(max_workers=1))
        outs: list[list[Output]] = [[] for _ in requests]
        await asyncio.gather(*(batcher.run(asyncio.get_running_loop(), params, SamplingDefaults(), outs[i].append,
                                           lambda: False, f"task{i}") for i, params in enumerate(requests)))
        return ["".join(o.text for o in out) for out in outs]

    assert asyncio.run(in_one_batch()) == [constrained(ref, case.grammar) for case in CASES]


@pytest.mark.parametrize("response_format", [ResponseFormat(type="grammar", grammar="root ::= [", syntax="gbnf"),
                                             ResponseFormat(type="regex", pattern="(unclosed"),
                                             ResponseFormat(type="grammar", grammar="start: nope", syntax="lark")])
def test_a_grammar_that_got_past_the_api_is_refused_by_the_runner_and_its_batch_goes_on(model_dir, ref, response_format):
    """A command on NATS need not come from exo's API: the runner refuses a malformed grammar as that
    request's mistake (a 400), and the request beside it in the batch finishes as it would alone."""
    engine = Engine()
    engine.load(str(model_dir))
    good = GenerationParams(messages=[ChatMessage(**m) for m in MESSAGES], max_tokens=LIMIT, temperature=0,
                            response_format=openai_constraint(CASES[0].fields))
    bad = msgspec.structs.replace(good, response_format=response_format)

    async def side_by_side() -> tuple[BaseException | None, str]:
        batcher = Batcher(engine, 2, ThreadPoolExecutor(max_workers=1))
        out: list[Output] = []
        refused, _ = await asyncio.gather(
            batcher.run(asyncio.get_running_loop(), bad, SamplingDefaults(), lambda _: None, lambda: False, "bad"),
            batcher.run(asyncio.get_running_loop(), good, SamplingDefaults(), out.append, lambda: False, "good"),
            return_exceptions=True)
        return refused if isinstance(refused, BaseException) else None, "".join(o.text for o in out)

    refused, text = asyncio.run(side_by_side())
    assert isinstance(refused, RequestRefused), refused
    assert text == constrained(ref, CASES[0].grammar)
