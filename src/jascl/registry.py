"""Name -> factory registries (backbones, methods, plugins), in the style of timm."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from typing import Generic, TypeVar

from jascl.errors import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    """A named collection of factories with a decorator to register entries.

    Args:
        kind: what the registry holds ("backbone", "method"), used in messages.
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, Callable[..., T]] = {}
        self._docs: dict[str, str] = {}

    def register(self, name: str, doc: str | None = None) -> Callable[[Callable[..., T]], Callable[..., T]]:
        """Decorator registering ``fn`` under ``name``."""

        def decorator(fn: Callable[..., T]) -> Callable[..., T]:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._entries[name] = fn
            text = doc if doc is not None else (fn.__doc__ or "").strip().splitlines()
            self._docs[name] = text if isinstance(text, str) else (text[0] if text else "")
            return fn

        return decorator

    def unregister(self, name: str) -> None:
        """Remove ``name`` (e.g. to register a new version of it in a notebook, or after a test)."""
        self.get(name)
        del self._entries[name]
        self._docs.pop(name, None)

    def get(self, name: str) -> Callable[..., T]:
        if name not in self._entries:
            known = ", ".join(sorted(self._entries))
            raise ConfigError(f"unknown {self.kind} {name!r}; choose one of: {known}")
        return self._entries[name]

    def create(self, name: str, **kwargs) -> T:
        return self.get(name)(**kwargs)

    def list(self, pattern: str = "*") -> list[str]:
        return sorted(n for n in self._entries if fnmatch.fnmatch(n, pattern))

    def describe(self, name: str) -> str:
        return self._docs.get(name, "")

    def __contains__(self, name: str) -> bool:
        return name in self._entries
