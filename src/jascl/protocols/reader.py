"""The checks every part of a protocol is read with: one-line errors naming the file and the key."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from jascl.errors import ConfigError


class _Reader:
    """Walks a YAML mapping and reports problems as ``file: key.path: message``."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, key: str, message: str) -> ConfigError:
        return ConfigError(f"{self.source}: {key}: {message}" if key else f"{self.source}: {message}")

    def mapping(self, value: Any, key: str, allowed: set[str], required: Collection[str] = frozenset()) -> dict:
        if not isinstance(value, Mapping):
            raise self.fail(key, f"must be a mapping (got {type(value).__name__})")
        for k in value:
            if k not in allowed:
                raise self.fail(
                    f"{key}.{k}" if key else str(k), f"unknown key; allowed keys: {', '.join(sorted(allowed))}"
                )
        for k in sorted(required):
            if k not in value:
                raise self.fail(f"{key}.{k}" if key else k, "is required")
        return dict(value)

    def integer(self, value: Any, key: str, minimum: int | None = None) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(key, f"must be an integer (got {value!r})")
        if minimum is not None and value < minimum:
            raise self.fail(key, f"must be >= {minimum} (got {value})")
        return value

    def number(self, value: Any, key: str, lo: float | None = None, hi: float | None = None) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(key, f"must be a number (got {value!r})")
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise self.fail(key, f"must be in [{lo}, {hi}] (got {value})")
        return float(value)

    def string(self, value: Any, key: str, choices: tuple[str, ...] | None = None) -> str:
        if not isinstance(value, str) or not value:
            raise self.fail(key, f"must be a non-empty string (got {value!r})")
        if choices is not None and value not in choices:
            raise self.fail(key, f"must be one of {', '.join(choices)} (got {value!r})")
        return value

    def int_list(self, value: Any, key: str) -> tuple[int, ...]:
        if not isinstance(value, list):
            raise self.fail(key, f"must be a list of class ids (got {value!r})")
        return tuple(self.integer(v, f"{key}[{i}]", minimum=0) for i, v in enumerate(value))


def _free_mapping(r: _Reader, value: Any, key: str) -> dict:
    """A mapping whose keys are checked by its consumer (a layout, a preprocessing function)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise r.fail(key, f"must be a mapping (got {value!r})")
    return dict(value)


def _string_list(r: _Reader, value: Any, key: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise r.fail(key, f"must be a list of split names (got {value!r})")
    return tuple(r.string(v, f"{key}[{i}]") for i, v in enumerate(value))
