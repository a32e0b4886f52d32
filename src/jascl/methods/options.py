"""One way to configure a method: a typed options dataclass, read from ``method_args.<key>``.

A method declares its options once, as a dataclass whose fields carry their
defaults and, through :func:`option`, their ranges or choices::

    @dataclass
    class EWCOptions:
        weight: float = option(500.0, ge=0, doc="lambda")
        fisher_labels: str = option("empirical", choices=("empirical", "sampled"))
        freeze: str = freeze_option()

and registers it with the method (``METHODS.register(..., options=EWCOptions)``).
:func:`read_options` then builds the options of a run from
``method_args.<key>`` (``--set method_args.ewc.weight=100``, a config file, a
protocol's ``training`` section): unknown keys, wrong types and values out of
range stop the run with one line naming ``method_args.<key>.<option>``.
``jascl methods NAME`` prints the table :func:`describe_options` makes.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, field
from typing import Any, TypeVar

from jascl.engine.config import RunConfig, apply_mapping
from jascl.errors import ConfigError

T = TypeVar("T")

#: values of every method's ``freeze`` option: "config" = the run's ``freeze_incremental``
FREEZE_CHOICES = ("config", "none", "all_but_classifier")


def option(
    default: Any,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    choices: Sequence[Any] | None = None,
    doc: str = "",
) -> Any:
    """A dataclass field with its default, its allowed range (``ge``/``gt``/``le``/``lt``) or ``choices``."""
    meta = {
        "ge": ge,
        "gt": gt,
        "le": le,
        "lt": lt,
        "choices": tuple(choices) if choices is not None else None,
        "doc": doc,
    }
    if isinstance(default, (list, dict, set)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def freeze_option(default: str = "config") -> Any:
    """The incremental-session freezing option every baseline has (``config``: the run's ``freeze_incremental``)."""
    return option(
        default,
        choices=FREEZE_CHOICES,
        doc="incremental-session freezing: config (the run's freeze_incremental), none or all_but_classifier",
    )


def freeze_policy(value: str) -> str | None:
    """A plugin's ``freeze_incremental`` for a ``freeze`` option value (``config`` -> None: the run's policy)."""
    return None if value == "config" else value


def _constraint(meta: Mapping[str, Any]) -> str:
    if meta.get("choices"):
        return "one of " + ", ".join(str(c) for c in meta["choices"])
    parts = []
    for key, sign in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
        if meta.get(key) is not None:
            parts.append(f"{sign} {meta[key]}")
    return " and ".join(parts)


def check_options(options: Any, prefix: str) -> None:
    """Check every field of ``options`` (nested dataclasses included) against its declared range or choices.

    Raises:
        ConfigError: ``<prefix>.<field>: must be ... (got ...)``.
    """
    for f in dataclasses.fields(options):
        value = getattr(options, f.name)
        key = f"{prefix}.{f.name}"
        if dataclasses.is_dataclass(value):
            check_options(value, key)
            continue
        meta = f.metadata
        if not meta or value is None:
            continue
        if meta.get("choices") is not None and value not in meta["choices"]:
            raise ConfigError(f"{key}: must be one of {', '.join(map(str, meta['choices']))} (got {value!r})")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            bad = (
                (meta.get("ge") is not None and not value >= meta["ge"])
                or (meta.get("gt") is not None and not value > meta["gt"])
                or (meta.get("le") is not None and not value <= meta["le"])
                or (meta.get("lt") is not None and not value < meta["lt"])
                or (isinstance(value, float) and math.isnan(value))
            )
            if bad:
                raise ConfigError(f"{key}: must be {_constraint(meta)} (got {value!r})")


def read_options(cls: type[T], config: RunConfig, key: str) -> T:
    """``cls``'s defaults updated from ``config.method_args[key]`` and checked (:func:`check_options`).

    Raises:
        ConfigError: one line naming ``method_args.<key>.<option>`` for an unknown key, a wrong type or a value
            outside the declared range.
    """
    given = config.method_args.get(key) or {}
    if not isinstance(given, Mapping):
        raise ConfigError(f"method_args.{key}: must be a mapping of option: value (got {given!r})")
    options = cls()
    apply_mapping(options, given, None, prefix=f"method_args.{key}.")
    _numbers(options, f"method_args.{key}")
    check_options(options, f"method_args.{key}")
    return options


def _numbers(options: Any, prefix: str) -> None:
    """Optional numeric options (default None) as numbers: a YAML 1.1 "1e-2" string becomes 0.01, a non-number
    is a one-line error. (Options with a numeric default are checked by :func:`apply_mapping` already.)"""
    hints = typing.get_type_hints(type(options))
    for f in dataclasses.fields(options):
        value = getattr(options, f.name)
        if dataclasses.is_dataclass(value):
            _numbers(value, f"{prefix}.{f.name}")
            continue
        numeric = {t for t in typing.get_args(hints.get(f.name)) if t in (int, float)}
        if not numeric or value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
            continue
        try:
            number = float(value) if isinstance(value, str) else None
        except ValueError:
            number = None
        if number is None or (int in numeric and float not in numeric and not number.is_integer()):
            raise ConfigError(f"{prefix}.{f.name}: must be a number or null (got {value!r})")
        setattr(options, f.name, int(number) if float not in numeric else number)


def _type_name(f: dataclasses.Field, owner: type) -> str:
    hints = typing.get_type_hints(owner)
    hint = hints.get(f.name, f.type)
    return getattr(hint, "__name__", str(hint)).replace("typing.", "")


def describe_options(cls: type, prefix: str = "") -> list[dict[str, str]]:
    """One row per option of ``cls`` (nested dataclasses flattened with dotted names): name, type, default,
    allowed values and the description (the field's ``doc``, else the class docstring's ``name:`` line)."""
    docs = _attribute_docs(cls.__doc__ or "")
    rows: list[dict[str, str]] = []
    for f in dataclasses.fields(cls):
        default = (
            f.default
            if f.default is not MISSING
            else (f.default_factory() if f.default_factory is not MISSING else None)
        )
        if dataclasses.is_dataclass(default):
            rows.extend(describe_options(type(default), f"{prefix}{f.name}."))
            continue
        rows.append(
            {
                "name": f"{prefix}{f.name}",
                "type": _type_name(f, cls),
                "default": repr(default),
                "allowed": _constraint(f.metadata) if f.metadata else "",
                "doc": (f.metadata.get("doc") if f.metadata else "") or docs.get(f.name, ""),
            }
        )
    return rows


def _attribute_docs(doc: str) -> dict[str, str]:
    """``name: text`` entries of a Google-style docstring (continuation lines joined)."""
    out: dict[str, str] = {}
    current = None
    for raw in doc.splitlines():
        line = raw.strip()
        head, sep, rest = line.partition(":")
        if sep and head and " " not in head and head.isidentifier():
            current = head
            out[current] = rest.strip()
        elif current and line and not line.endswith(":"):
            out[current] = f"{out[current]} {line}".strip()
        elif not line:
            current = None
    return out
