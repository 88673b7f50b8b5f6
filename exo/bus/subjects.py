"""The one table of subjects, stream and bucket names. Nothing else builds these strings."""

EVENTS_STREAM = "EXO_EVENTS"
COMMANDS_STREAM = "EXO_COMMANDS"
TOKENS_STREAM = "EXO_TOKENS"
STATE_BUCKET = "exo-state"
IMAGES_BUCKET = "exo-images"
MASTER_CONSUMER = "exo-master"

ALL_EVENTS = "exo.events.>"
ALL_COMMANDS = "exo.commands.>"


def event_subject(tag: str) -> str:
    return f"exo.events.{tag}"


def command_subject(tag: str) -> str:
    return f"exo.commands.{tag}"


def token_subject(command_id: str) -> str:
    return f"exo.tokens.{command_id}"

SNAPSHOT_KEY = "snapshot"
LEADER_KEY = "leader"
LEADER_BUCKET = "exo-leader"
IMAGES_STREAM = f"OBJ_{IMAGES_BUCKET}"


def image_chunks_subject(nuid: str) -> str:
    return f"$O.{IMAGES_BUCKET}.C.{nuid}"
