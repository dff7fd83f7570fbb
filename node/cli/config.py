"""Configuration: nested frozen dataclasses, merged with precedence defaults < TOML file < CLI flags.

Every field of a section becomes a flag ``--field-name`` (help from the field's metadata), and a TOML
table named after the section sets the same fields. Validation lives in each dataclass's
``__post_init__`` and raises ``ConfigError`` naming the bad value.
"""

from __future__ import annotations

import argparse
import dataclasses
import tomllib
import typing
from dataclasses import fields, is_dataclass, replace
from pathlib import Path
from typing import Any

from node.learner.presets import apply_preset
from node.local.config import TrainLocalConfig
from protocol.errors import ConfigError

# Flags whose natural name collides with another section's field.
RENAMES = {("task", "seed"): "model-seed", ("inner", "lr"): "inner-lr", ("model", "name"): "model"}


def _section_fields(cls) -> list[dataclasses.Field]:
    return [f for f in fields(cls) if not is_dataclass(f.default)]


def _type_of(cls, f: dataclasses.Field):
    hint = typing.get_type_hints(cls)[f.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def add_config_args(parser: argparse.ArgumentParser, root=TrainLocalConfig) -> None:
    """One flag per field of every section; defaults suppressed so we can tell what was given."""
    for sec in fields(root):
        group = parser.add_argument_group(sec.name)
        for f in _section_fields(sec.type if isinstance(sec.type, type) else type(sec.default)):
            cls = type(sec.default)
            flag = "--" + RENAMES.get((sec.name, f.name), f.name.replace("_", "-"))
            kw: dict[str, Any] = {
                "dest": f"{sec.name}.{f.name}",
                "default": argparse.SUPPRESS,
                "metavar": f.name.upper(),
                "help": f"{f.metadata.get('help', '')} (default: {f.default})".replace("%", "%%"),
            }
            t = _type_of(cls, f)
            if t is bool:
                kw["action"] = argparse.BooleanOptionalAction
                del kw["metavar"]
            else:
                kw["type"] = t
            group.add_argument(flag, **kw)


def build_config(args: argparse.Namespace, toml_path: str | None, root=TrainLocalConfig):
    """defaults < TOML < CLI. Raises ConfigError naming any bad value or unknown key."""
    values: dict[str, dict[str, Any]] = {sec.name: {} for sec in fields(root)}
    if toml_path:
        p = Path(toml_path)
        if not p.is_file():
            raise ConfigError(f"config={toml_path!r} is invalid: no such file")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config={toml_path!r} is not valid TOML: {e}") from e
        for name, table in data.items():
            if name not in values or not isinstance(table, dict):
                raise ConfigError(f"config {toml_path}: unknown section [{name}]; known: {', '.join(values)}")
            values[name].update(table)
    for dest, v in vars(args).items():
        if "." in dest:
            sec, name = dest.split(".", 1)
            values[sec][name] = v
    apply_preset(values)  # defaults < preset < TOML < CLI
    kwargs = {}
    for sec in fields(root):
        cls = type(sec.default)
        known = {f.name: f for f in _section_fields(cls)}
        unknown = set(values[sec.name]) - set(known)
        if unknown:
            raise ConfigError(f"unknown setting(s) {sorted(unknown)} in section [{sec.name}]")
        for name, v in values[sec.name].items():
            values[sec.name][name] = _coerce(cls, known[name], v, sec.name)
        try:
            kwargs[sec.name] = replace(sec.default, **values[sec.name])
        except TypeError as e:
            raise ConfigError(f"section [{sec.name}]: {e}") from e
    return root(**kwargs)


def _coerce(cls, f: dataclasses.Field, v: Any, section: str) -> Any:
    t = _type_of(cls, f)
    if v is None:
        return v
    ok = isinstance(v, t) and not (t is not bool and isinstance(v, bool))
    if t is float and isinstance(v, int) and not isinstance(v, bool):
        return float(v)
    if t is str and isinstance(v, list) and all(isinstance(x, str) for x in v):
        return ",".join(v)  # TOML lists of addresses
    if not ok:
        raise ConfigError(f"{section}.{f.name}={v!r} is invalid: expected {t.__name__}")
    return v


def describe(cfg) -> str:
    """The resolved configuration as TOML-like lines, printed at start-up."""
    lines = []
    for sec in fields(cfg):
        lines.append(f"[{sec.name}]")
        sub = getattr(cfg, sec.name)
        for f in _section_fields(type(sub)):
            lines.append(f"  {f.name} = {getattr(sub, f.name)!r}")
    return "\n".join(lines)
