"""Speculative decoding: an instance with a draft model gives plain decoding's greedy text token for
token (mlx-lm's own generate, no draft), in process and through the cluster, and reports the draft
tokens the model accepted; what it cannot serve is refused with the reason."""

from __future__ import annotations

import httpx
import pytest

from exo.core.requests import ChatMessage, GenerationParams
from exo.core.types import SamplingDefaults
from tests.support.e2e import Reference, exo_serving, place
from tests.support.tiny_model import TINY_MODEL_ID, Dims, make_tiny_model

pytestmark = pytest.mark.slow

DRAFT_ID = "exo-test/tiny-draft"
ASKS = ["Tell me about the sea.", "What is the capital of France?", "Write a story about a robot."]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """Another model of the same vocabulary: smaller, other weights, so it is often wrong."""
    return make_tiny_model(tmp_path_factory.mktemp("draft") / "draft", Dims(hidden=32, intermediate=64, layers=1, heads=2,
                                                                             kv_heads=1))


@pytest.fixture(scope="module")
def reference(model_dir):
    return Reference(model_dir)


def _engine(model_dir, draft_dir, num_draft_tokens=3):
    from exo.runner.engine import Engine

    engine = Engine()
    engine.load(str(model_dir))
    engine.load_draft(str(draft_dir), num_draft_tokens)
    return engine


def _generate(engine, text: str, max_tokens: int, **params):
    chunks = []
    params = GenerationParams(messages=[ChatMessage(role="user", content=text)], max_tokens=max_tokens,
                              **{"temperature": 0, **params})
    result = engine.generate(params, SamplingDefaults(), lambda out: chunks.append(out.text), lambda: False)
    return "".join(chunks), result


@pytest.mark.parametrize("draft", ["itself", "a smaller model"])
def test_greedy_text_with_a_draft_equals_plain_decoding(model_dir, draft_dir, reference, draft):
    engine = _engine(model_dir, model_dir if draft == "itself" else draft_dir)
    for ask in ASKS:
        text, result = _generate(engine, ask, 60)
        assert text == reference.chat([{"role": "user", "content": ask}], 60), ask
        if draft == "itself":  # every proposal is the model's own choice: all but one token per step come from it
            assert result.draft_tokens >= 60 * 3 // 4 - 3


def test_a_request_with_logits_processors_takes_the_plain_path(model_dir, draft_dir, reference):
    """mlx-lm's speculative step shows processors the generated tokens only: such requests go without the draft."""
    from mlx_lm.sample_utils import make_logits_processors

    engine = _engine(model_dir, model_dir)
    text, result = _generate(engine, ASKS[0], 40, presence_penalty=0.5)
    assert result.draft_tokens == 0
    expected = reference.chat([{"role": "user", "content": ASKS[0]}], 40,
                              logits_processors=make_logits_processors(presence_penalty=0.5))
    assert text == expected


def test_a_draft_of_another_vocabulary_is_refused(model_dir, tmp_path):
    from exo.runner.engine import Engine
    from tests.support.tool_model import make_tool_model

    engine = Engine()
    engine.load(str(model_dir))
    other = make_tool_model(tmp_path / "other")
    with pytest.raises(ValueError, match="vocabulary"):
        engine.load_draft(str(other), 3)


@pytest.fixture(scope="module")
def http(tmp_path_factory, model_dir):
    # The model as its own draft (another card): every proposal is its own choice, so the draft is seen at work.
    with exo_serving(tmp_path_factory.mktemp("node"), {TINY_MODEL_ID: model_dir, DRAFT_ID: model_dir}) as exo, \
            httpx.Client(base_url=exo.url, timeout=300) as client:
        assert client.post("/models/add", json={"model_id": DRAFT_ID}).status_code == 200
        yield client


def test_through_the_cluster_the_text_is_plain_decodings_and_usage_counts_the_draft(http, reference):
    place(http, TINY_MODEL_ID, draft_model=DRAFT_ID, num_draft_tokens=4)
    accepted = []
    for ask in ASKS:
        answer = http.post("/v1/chat/completions", json={"model": TINY_MODEL_ID, "max_tokens": 50, "temperature": 0,
                                                         "messages": [{"role": "user", "content": ask}]}).json()
        assert answer["choices"][0]["message"]["content"] == reference.chat([{"role": "user", "content": ask}], 50)
        accepted.append(answer["usage"]["completion_tokens_details"]["accepted_prediction_tokens"])
    assert all(n >= 50 * 4 // 5 - 4 for n in accepted), accepted  # 4 of every 5 tokens come from the draft
    metrics = http.get("/metrics").text
    counted = [float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("exo_draft_accepted_tokens_total")]
    assert counted == [sum(accepted)]


@pytest.mark.parametrize(("extra", "status", "message"), [
    ({"draft_model": "exo-test/no-such-draft"}, 404, "unknown draft model"),
    ({"draft_model": DRAFT_ID, "min_nodes": 2}, 409, "an instance with a draft model runs on one node"),
    ({"draft_model": DRAFT_ID, "num_draft_tokens": 40}, 400, "num_draft_tokens must be between 1 and 16"),
])
def test_what_a_draft_cannot_serve_is_refused_with_the_reason(http, extra, status, message):
    answer = http.post("/place_instance", json={"model_id": TINY_MODEL_ID, **extra})
    assert answer.status_code == status, answer.text
    assert message in answer.text
