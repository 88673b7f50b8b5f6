"""Structured outputs: `response_format` (OpenAI chat), `text.format` (Responses) and Ollama's
`format` constrain decoding with llguidance. On 20 random schemas (every kind of value, nested)
the answer validates against its schema (jsonschema) and equals, token for token, mlx-lm's own
generation constrained by llguidance directly (tests/support/llguidance_reference.py: none of
exo's grammar code, so exo is not checked against itself); a schema that leaves one choice gives
exactly it; batched requests keep their own constraints; what cannot be enforced is a 400 naming it."""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import mlx_lm
import ollama
import pytest

from tests.support.e2e import Reference, one_model_node, place
from tests.support.llguidance_reference import Constrained, json_grammar
from tests.support.tiny_model import TINY_MODEL_ID, make_tiny_model

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Describe the sea as JSON."}]
LIMIT = 200  # every generated schema's language is finite and shorter than this


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """Objects, arrays, enums, bounded strings and integers, booleans, nested: a finite language."""
    kinds = ["string", "integer", "boolean", "enum", "array"] + (["object"] * 2 if depth < 2 else [])
    kind = rng.choice(kinds) if depth else "object"
    if kind == "object":
        names = rng.sample(["name", "size", "deep", "calm", "tags", "id", "waves"], rng.randint(1, 3))
        return {"type": "object", "properties": {n: random_schema(rng, depth + 1) for n in names},
                "required": names, "additionalProperties": False}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(0, 6)}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if kind == "enum":
        return {"enum": rng.sample(["blue", "grey", "green", "calm", "rough", 7, True], rng.randint(1, 4))}
    if kind == "array":
        item = rng.choice([{"type": "boolean"}, {"enum": ["a", "b"]}, {"type": "integer", "minimum": 0, "maximum": 9}])
        return {"type": "array", "items": item, "minItems": 0, "maxItems": rng.randint(1, 3)}
    return {"type": "boolean"}


def kinds_of(schema: dict, depth: int = 0) -> set[str]:
    if schema.get("type") == "object":
        return {f"object at depth {depth}"}.union(*(kinds_of(s, depth + 1) for s in schema["properties"].values()))
    if schema.get("type") == "array":
        return {"array", f"array of {schema['items'].get('type', 'enum')}"}
    return {"enum" if "enum" in schema else schema["type"]}


# 20 schemas hold every kind 3 to 20 times: 50 took twice as long and added no kind.
SCHEMAS = [random_schema(random.Random(n)) for n in range(20)]


model_dir, node = one_model_node(TINY_MODEL_ID, make_tiny_model)


@pytest.fixture(scope="module")
def ref(http, model_dir) -> Reference:
    place(http, TINY_MODEL_ID)
    return Reference(model_dir)


def constrained(ref: Reference, schema: dict | None) -> str:
    """mlx-lm's greedy output constrained by llguidance itself to the schema (None: any object)."""
    return mlx_lm.generate(ref.model, ref.tokenizer, ref.chat_prompt(MESSAGES), max_tokens=LIMIT,
                           logits_processors=[Constrained(ref.tokenizer, json_grammar(schema))])


def chat(http, response_format: dict, messages=MESSAGES) -> dict:
    reply = http.post("/v1/chat/completions", json={"model": TINY_MODEL_ID, "messages": messages, "max_tokens": LIMIT,
                                                     "temperature": 0, "response_format": response_format})
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]


def as_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def test_random_schemas_validate_and_equal_mlx_lm_constrained_by_llguidance(http, ref):
    assert set().union(*map(kinds_of, SCHEMAS)) == {
        "object at depth 0", "object at depth 1", "string", "integer", "boolean", "enum", "array",
        "array of boolean", "array of integer", "array of enum"}
    unconstrained = ref.chat(MESSAGES, 20)
    with pytest.raises(ValueError):
        json.loads(unconstrained)  # the model alone writes no JSON: the constraint does the work
    texts = set()
    for schema in SCHEMAS:
        choice = chat(http, as_format(schema))
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)
        assert choice["finish_reason"] == "stop"
        assert choice["message"]["content"] == constrained(ref, schema), schema
        texts.add(choice["message"]["content"])
    assert len(texts) > 15  # the schemas really differ, and so do their answers


