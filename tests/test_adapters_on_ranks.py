"""LoRA adapters per row on a multi-node instance of their base (exo/runner/adapter_rows.py,
lora_shards.py): two ranks (separate processes, an MLX ring group on loopback,
tests/support/lockstep_ranks.py), pipeline and tensor, run one batch mixing two adapters and
the bare base, each row's greedy text equal to mlx-lm's with that adapter alone loaded
(`mlx_lm.load(adapter_path=...)`). Rank 1 knows each row's adapter only from rank 0's steps and
gets its weights by their hash. The master sends such requests to the base's multi-node instance."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.nn.layers.distributed import shard_linear
from mlx_lm.tuner.lora import LoRALinear

from exo.core.commands import GenerateText
from exo.core.events import TaskCreated
from exo.core.requests import GenerationParams
from exo.core.state import State
from exo.core.types import Instance, ShardAssignment
from exo.master.decide import decide
from exo.runner.multi_lora import MultiLoRALinear, RowAdapters
from tests.support.adapters import make_adapter
from tests.support.e2e import Reference
from tests.support.tiny_model import TINY_MODEL_ID, Dims, make_tiny_model
from tests.test_adapters import CARD, _adapter
from tests.test_lockstep_batch import LAYERS, on_two_ranks

ASK = "Tell me about the sea and the ships upon it."
MAX_TOKENS = 24
# pirate: every layer (both pipeline ranks' blocks); poet: the last layer only (rank 1's block), a larger rank.
ADAPTERS = {"pirate": {"seed": 7, "rank": 4}, "poet": {"seed": 11, "rank": 8, "num_layers": 1}}


class _RankOfTwo:
    """An MLX group as one rank of two sees it: all that mlx's shard_linear and lora_shards.py read."""

    def __init__(self, rank: int) -> None:
        self._rank = rank

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return 2


LAYER_ADAPTERS = {"a": (4, 2.0), "b": (8, 0.5)}  # name: (rank, scale)


@pytest.mark.parametrize("strategy", ["gather", "grouped"])
@pytest.mark.parametrize("sharding", ["all-to-sharded", "sharded-to-all"])
def test_two_tensor_shards_of_a_multi_lora_linear_make_mlx_lms_lora_linear_per_row(monkeypatch, sharding, strategy):
    mx.random.seed(5)
    base = nn.Linear(32, 48)
    pairs = {name: (mx.random.normal((32, rank)) * 0.2, mx.random.normal((rank, 48)) * 0.2)
             for name, (rank, _) in LAYER_ADAPTERS.items()}
    x, rows = mx.random.normal((3, 5, 32)), ["a", None, "b"]

    def mlx_lm_row(i: int, name: str | None) -> mx.array:
        if name is None:
            return base(x[i:i + 1])
        rank, scale = LAYER_ADAPTERS[name]
        lora = LoRALinear.from_base(base, r=rank, scale=scale)
        lora.lora_a, lora.lora_b = pairs[name]
        return lora(x[i:i + 1])

    expected = mx.concatenate([mlx_lm_row(i, name) for i, name in enumerate(rows)])

    def multi(linear: nn.Module, inputs: mx.array) -> mx.array:
        batch = RowAdapters(strategy)
        batch.ranks, batch.scales = {n: r for n, (r, _) in LAYER_ADAPTERS.items()}, {n: s for n, (_, s) in LAYER_ADAPTERS.items()}
        layer = MultiLoRALinear(linear, batch)
        for name, (lora_a, lora_b) in pairs.items():
            layer.add(name, lora_a, lora_b)
        batch.select(rows)
        return layer(inputs)

    assert mx.allclose(multi(base, x), expected, atol=1e-5)  # one node
    reduced: list[mx.array] = []  # what each rank hands the all_sum (which gives zeros here)
    monkeypatch.setattr(mx.distributed, "all_sum", lambda part, group: reduced.append(part) or mx.zeros_like(part))
    shards = [shard_linear(base, sharding, group=_RankOfTwo(rank)) for rank in (0, 1)]
    if sharding == "all-to-sharded":  # each rank: its slice of the outputs
        whole = mx.concatenate([multi(shard, x) for shard in shards], axis=-1)
    else:  # each rank: its slice of the inputs; all of its output goes through the linear's one all_sum
        outputs = [multi(shard, inputs) for shard, inputs in zip(shards, mx.split(x, 2, axis=-1), strict=True)]
        assert all(mx.array_equal(output, mx.broadcast_to(base.bias, output.shape)) for output in outputs)
        whole = reduced[0] + reduced[1] + base.bias
    assert mx.allclose(whole, expected, atol=1e-5)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny4", Dims(layers=LAYERS))


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory, model_dir):
    return {name: make_adapter(model_dir, tmp_path_factory.mktemp(name) / name, **options)
            for name, options in ADAPTERS.items()}


@pytest.fixture(scope="module")
def expected(model_dir, adapter_dirs):
    """mlx-lm's greedy text for ASK, per adapter loaded alone (None: the bare base)."""
    folders = {None: None, **adapter_dirs}
    texts = {name: Reference(model_dir, folder).chat([{"role": "user", "content": ASK}], MAX_TOKENS)
             for name, folder in folders.items()}
    assert len(set(texts.values())) == len(texts)  # each adapter changes the text, each its own way
    return texts


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["pipeline", "tensor"])
def test_one_batch_of_two_adapters_and_the_base_on_two_ranks_gives_mlx_lms_text_per_row(model_dir, adapter_dirs,
                                                                                          expected, sharding):
    rows = ["pirate", None, "poet", "pirate", "poet"]
    requests = [{"text": ASK, "max_tokens": MAX_TOKENS, **({"adapter": str(adapter_dirs[row])} if row else {})}
                for row in rows]
    requests[1]["join_after"] = [0, 2]  # joins a batch already running an adapter's row
    # A seed sends a request down the single path on a multi-node instance (between batch steps):
    # the other rank selects its adapter there too. Temperature 0: still greedy.
    requests[4] |= {"seed": 3, "after_done": 2}
    results = on_two_ranks(model_dir, sharding, requests)
    assert [text for text, _, _ in results] == [expected[row] for row in rows]


def test_the_master_sends_a_lora_adapter_to_a_multi_node_instance_of_its_base_but_not_a_dora_one(tmp_path):
    model_dir = make_tiny_model(tmp_path / "tiny")  # tests.test_adapters' card: two layers
    lora = _adapter(make_adapter(model_dir, tmp_path / "lora"), "lora")
    dora = _adapter(make_adapter(model_dir, tmp_path / "dora", dora=True), "dora")
    shards = [ShardAssignment(runner_id=f"r{n}", node_id=f"n{n}", rank=n, world_size=2, start_layer=n, end_layer=n + 1)
              for n in range(2)]
    state = State(adapters={"lora": lora, "dora": dora},
                  instances={"two": Instance(instance_id="two", model_id=TINY_MODEL_ID, shards=shards)})

    def routed(model_id: str) -> list:
        command = GenerateText(command_id="g", model_id=model_id, params=GenerationParams())
        return decide(state, command, builtin_cards={TINY_MODEL_ID: CARD}, ids=iter(["x"] * 10), on_demand=False)

    [created] = routed(lora.model_id)
    assert isinstance(created, TaskCreated) and created.task.instance_id == "two"
    assert created.task.model_id == lora.model_id
    assert not any(isinstance(event, TaskCreated) for event in routed(dora.model_id))  # an instance of its own
