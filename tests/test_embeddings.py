"""Embeddings: an encoder (BERT) and a decoder embedder (Qwen3-Embedding's layout), each tiny and
generated here, give the vectors of two independent references, alone and in padded batches, in
process and through the cluster (the `openai` client, Ollama's /api/embed and /api/embeddings);
bad inputs are 400s that name the problem."""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from exo.core.embedding_files import EmbeddingFilesError, embedding_spec, pooling_module_path
from exo.core.requests import EmbedInputs
from exo.core.types import EmbeddingSpec
from tests.support.e2e import exo_serving, place
from tests.support.embedding_models import TEXTS, make_tiny_bert, make_tiny_qwen3_embedding
from tests.support.embedding_reference import mlx_embeddings_reference, numpy_bert_embeddings, numpy_qwen3_embeddings
from tests.support.tiny_model import TINY_MODEL_ID, make_tiny_model

ATOL = 1e-5  # float32 forward passes in another order of operations
BERT_ID, QWEN_ID = "exo-test/tiny-bert-embed", "exo-test/tiny-qwen3-embed"


def test_the_pooling_comes_from_either_format_of_sentence_transformers_files():
    modules = json.dumps([{"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
                          {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                          {"idx": 2, "path": "2_Normalize", "type": "sentence_transformers.base.modules.normalize.Normalize"}])
    assert pooling_module_path(modules) == ("1_Pooling", True)
    assert pooling_module_path(json.dumps([{"path": "", "type": "sentence_transformers.models.Transformer"}])) is None
    legacy = {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}
    assert embedding_spec(json.dumps(legacy), True) == EmbeddingSpec(pooling="cls", normalize=True)
    assert embedding_spec("{}", False) == EmbeddingSpec(pooling="mean", normalize=False)  # no flag: mean
    assert embedding_spec(json.dumps({"pooling_mode": "lasttoken"}), True).pooling == "lasttoken"
    for config, why in [({"pooling_mode_max_tokens": True}, "not served"), ({"pooling_mode": ["mean", "cls"]}, "not served"),
                        ([1], "JSON object")]:
        with pytest.raises(EmbeddingFilesError, match=why):
            embedding_spec(json.dumps(config), True)
    with pytest.raises(EmbeddingFilesError, match="not a folder of the model"):
        pooling_module_path(json.dumps([{"path": "../../etc", "type": "Pooling"}]))


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("embedding-models")
    return {"mean": make_tiny_bert(root / "bert-mean", "mean"),
            "cls": make_tiny_bert(root / "bert-cls", "cls", pooling_format="v6"),
            "qwen3": make_tiny_qwen3_embedding(root / "qwen3")}


def _engine(path: Path):
    from exo.runner.embedding_engine import EmbeddingEngine

    engine = EmbeddingEngine()
    engine.load(str(path))
    return engine


def _vectors(engine, inputs: EmbedInputs) -> np.ndarray:
    return np.stack([np.frombuffer(base64.b64decode(v), dtype="<f4") for v in engine.embed(inputs).vectors])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mean", "cls", "qwen3"])
def test_vectors_equal_an_independent_forward_pass_alone_and_in_a_padded_batch(models, kind):
    engine = _engine(models[kind])
    reference = (numpy_qwen3_embeddings(models[kind], TEXTS) if kind == "qwen3"
                 else numpy_bert_embeddings(models[kind], TEXTS, kind))
    batched = _vectors(engine, EmbedInputs(texts=TEXTS))
    alone = np.stack([_vectors(engine, EmbedInputs(texts=[text]))[0] for text in TEXTS])
    np.testing.assert_allclose(batched, reference, atol=ATOL)
    np.testing.assert_allclose(alone, reference, atol=ATOL)
    assert np.allclose(np.linalg.norm(batched, axis=1), 1, atol=1e-5)


@pytest.mark.slow
def test_a_model_without_a_normalize_module_keeps_its_vectors_lengths(tmp_path):
    path = make_tiny_bert(tmp_path / "bert-unnormalized", "mean", normalize=False)
    vectors = _vectors(_engine(path), EmbedInputs(texts=TEXTS))
    np.testing.assert_allclose(vectors, numpy_bert_embeddings(path, TEXTS, normalize=False), atol=ATOL)
    norms = np.linalg.norm(vectors, axis=1)
    assert np.all(np.abs(norms - 1) > 0.1), norms


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mean", "qwen3"])
def test_vectors_equal_mlx_embeddings_own_pooled_output(models, kind):
    """mlx-embeddings pools BERT by mean and Qwen3 by last token itself: its text_embeds, one text at a time."""
    np.testing.assert_allclose(_vectors(_engine(models[kind]), EmbedInputs(texts=TEXTS)),
                               mlx_embeddings_reference(models[kind], TEXTS), atol=ATOL)


@pytest.mark.slow
def test_token_ids_dimensions_and_refusals(models):
    from exo.runner.decoding import PromptTooLong, RequestRefused

    engine = _engine(models["qwen3"])
    ids = [list(engine.tokenizer(text)["input_ids"]) for text in TEXTS[:2]]
    np.testing.assert_allclose(_vectors(engine, EmbedInputs(token_ids=ids)), _vectors(engine, EmbedInputs(texts=TEXTS[:2])),
                               atol=1e-6)
    full = _vectors(engine, EmbedInputs(texts=TEXTS))
    short = _vectors(engine, EmbedInputs(texts=TEXTS, dimensions=16))
    expected = full[:, :16] / np.linalg.norm(full[:, :16], axis=1, keepdims=True)  # Matryoshka: cut, then normalize
    np.testing.assert_allclose(short, expected, atol=1e-6)
    assert engine.embed(EmbedInputs(texts=TEXTS)).prompt_tokens == sum(len(engine.tokenizer(t)["input_ids"]) for t in TEXTS)
    with pytest.raises(PromptTooLong, match="input 1 is 200 tokens, over the model's context of 128"):
        engine.embed(EmbedInputs(token_ids=[[1], [1] * 200]))
    with pytest.raises(RequestRefused, match="outside the model's vocabulary"):
        engine.embed(EmbedInputs(token_ids=[[10**6]]))


@pytest.fixture(scope="module")
def node(tmp_path_factory, models):
    chat = make_tiny_model(tmp_path_factory.mktemp("chat") / "tiny")
    served = {BERT_ID: models["mean"], QWEN_ID: models["qwen3"], TINY_MODEL_ID: chat}
    with exo_serving(tmp_path_factory.mktemp("node"), served) as exo:
        yield exo


@pytest.fixture(scope="module")
def http(node):
    with httpx.Client(base_url=node.url, timeout=300) as client:
        for model_id in (BERT_ID, QWEN_ID):
            place(client, model_id)
        yield client


@pytest.mark.slow
def test_the_openai_client_gets_the_reference_vectors_through_the_cluster(http, node, models):
    client = openai.OpenAI(base_url=f"{node.url}/v1", api_key="none")
    for model_id, reference in ((BERT_ID, numpy_bert_embeddings(models["mean"], TEXTS, "mean")),
                                (QWEN_ID, numpy_qwen3_embeddings(models["qwen3"], TEXTS))):
        answer = client.embeddings.create(model=model_id, input=TEXTS)  # the client asks base64 and decodes it
        np.testing.assert_allclose(np.array([d.embedding for d in answer.data]), reference, atol=ATOL)
        assert [d.index for d in answer.data] == list(range(len(TEXTS))) and answer.usage.prompt_tokens > len(TEXTS)
        floats = http.post("/v1/embeddings", json={"model": model_id, "input": TEXTS[0], "encoding_format": "float"}).json()
        np.testing.assert_allclose(floats["data"][0]["embedding"], reference[0], atol=ATOL)
        assert floats["usage"]["prompt_tokens"] == floats["usage"]["total_tokens"] > 0


@pytest.mark.slow
def test_ollama_embed_and_the_older_embeddings_route(http, models):
    reference = numpy_qwen3_embeddings(models["qwen3"], TEXTS)
    embed = http.post("/api/embed", json={"model": QWEN_ID, "input": TEXTS}).json()
    np.testing.assert_allclose(embed["embeddings"], reference, atol=ATOL)
    assert embed["model"] == QWEN_ID and embed["prompt_eval_count"] > 0
    one = http.post("/api/embeddings", json={"model": QWEN_ID, "prompt": TEXTS[1]}).json()
    np.testing.assert_allclose(one["embedding"], reference[1], atol=ATOL)
    cut = http.post("/api/embed", json={"model": QWEN_ID, "input": TEXTS[0], "dimensions": 8}).json()["embeddings"][0]
    assert len(cut) == 8 and abs(np.linalg.norm(cut) - 1) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize(("path", "body", "message"), [
    ("/v1/embeddings", {"model": BERT_ID, "input": []}, "input must be a non-empty string or list"),
    ("/v1/embeddings", {"model": BERT_ID, "input": ["a", ""]}, "input[1] must be a non-empty string"),
    ("/v1/embeddings", {"model": BERT_ID, "input": ["a", [1, 2]]}, "not a mix"),
    ("/v1/embeddings", {"model": BERT_ID, "input": ["word " * 100_000] * 3}, "1500000 characters in all; at most 1200000"),
    ("/v1/embeddings", {"model": BERT_ID, "input": [[1] * 100_001] * 3}, "input has 300003 token ids in all; at most 300000"),
    ("/v1/embeddings", {"model": BERT_ID, "input": "word " * 100}, "over the model's context of 64"),
    ("/v1/embeddings", {"model": BERT_ID, "input": "a", "dimensions": 0}, "dimensions must be at least 1"),
    ("/v1/embeddings", {"model": BERT_ID, "input": "a", "dimensions": 33}, "dimensions must be at most 32"),
    ("/v1/embeddings", {"model": TINY_MODEL_ID, "input": "a"}, "does not embed"),
    ("/v1/chat/completions", {"model": BERT_ID, "messages": [{"role": "user", "content": "hi"}]}, "is an embedding model"),
    ("/api/embed", {"model": QWEN_ID, "input": [1, 2]}, "invalid input type"),
    ("/api/chat", {"model": QWEN_ID, "messages": [{"role": "user", "content": "hi"}], "stream": False}, "is an embedding model"),
])
def test_bad_embedding_requests_are_400s_that_name_the_problem(http, path, body, message):
    if body["model"] == TINY_MODEL_ID:
        http.post("/models/add", json={"model_id": TINY_MODEL_ID})
    answer = http.post(path, json=body)
    assert answer.status_code == 400, answer.text
    assert message in answer.text


@pytest.mark.slow
def test_an_embedding_model_is_placed_on_one_node_and_listed_as_embedding(http):
    answer = http.post("/place_instance", json={"model_id": BERT_ID, "min_nodes": 2})
    assert answer.status_code == 409 and "an embedding model runs on one node" in answer.text
    card = http.get(f"/v1/models/{BERT_ID}").json()["card"]
    assert card["embedding"] == {"pooling": "mean", "normalize": True, "rerank": None}


@pytest.mark.slow
async def test_concurrent_requests_share_forward_passes_and_a_refused_one_fails_alone(models):
    from concurrent.futures import ThreadPoolExecutor

    from exo.runner.decoding import PromptTooLong
    from exo.runner.embed_batch import EmbedBatcher

    engine = _engine(models["qwen3"])
    batcher = EmbedBatcher(engine, ThreadPoolExecutor(max_workers=1))
    asked = [EmbedInputs(texts=TEXTS[:2]), EmbedInputs(token_ids=[[1] * 200]), EmbedInputs(texts=TEXTS[2:], dimensions=8)]
    answers = await asyncio.gather(*[batcher.embed(inputs) for inputs in asked], return_exceptions=True)
    assert batcher.rounds == 1  # the three arrived together: one round of forward passes
    assert isinstance(answers[1], PromptTooLong)
    for inputs, answer in ((asked[0], answers[0]), (asked[2], answers[2])):
        alone = engine.embed(inputs)
        assert answer.prompt_tokens == alone.prompt_tokens
        np.testing.assert_allclose(_decoded(answer.vectors), _decoded(alone.vectors), atol=1e-6)
    later = await batcher.embed(asked[0])
    assert batcher.rounds == 2 and later.vectors == answers[0].vectors


def _decoded(vectors: list[str]) -> np.ndarray:
    return np.stack([np.frombuffer(base64.b64decode(v), dtype="<f4") for v in vectors])


@pytest.mark.parametrize(("text", "why"), [("AACAPw==!!", "not base64"), (base64.b64encode(b"abc").decode(), "3 bytes"),
                                           (base64.b64encode(np.array([np.nan], "<f4").tobytes()).decode(), "not all finite"),
                                           ("", "0 bytes")])
def test_a_forged_vector_chunk_is_a_502_that_names_it(text, why):
    """exo.tokens takes anyone with exo's credentials: the API checks what it decodes."""
    from exo.api.embedding import decoded_vector
    from exo.api.errors import ApiError

    with pytest.raises(ApiError, match=why) as refused:
        decoded_vector(text)
    assert refused.value.status == 502
    assert decoded_vector(base64.b64encode(np.array([1.5, -2], "<f4").tobytes()).decode()).tolist() == [1.5, -2.0]


@pytest.mark.slow
def test_dimensions_past_the_vector_are_refused_by_the_runner_too(models):
    """A card may not know the model's size (hidden_size 0): the runner checks it itself."""
    from exo.runner.decoding import RequestRefused

    with pytest.raises(RequestRefused, match="dimensions must be at most 64 for this model, got 65"):
        _engine(models["qwen3"]).embed(EmbedInputs(texts=TEXTS[:1], dimensions=65))
