"""What a reducer handler raises for an event that is well-formed but does not fit the State
(e.g. one that names an unknown task): the event is recorded as skipped (exo/core/apply.py)."""


class Skip(Exception):
    pass
