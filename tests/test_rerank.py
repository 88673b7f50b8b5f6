"""Rerank: a tiny cross-encoder (a BERT sequence classifier with one label, generated here) gives the
scores of an independent numpy BertForSequenceClassification plus CrossEncoder's activation, alone
and in padded batches, in process and through the cluster (POST /v1/rerank and vLLM's /rerank and
/v2/rerank), sorted best first and cut to top_n; documents as strings or {"text"} objects, answered
alike; bad requests are 400s naming the field; a key that
may not use the model gets a 403; usage and /metrics count its tokens and documents."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import httpx
import msgspec
import numpy as np
import pytest

from exo.api.errors import ApiError
from exo.api.openai.rerank import RerankRequest, ranked, rerank_inputs
from exo.core.embedding_files import EmbeddingFilesError, cross_encoder_spec
from exo.core.requests import EmbedInputs
from exo.core.types import EmbeddingSpec
from tests.support.api_keys import ADMIN, add_key, admin_client
from tests.support.cluster import wait_until
from tests.support.cross_encoder_model import DOCUMENTS, QUERY, make_tiny_cross_encoder
from tests.support.cross_encoder_reference import numpy_cross_encoder_scores, pair_tokens
from tests.support.e2e import exo_serving, place
from tests.support.embedding_models import make_tiny_bert

ATOL = 1e-4  # the bound; float32 against float64 agree to ~1e-7 on the tiny model
CE_ID, BERT_ID = "exo-test/tiny-cross-encoder", "exo-test/tiny-bert-embed"
SIGMOID = "torch.nn.modules.activation.Sigmoid"


def _config(**extra: object) -> str:
    return json.dumps({"architectures": ["BertForSequenceClassification"], "model_type": "bert",
                       "id2label": {"0": "LABEL_0"}} | extra)


def test_a_cross_encoder_is_known_by_its_config_and_its_activation_is_crossencoders_default():
    reranker = EmbeddingSpec(pooling="cls", normalize=False, rerank="sigmoid")
    assert cross_encoder_spec(_config()) == reranker  # no activation named: Sigmoid for one label
    assert cross_encoder_spec(_config(sentence_transformers={"activation_fn": SIGMOID})) == reranker
    identity = "torch.nn.modules.linear.Identity"
    assert cross_encoder_spec(_config(sentence_transformers={"activation_fn": identity})).rerank == "identity"
    assert cross_encoder_spec(_config(sbert_ce_default_activation_function=identity)).rerank == "identity"
    assert cross_encoder_spec(_config(num_labels=1, id2label=None)) == reranker
    for not_one in ({"architectures": ["BertModel"], "model_type": "bert"}, {"architectures": ["Qwen3ForCausalLM"]},
                    {"model_type": "bert"}, [1]):
        assert cross_encoder_spec(json.dumps(not_one)) is None
    for config, why in [(_config(id2label={"0": "no", "1": "yes"}), "with 2 labels is not served"),
                        (_config(model_type="xlm-roberta"), "served for BERT"),
                        (_config(sentence_transformers={"activation_fn": "torch.nn.Tanh"}), "'torch.nn.Tanh' is not served")]:
        with pytest.raises(EmbeddingFilesError, match=why):
            cross_encoder_spec(config)


def _decoded(*documents: object) -> RerankRequest:
    body = {"model": CE_ID, "query": QUERY, "documents": list(documents)}
    return msgspec.json.decode(msgspec.json.encode(body), type=RerankRequest)


def test_documents_are_strings_or_text_objects_and_come_back_as_text_objects_either_way():
    inputs = rerank_inputs(_decoded("Paris", {"text": "Berlin"}, "Rome"))
    assert inputs == EmbedInputs(texts=["Paris", "Berlin", "Rome"], query=QUERY)
    assert ranked([0.5, 0.9, 0.1], inputs.texts, 2, True) == [
        {"index": 1, "relevance_score": 0.9, "document": {"text": "Berlin"}},
        {"index": 0, "relevance_score": 0.5, "document": {"text": "Paris"}}]
    assert ranked([0.5, 0.9, 0.1], inputs.texts, None, False) == [
        {"index": 1, "relevance_score": 0.9}, {"index": 0, "relevance_score": 0.5}, {"index": 2, "relevance_score": 0.1}]


@pytest.mark.parametrize(("document", "message"), [
    ({"text": "Berlin", "title": "Germany"}, "Object contains unknown field `title` - at `$.documents[1]`"),
    ({"content": "Berlin"}, "Object contains unknown field `content` - at `$.documents[1]`"),
    ({}, "Object missing required field `text` - at `$.documents[1]`"),
    ({"text": 3}, "Expected `str`, got `int` - at `$.documents[1].text`"),
    (3, "Expected `str | object`, got `int` - at `$.documents[1]`"),
    (["Berlin"], "Expected `str | object`, got `array` - at `$.documents[1]`"),
])
def test_a_document_of_another_shape_is_refused_naming_it(document, message):
    """decode_body answers these as 400s whose param is the path after `$.` (documents[1])."""
    with pytest.raises(msgspec.ValidationError) as refused:
        _decoded("Paris", document)
    assert str(refused.value) == message


def test_an_empty_text_object_is_refused_as_an_empty_string_is():
    for empty in ("", {"text": ""}):
        with pytest.raises(ApiError) as refused:
            rerank_inputs(_decoded("Paris", empty))
        assert (refused.value.status, refused.value.param) == (400, "documents")
        assert refused.value.message == 'documents[1] must be a non-empty string (or {"text": a non-empty string})'


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rerank-models")
    return {"sentence_transformers": make_tiny_cross_encoder(root / "ce"),
            "legacy": make_tiny_cross_encoder(root / "ce-legacy", activation_key="sbert_ce_default_activation_function",
                                              activation="torch.nn.modules.linear.Identity"),
            "unnamed": make_tiny_cross_encoder(root / "ce-unnamed", activation_key=None, seed=2),
            "bert": make_tiny_bert(root / "bert", "mean")}


def _engine(path: Path):
    from exo.runner.embedding_engine import EmbeddingEngine

    engine = EmbeddingEngine()
    engine.load(str(path))
    return engine


def _scores(engine, documents: list[str], query: str = QUERY) -> np.ndarray:
    vectors = engine.embed(EmbedInputs(texts=documents, query=query)).vectors
    return np.array([np.frombuffer(base64.b64decode(v), dtype="<f4")[0] for v in vectors])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sentence_transformers", "legacy", "unnamed"])
def test_scores_equal_an_independent_cross_encoder_alone_and_in_a_padded_batch(models, kind):
    engine = _engine(models[kind])
    reference = numpy_cross_encoder_scores(models[kind], QUERY, DOCUMENTS)
    np.testing.assert_allclose(_scores(engine, DOCUMENTS), reference, atol=ATOL)
    np.testing.assert_allclose([_scores(engine, [d])[0] for d in DOCUMENTS], reference, atol=ATOL)
    assert engine.embed(EmbedInputs(texts=DOCUMENTS, query=QUERY)).prompt_tokens == pair_tokens(models[kind], QUERY, DOCUMENTS)
    if kind == "legacy":  # Identity: the logits themselves, beyond a sigmoid's (0, 1)
        assert reference.max() > 1
    else:
        assert np.all((reference > 0) & (reference < 1))


@pytest.mark.slow
def test_a_reranker_refuses_what_does_not_fit_and_what_is_not_a_rerank(models):
    from exo.runner.decoding import PromptTooLong, RequestRefused

    engine = _engine(models["sentence_transformers"])
    with pytest.raises(PromptTooLong, match=r"^documents\[1\] with the query is 110 tokens, over the model's context of 64$"):
        engine.embed(EmbedInputs(texts=["mlx", "mlx " * 100], query=QUERY))
    with pytest.raises(PromptTooLong, match=r"^the query is 64 tokens with its special tokens: .* context of 64$"):
        engine.embed(EmbedInputs(texts=["mlx"], query="mlx " * 62))
    with pytest.raises(RequestRefused, match="this model is a reranker: use POST /v1/rerank"):
        engine.embed(EmbedInputs(texts=["mlx"]))
    with pytest.raises(RequestRefused, match="does not rerank"):
        _engine(models["bert"]).embed(EmbedInputs(texts=["mlx"], query=QUERY))


@pytest.fixture(scope="module")
def node(tmp_path_factory, models):
    served = {CE_ID: models["sentence_transformers"], BERT_ID: models["bert"]}
    with exo_serving(tmp_path_factory.mktemp("node"), served, {"EXO_API_KEYS": ADMIN}) as exo:
        yield exo


@pytest.fixture(scope="module")
def admin(node):
    with admin_client(node.url) as client:
        for model_id in (CE_ID, BERT_ID):
            place(client, model_id)
        yield client


def _rerank(client: httpx.Client, path: str = "/v1/rerank", **fields: object) -> httpx.Response:
    return client.post(path, json={"model": CE_ID, "query": QUERY, "documents": DOCUMENTS} | fields)


@pytest.mark.slow
@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank", "/v2/rerank"])
def test_the_route_answers_the_reference_scores_best_first(admin, models, path):
    reference = numpy_cross_encoder_scores(models["sentence_transformers"], QUERY, DOCUMENTS)
    best_first = sorted(range(len(DOCUMENTS)), key=lambda n: -reference[n])
    assert min(np.diff(sorted(reference))) > 10 * ATOL  # the order is the reference's, not float noise
    answer = _rerank(admin, path)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert [r["index"] for r in body["results"]] == best_first
    np.testing.assert_allclose([r["relevance_score"] for r in body["results"]], reference[best_first], atol=ATOL)
    assert [r["document"] for r in body["results"]] == [{"text": DOCUMENTS[n]} for n in best_first]
    assert body["model"] == CE_ID and re.fullmatch(r"rerank-\S+", body["id"])
    assert body["usage"] == {"total_tokens": pair_tokens(models["sentence_transformers"], QUERY, DOCUMENTS)}


@pytest.mark.slow
def test_top_n_and_return_documents_cut_the_answer(admin, models):
    reference = numpy_cross_encoder_scores(models["sentence_transformers"], QUERY, DOCUMENTS)
    best_first = sorted(range(len(DOCUMENTS)), key=lambda n: -reference[n])
    cut = _rerank(admin, top_n=2, return_documents=False).json()["results"]
    assert [sorted(r) for r in cut] == [["index", "relevance_score"]] * 2
    assert [r["index"] for r in cut] == best_first[:2]
    assert len(_rerank(admin, top_n=100).json()["results"]) == len(DOCUMENTS)
    one = _rerank(admin, documents=[DOCUMENTS[3]]).json()["results"]
    assert one[0]["index"] == 0 and abs(one[0]["relevance_score"] - reference[3]) < ATOL
    as_objects = _rerank(admin, documents=[{"text": d} for d in DOCUMENTS]).json()["results"]
    assert as_objects == _rerank(admin).json()["results"]  # Jina's and Cohere's objects: the same answer


@pytest.mark.slow
@pytest.mark.parametrize(("fields", "param", "message"), [
    ({"query": ""}, "query", "query must be a non-empty string"),
    ({"documents": []}, "documents", "documents must be a non-empty list of strings"),
    ({"documents": ["mlx"] * 1001}, "documents", "documents has 1001 documents; at most 1000 in one request"),
    ({"documents": ["mlx", ""]}, "documents", "documents[1] must be a non-empty string"),
    ({"documents": ["mlx", {"text": "mlx", "title": "t"}]}, "documents[1]", "unknown field `title` - at `$.documents[1]`"),
    ({"documents": ["word " * 1_000_000]}, "documents", "at most 1200000 in one request"),
    ({"top_n": 0}, "top_n", "top_n must be at least 1, got 0"),
    ({"documents": ["mlx", "mlx " * 100]}, "documents", "documents[1] with the query is 110 tokens, over the model's context"),
    ({"query": "mlx " * 62}, "query", "the query is 64 tokens with its special tokens"),
    ({"model": BERT_ID}, "model", "does not rerank"),
])
def test_bad_reranks_are_400s_naming_the_field(admin, fields, param, message):
    answer = _rerank(admin, **fields)
    assert answer.status_code == 400, answer.text[:500]
    error = answer.json()["error"]
    assert error["param"] == param and message in error["message"], error


@pytest.mark.slow
def test_a_reranker_neither_embeds_nor_chats(admin):
    embedded = admin.post("/v1/embeddings", json={"model": CE_ID, "input": "mlx"})
    assert embedded.status_code == 400 and "is a reranker (a cross-encoder) and does not embed" in embedded.text
    chat = admin.post("/v1/chat/completions", json={"model": CE_ID, "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 400 and "does not generate text: use POST /v1/rerank" in chat.text
    placed = admin.post("/place_instance", json={"model_id": CE_ID, "min_nodes": 2})
    assert placed.status_code == 409 and "an embedding model runs on one node" in placed.text
    assert admin.get(f"/v1/models/{CE_ID}").json()["card"]["embedding"] == {"pooling": "cls", "normalize": False,
                                                                             "rerank": "sigmoid"}


def _counter(admin: httpx.Client, name: str, labels: str = "") -> float:
    found = re.search(rf"^{name}{re.escape(labels)} (\S+)$", admin.get("/metrics").text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


@pytest.mark.slow
def test_a_keys_rerank_is_scoped_and_counted_in_usage_and_metrics(admin, node, models):
    _, other = add_key(admin, name="embeds-only", models=[BERT_ID])
    refused = _rerank(httpx.Client(base_url=node.url, headers={"Authorization": f"Bearer {other}"}))
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "model_not_allowed", refused.text
    key_id, secret = add_key(admin, name="reranks", models=[CE_ID])
    documents, tokens = _counter(admin, "exo_reranked_documents_total"), _counter(admin, "exo_prompt_tokens_total")
    ok = '{method="POST",route="/v1/rerank",status="200"}'
    requests = _counter(admin, "exo_http_requests_total", ok)
    with httpx.Client(base_url=node.url, headers={"Authorization": f"Bearer {secret}"}, timeout=120) as client:
        assert _rerank(client, top_n=1).status_code == 200
    expected = pair_tokens(models["sentence_transformers"], QUERY, DOCUMENTS)
    assert _counter(admin, "exo_reranked_documents_total") == documents + len(DOCUMENTS)
    assert _counter(admin, "exo_prompt_tokens_total") == tokens + expected
    assert _counter(admin, "exo_http_requests_total", ok) == requests + 1

    def usage() -> list[tuple[str, int, int]]:
        rows = admin.get(f"/usage?key_id={key_id}").json()["data"]
        return [(r["model"], r["requests"], r["prompt_tokens"]) for r in rows]

    wait_until(lambda: usage() == [(CE_ID, 1, expected)], 10, what="the rerank's tokens in the key's usage")
