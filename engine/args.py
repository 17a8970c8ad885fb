"""Engine flags, generated from EngineConfig's fields.

`block_size` becomes `--block-size`, with the field's default, type, choices
and help (its metadata), so a flag and the offline `LLM(...)` argument of the
same name always mean the same thing and a default is written once, in
engine/config.py. Any command that builds an engine (serve, generate, the
benchmarks) takes these flags through `add_engine_args`.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing

from engine.config import EngineConfig

# `--block-size N`, `--gpu-memory-utilization F`: shorter than BLOCK_SIZE in --help.
_METAVARS = types.MappingProxyType({int: "N", float: "F"})


def _cli_fields() -> list[dataclasses.Field]:
    """The EngineConfig fields that are flags (metadata "cli": False opts out)."""
    return [f for f in dataclasses.fields(EngineConfig) if f.metadata.get("cli", True)]


def _flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def _value_type(hint) -> type:
    """`int` for int, `str` for `str | None`: the type argparse converts to."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        (hint,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    return hint


def _add_field(group, field: dataclasses.Field, hint) -> None:
    kind = _value_type(hint)
    options = {"default": field.default, "help": field.metadata.get("help")}
    if field.default is dataclasses.MISSING:
        # A computed default (default_factory) stays unset, so EngineConfig
        # computes it when the config is built, not when the parser is.
        options["default"] = argparse.SUPPRESS
    if kind is bool:
        options["action"] = argparse.BooleanOptionalAction
    else:
        options["type"] = _parser(field.metadata["parse"]) if "parse" in field.metadata else kind
        if kind in _METAVARS:
            options["metavar"] = _METAVARS[kind]
        if "choices" in field.metadata:
            # None is what leaving the flag out gives; it cannot be typed.
            options["choices"] = [c for c in field.metadata["choices"] if c is not None]
    action = group.add_argument(_flag_name(field.name), dest=field.name, **options)
    # Some Pythons' BooleanOptionalAction append the default themselves.
    shown = options["default"] not in (None, "", argparse.SUPPRESS)  # "": nothing to show
    if action.help and shown and "%(default)" not in action.help:
        action.help += " (default: %(default)s)"


def _parser(parse):
    """A field's own parser (a JSON flag), its ValueError shown as argparse's error."""
    def convert(text: str):
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    convert.__name__ = parse.__name__
    return convert


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add one flag per EngineConfig field, in an "engine" group of --help."""
    group = parser.add_argument_group("engine")
    hints = typing.get_type_hints(EngineConfig)
    for field in _cli_fields():
        _add_field(group, field, hints[field.name])


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The validated EngineConfig of parsed engine flags (ValueError if invalid)."""
    values = {f.name: getattr(args, f.name) for f in _cli_fields() if hasattr(args, f.name)}
    return EngineConfig(**values)
