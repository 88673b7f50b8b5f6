"""The command-line flags of every setting, generated from the declarations, and what was given."""

from __future__ import annotations

import argparse
from typing import Any

import msgspec

from exo.settings.declare import Setting, settings_of, shown_default
from exo.settings.services import SERVICE_SETTINGS


def add_setting_flags(parser: argparse.ArgumentParser) -> None:
    """One argument group per settings struct; a flag's default is "not given", so that the
    environment and then the declared default apply (declare.read)."""
    for cls in SERVICE_SETTINGS:
        settings = [s for s in settings_of(cls) if s.flag]
        if not settings:
            continue
        group = parser.add_argument_group(title_of(cls))
        for setting in settings:
            group.add_argument(setting.flag, dest=_dest(cls, setting), default=argparse.SUPPRESS,
                               help=flag_help(setting), **_kind(setting))


def environment_only() -> str:
    """The settings without a flag, for --help's epilog."""
    lines = [f"  {s.env.name}: {s.env.help}" + (f" (default: {shown_default(s)})" if shown_default(s) else "")
             for cls in SERVICE_SETTINGS for s in settings_of(cls) if not s.flag]
    return "Read from the environment only:\n" + "\n".join(lines) if lines else ""


def given_flags(namespace: argparse.Namespace, cls: type[msgspec.Struct]) -> dict[str, Any]:
    """The flags of `cls` on the command line, by field name."""
    values = vars(namespace)
    return {s.field: values[_dest(cls, s)] for s in settings_of(cls) if _dest(cls, s) in values}


def flag_help(setting: Setting) -> str:
    default = shown_default(setting)
    shown = f"; default: {default}" if default else ""
    return f"{setting.env.help} (env {setting.env.name}{shown})".replace("%", "%%")


def _kind(setting: Setting) -> dict[str, Any]:
    if setting.is_bool:
        return {"action": argparse.BooleanOptionalAction}
    if setting.env.repeatable:
        return {"action": "append", "metavar": setting.metavar}
    return {"metavar": setting.metavar}


def _dest(cls: type[msgspec.Struct], setting: Setting) -> str:
    return f"{cls.__name__}.{setting.field}"


def title_of(cls: type[msgspec.Struct]) -> str:
    return (cls.__doc__ or cls.__name__).strip().splitlines()[0].rstrip(".")
