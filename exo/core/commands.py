"""Requests to the master. Each has an explicit wire tag (field "kind") and its own id,
which the resulting events carry back so the caller can find its answer."""

from __future__ import annotations

import msgspec

from exo.core.adapters import Adapter
from exo.core.ids import CommandId, InstanceId, ModelId, NodeId, TaskId
from exo.core.keys import ApiKey
from exo.core.requests import GenerationParams
from exo.core.types import InstanceRole, ModelCard, Sharding


class Command(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind"):
    command_id: CommandId


class PlaceInstance(Command, frozen=True, tag="place_instance", kw_only=True):
    model_id: ModelId
    sharding: Sharding = "pipeline"
    min_nodes: int = 1
    max_queue: int = 0  # open tasks the instance admits before it refuses more; 0: the default
    max_context: int = 0  # tokens of context to reserve KV cache for; 0: the most that fits, up to a default
    kv_bits: int = 0  # quantize the KV cache to this many bits (exo/core/kv_budget.py KV_BITS); 0: not quantized
    force: bool = False  # place without checking that it fits in memory (a card of unknown size, too)
    replicas: int = 1  # instances of it kept running, on distinct nodes where memory allows
    min_replicas: int | None = None  # the load scales replicas between these (exo/master/autoscale.py); None: replicas
    max_replicas: int | None = None
    draft_model: ModelId = ModelId("")  # speculative decoding: a smaller model of the same vocabulary
    num_draft_tokens: int = 0  # tokens it proposes per step (0: DEFAULT_DRAFT_TOKENS)
    keep_alive_s: float = -1.0  # unloaded after this many seconds without requests; negative: kept until deleted
    at: float = 0.0  # the API's wall clock when asked: the idle time of a keep_alive counts from here
    role: InstanceRole = "both"  # "prefill" or "decode": half of a split (Instance.role)

    def replica_bounds(self) -> tuple[int | None, int | None]:
        """(min, max) as the desire keeps them: one given, the other is `replicas`; neither: fixed (None)."""
        if self.min_replicas is None and self.max_replicas is None:
            return None, None
        return (self.replicas if self.min_replicas is None else self.min_replicas,
                self.replicas if self.max_replicas is None else self.max_replicas)


def replica_bounds_problem(min_replicas: int | None, replicas: int, max_replicas: int | None,
                           most: int) -> tuple[str, str] | None:
    """(the parameter, why) unless 0 <= min_replicas <= replicas <= max_replicas <= most (None: replicas)."""
    low, high = replicas if min_replicas is None else min_replicas, replicas if max_replicas is None else max_replicas
    if not 0 <= low <= replicas:
        return "min_replicas", f"min_replicas must be between 0 and replicas ({replicas}), not {low}"
    if not replicas <= high <= most:
        return "max_replicas", f"max_replicas must be between replicas ({replicas}) and {most}, not {high}"
    return None


class DeleteDesire(Command, frozen=True, tag="delete_desire", kw_only=True):
    desire_id: str


class DeleteInstance(Command, frozen=True, tag="delete_instance", kw_only=True):
    instance_id: InstanceId


class GenerateText(Command, frozen=True, tag="generate_text", kw_only=True):
    model_id: ModelId
    params: GenerationParams = GenerationParams()
    at: float = 0.0
    key_id: str = ""  # the API key it came with: the master admits it within the key's limits
    priority: str = "interactive"
    keep_alive_s: float | None = None  # how long the model stays loaded after this request (None: as it is)


class CancelTask(Command, frozen=True, tag="cancel_task", kw_only=True):
    task_id: TaskId


class AddCustomCard(Command, frozen=True, tag="add_card", kw_only=True):
    card: ModelCard


class DeleteCustomCard(Command, frozen=True, tag="delete_card", kw_only=True):
    model_id: ModelId


class AddAdapter(Command, frozen=True, tag="add_adapter", kw_only=True):
    adapter: Adapter  # its weights are in exo-adapters already, under adapter.digest


class DeleteAdapter(Command, frozen=True, tag="delete_adapter", kw_only=True):
    name: str


class SetKey(Command, frozen=True, tag="set_key", kw_only=True):
    """Add an API key, or change one (the API sends the whole key, changed)."""

    key: ApiKey
    new: bool = True  # True: the key id must be unused; False: it must exist


class DeleteKey(Command, frozen=True, tag="delete_key", kw_only=True):
    key_id: str


class RemoveNode(Command, frozen=True, tag="remove_node", kw_only=True):
    """Revoke a node (POST /nodes/{node}/remove): its instances end, it leaves State for good."""

    node_id: NodeId
    reason: str = ""
    removed_by: str = ""  # who asked, for the log and the removed node's own last line
    at: float = 0.0  # the API's wall clock: its tasks' moves are stamped with it


class CreateJoinToken(Command, frozen=True, tag="create_join_token", kw_only=True):
    """A join token (`exo token create`): the API made its id and secret; the command carries the digest."""

    token_id: str
    secret_sha256: str
    ttl_s: float
    uses: int = 1
    created_by: str = ""
    at: float = 0.0  # the API's wall clock: the token expires ttl_s after it


class RedeemJoinToken(Command, frozen=True, tag="redeem_join_token", kw_only=True):
    """A new node presents a join token (POST /cluster/join): one of its uses, if it has one left."""

    token_id: str
    secret_sha256: str
    node_name: str = ""
    at: float = 0.0


AnyCommand = (PlaceInstance | DeleteInstance | DeleteDesire | GenerateText | CancelTask | AddCustomCard | DeleteCustomCard
              | AddAdapter | DeleteAdapter | SetKey | DeleteKey | RemoveNode | CreateJoinToken | RedeemJoinToken)

_decoder = msgspec.json.Decoder(AnyCommand)
_encoder = msgspec.json.Encoder()


def encode_command(command: Command) -> bytes:
    return _encoder.encode(command)


def decode_command(data: bytes) -> AnyCommand:
    return _decoder.decode(data)


def command_tag(command: Command) -> str:
    return type(command).__struct_config__.tag  # type: ignore[return-value]
