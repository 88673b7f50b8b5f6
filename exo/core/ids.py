"""Typed ids: each kind of id is its own type to the checker (a plain `str` on the wire and at
run time), so a node id passed where an instance id belongs is an error mypy reports."""

from __future__ import annotations

from typing import NewType

NodeId = NewType("NodeId", str)
ModelId = NewType("ModelId", str)  # a model card's id ("org/name"), as clients name models
InstanceId = NewType("InstanceId", str)
RunnerId = NewType("RunnerId", str)
CommandId = NewType("CommandId", str)
# A task is named after the command that asked for it (clients follow one id from request to
# answer), so the two are one type.
TaskId = CommandId

