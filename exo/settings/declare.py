"""How a setting is declared and read: a msgspec field that names its environment variable.

A setting is a field of a frozen settings struct, annotated with `Env`:

    suspect_s: Annotated[float, Env("EXO_SUSPECT_S", "seconds ..."), Meta(ge=0)] = 5.0

`read` builds a struct from the environment and the flags that were given (a flag wins), once,
in exo/main.py; the services get the struct and never look at the environment. The flag is the
variable's name without EXO_, in kebab case (EXO_SUSPECT_S: --suspect-s), unless `Env` names
another (the flags older than this rule); `exo --help` and docs/operations.md are generated from
the same declarations, so they cannot drift from the code.
"""

from __future__ import annotations

import os
import typing
from collections.abc import Iterator, Mapping
from typing import Any, TypeVar

import msgspec

S = TypeVar("S", bound=msgspec.Struct)

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


class Env:
    """The environment variable of a setting, its help, and how its text reads.

    `flag`: the command-line flag ("" for none; default: from the variable's name). `metavar`: what
    --help calls the value (default: from the type). `separator`: for a tuple
    setting, what splits the variable's text. `repeatable`: the flag may be given several times and
    adds to the variable's items. `aliases`: other variables read when this one is unset (a
    library's own, such as HF_HUB_OFFLINE)."""

    def __init__(self, name: str, help: str, *, flag: str | None = None, metavar: str = "", separator: str = ",",
                 repeatable: bool = False, aliases: tuple[str, ...] = ()) -> None:
        self.name, self.help, self.flag, self.metavar = name, help, flag, metavar
        self.separator, self.repeatable, self.aliases = separator, repeatable, aliases


class SettingError(ValueError):
    """A setting's text does not read as its type or range; the message names the variable or flag."""


class Setting(msgspec.Struct, frozen=True):
    """One declared setting, as --help and the docs show it."""

    field: str
    env: Env
    kind: Any  # the field's type, Annotated with its checks
    default: Any

    @property
    def flag(self) -> str:
        if self.env.flag is not None:
            return self.env.flag
        return "--" + self.env.name.removeprefix("EXO_").lower().replace("_", "-")

    @property
    def metavar(self) -> str:
        if self.env.metavar:
            return self.env.metavar
        kinds = {_base(k) for k in typing.get_args(_unannotated(self.kind))} or {_base(self.kind)}
        if int in kinds:
            return "N"
        if float in kinds:
            return "SECONDS" if self.field.endswith("_s") else "NUMBER"
        return "LIST" if tuple in kinds else "TEXT"

    @property
    def is_bool(self) -> bool:
        return _base(self.kind) is bool


def settings_of(cls: type[msgspec.Struct]) -> Iterator[Setting]:
    hints = typing.get_type_hints(cls, include_extras=True)
    for info in msgspec.structs.fields(cls):
        env = next((m for m in getattr(hints[info.name], "__metadata__", ()) if isinstance(m, Env)), None)
        if env is not None:
            default = info.default_factory() if info.default is msgspec.NODEFAULT else info.default
            yield Setting(info.name, env, hints[info.name], default)


def read(cls: type[S], environ: Mapping[str, str] = os.environ, flags: Mapping[str, Any] | None = None) -> S:
    """`cls` from the flags given (by field name) and else the environment; a bad value is a
    SettingError naming its source."""
    flags = flags or {}
    values: dict[str, Any] = {}
    for setting in settings_of(cls):
        value = raw_value(setting, environ, flags)
        if value is not None:
            values[setting.field] = value
    return cls(**values)


def raw_value(setting: Setting, environ: Mapping[str, str], flags: Mapping[str, Any]) -> Any:
    """The setting's checked value, or None where nothing was given (the default applies)."""
    given = flags.get(setting.field)
    text, source = next(((environ[name], name) for name in (setting.env.name, *setting.env.aliases)
                         if name in environ), (None, setting.env.name))
    if setting.env.repeatable and given is not None:
        items = [*_split(text or "", setting.env.separator), *given]
        return _convert(items, setting, f"{setting.env.name} and {setting.flag}")
    if isinstance(given, bool):  # --offline / --no-offline
        return given
    if given is not None:
        text, source = given, setting.flag
    if text is None or not text.strip():  # an empty variable is an unset one: the default applies
        return None
    if _base(setting.kind) is tuple:
        return _convert(_split(text, setting.env.separator), setting, source)
    if setting.is_bool:
        return _convert(_boolean(text, source), setting, source)
    return _convert(text.strip(), setting, source)


def value_of(cls: type[msgspec.Struct], field: str, environ: Mapping[str, str] = os.environ) -> Any:
    """One setting, from the environment (an operator tool's default for its own flag)."""
    setting = next(s for s in settings_of(cls) if s.field == field)
    value = raw_value(setting, environ, {})
    return setting.default if value is None else value


def is_given(cls: type[msgspec.Struct], field: str, environ: Mapping[str, str], flags: Mapping[str, Any]) -> bool:
    """Whether `field` was asked for (a flag or its variable), not left at its default."""
    setting = next(s for s in settings_of(cls) if s.field == field)
    return field in flags or any(name in environ for name in (setting.env.name, *setting.env.aliases))


def _convert(value: Any, setting: Setting, source: str) -> Any:
    try:
        return msgspec.convert(value, setting.kind, strict=False)
    except msgspec.ValidationError as error:
        reason = str(error).split(" - at ")[0]
        raise SettingError(f"{source}={value!r}: {reason}") from None


def _boolean(text: str, source: str) -> bool:
    word = text.strip().lower()
    if word in _TRUE or word in _FALSE:
        return word in _TRUE
    raise SettingError(f"{source}={text!r}: expected one of 1, true, yes, on, 0, false, no, off")


def _split(text: str, separator: str) -> list[str]:
    return [item.strip() for item in text.split(separator) if item.strip()]


def _unannotated(kind: Any) -> Any:
    while typing.get_origin(kind) is typing.Annotated:
        kind = typing.get_args(kind)[0]
    return kind


def _base(kind: Any) -> Any:
    kind = _unannotated(kind)
    return typing.get_origin(kind) or kind


def shown_default(setting: Setting) -> str:
    """The default as a person reads it in --help and the docs."""
    default = setting.default
    if isinstance(default, bool):
        return "on" if default else "off"
    if isinstance(default, tuple):
        return setting.env.separator.join(default)
    if default is None or default == "":
        return ""
    return str(default)
