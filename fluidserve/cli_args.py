"""Map config dataclasses onto argparse: one flag per field, help from the field metadata."""

from __future__ import annotations

import argparse
import dataclasses
import math
import types
import typing
from typing import Any


def _base_type(tp: Any) -> tuple[type, bool]:
    """(underlying type, optional?) for annotations like ``int | None``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], True
    return tp, False


def number(inf_ok: bool = False):
    """argparse's type for a float knob: never NaN, infinite only where the knob says so."""
    def parse(text: str) -> float:
        value = float(text)
        if math.isnan(value) or (math.isinf(value) and not inf_ok):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        return value

    parse.__name__ = "number"  # argparse's "invalid number value" for what float() refuses
    return parse


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, title: str,
                       only: set[str] | None = None) -> None:
    """One flag per field (``only``: just these fields); aliases from field metadata."""
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if only is not None and f.name not in only:
            continue
        flags = [f.metadata.get("flag", "--" + f.name.replace("_", "-")),
                 *f.metadata.get("aliases", ())]
        help_text = f.metadata.get("help", "").replace("%", "%%")  # argparse formats help
        tp, _ = _base_type(hints[f.name])
        default = f.default
        if tp is bool:
            shown = "" if default is None else f" (default: {'on' if default else 'off'})"
            group.add_argument(
                *flags, action=argparse.BooleanOptionalAction, default=default,
                help=help_text + shown, dest=f.name,
            )
            continue
        if f.metadata.get("repeat"):  # tuple[T, ...]: the flag once per value
            item = typing.get_args(hints[f.name])[0]
            group.add_argument(*flags, action="append", type=item, default=None,
                               help=help_text, metavar=f.name.upper(), dest=f.name)
            continue
        if f.metadata.get("nargs"):  # tuple[T, ...]: the values after one flag
            item = typing.get_args(hints[f.name])[0]
            group.add_argument(*flags, nargs=f.metadata["nargs"], type=item, default=None,
                               help=help_text, metavar=f.name.upper(), dest=f.name)
            continue
        choices = f.metadata.get("choices")
        if callable(choices):  # computed when the parser is built
            choices = choices()
        shown = "" if default is None else " (default: %(default)s)"
        group.add_argument(
            *flags,
            type=f.metadata.get("parse", number(f.metadata.get("inf_ok", False))
                                if tp is float else tp),
            default=default,
            choices=choices,
            help=help_text + shown,
            metavar=f.name.upper() if tp is not str or not choices else None,
            dest=f.name,
        )


def dataclass_from_args(cls: type, args: argparse.Namespace) -> Any:
    """Build ``cls`` from parsed flags; fields without a flag keep their defaults."""
    values = {}
    for f in dataclasses.fields(cls):
        if not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        if f.metadata.get("repeat") or f.metadata.get("nargs"):  # the values, or the default
            value = f.default if value is None else tuple(value)
        values[f.name] = value
    return cls(**values)


ALL_SECTIONS = ("model", "cache", "scheduler", "parallel")


def add_engine_args(parser: argparse.ArgumentParser,
                    sections: tuple[str, ...] = ALL_SECTIONS) -> None:
    """Flags of the EngineConfig sections, one argument group each."""
    from fluidserve.config import SECTIONS

    for name in sections:
        add_dataclass_args(parser, SECTIONS[name], f"engine: {name}")


def engine_config_from_args(args: argparse.Namespace,
                            sections: tuple[str, ...] = ALL_SECTIONS) -> Any:
    """An EngineConfig from the flags of ``sections``; the others keep their defaults."""
    from fluidserve.config import SECTIONS, EngineConfig

    return EngineConfig(**{name: dataclass_from_args(SECTIONS[name], args) for name in sections})