def test_logprobs_of_a_constrained_answer_are_finite_with_openais_floor_for_masked_tokens(http, ref):
    # A token the grammar masks has logprob -inf, which JSON cannot carry: OpenAI sends -9999.0.
    body = {"model": TINY_MODEL_ID, "messages": MESSAGES, "max_tokens": LIMIT, "temperature": 0,
            "response_format": as_format(SCHEMAS[0]), "logprobs": True, "top_logprobs": 5}
    reply = http.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["message"]["content"] == chat(http, as_format(SCHEMAS[0]))["message"]["content"]
    entries = choice["logprobs"]["content"]
    assert "".join(e["token"] for e in entries) == choice["message"]["content"] + "<|im_end|>"  # its EOS too
    assert all(-9999.0 < e["logprob"] <= 0.0 and len(e["top_logprobs"]) == 5 for e in entries)
    alternatives = [t["logprob"] for e in entries for t in e["top_logprobs"]]
    assert all(-9999.0 <= v <= 0.0 for v in alternatives) and -9999.0 in alternatives


def test_a_schema_that_leaves_one_choice_gives_exactly_it(http, ref):
    schema = {"type": "object", "properties": {"answer": {"const": "yes"}, "n": {"enum": [3]}},
              "required": ["answer", "n"], "additionalProperties": False}
    content = chat(http, as_format(schema))["message"]["content"]
    jsonschema.validate(json.loads(content), schema)
    assert content == '{"answer":"yes","n":3}' == constrained(ref, schema)


def test_json_object_is_one_json_object(http, ref):
    choice = chat(http, {"type": "json_object"})
    content = choice["message"]["content"]
    assert content == constrained(ref, None)
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(content), dict)
    else:  # the tiny model may write one string until max_tokens: still the start of an object
        assert content.startswith("{") and choice["finish_reason"] == "length"


def test_batched_requests_keep_their_own_constraints(http, ref):
    schemas = SCHEMAS[:6]
    alone = [constrained(ref, s) for s in schemas]
    with ThreadPoolExecutor(len(schemas)) as pool:
        together = list(pool.map(lambda s: chat(http, as_format(s))["message"]["content"], schemas))
    for text, schema in zip(together, schemas):
        jsonschema.validate(json.loads(text), schema)
    assert together == alone


def test_responses_text_format_and_ollama_format(node, client, ref):
    schema = SCHEMAS[3]
    expected = constrained(ref, schema)
    response = client.responses.create(model=TINY_MODEL_ID, input=MESSAGES[0]["content"], max_output_tokens=LIMIT,
                                       temperature=0, text={"format": {"type": "json_schema", "name": "answer",
                                                                       "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.output_text == expected
    reply = ollama.Client(host=node.url, timeout=120).chat(model=TINY_MODEL_ID, messages=MESSAGES, format=schema,
                                                           options={"temperature": 0, "num_predict": LIMIT})
    jsonschema.validate(json.loads(reply.message.content or ""), schema)
    assert reply.message.content == expected


@pytest.mark.parametrize(("path", "body", "says"), [
    ("/v1/chat/completions", {"response_format": as_format({"type": "object", "if": {}})}, '"if"'),
    ("/v1/chat/completions", {"response_format": as_format({"type": "string", "format": "hostname-ish"})}, "hostname-ish"),
    ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format.type"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ("/v1/chat/completions", {"response_format": as_format({"type": "object", "properties": {"x": {"$ref": "#/nowhere"}}})},
     "nowhere"),
    ("/v1/responses", {"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": "no"}}},
     "text.format.schema"),
    ("/api/chat", {"format": "yaml", "stream": False}, "format"),
])
def test_formats_that_cannot_be_enforced_are_400(http, ref, path, body, says):
    base = {"model": TINY_MODEL_ID, "messages": MESSAGES} if path != "/v1/responses" else {"model": TINY_MODEL_ID}
    response = http.post(path, json=base | body)
    assert response.status_code == 400 and says in str(response.json()), response.text
