"""Name -> factory registries (backbones, methods, dataset layouts), in the style of timm, listable without imports.

A module registers its entries when it is imported (``@BACKBONES.register("unet", doc=...)``). For the
registries behind ``jascl methods`` and ``jascl backbones`` importing every module would cost seconds and
most of a gigabyte (torch, MONAI, torchvision, segmentation-models-pytorch ...), so they also read an
*index*: ``registry_index.json`` beside this module, written from the registrations themselves
(``python tools/registry_index.py``), which names for every entry the module that registers it and its
description. With an index:

* :meth:`Registry.list`, :meth:`Registry.describe` and ``in`` read it and import nothing;
* :meth:`Registry.get` imports the entry's module the first time the entry is used;
* a name the index lacks (a method added since the index was written) makes :meth:`Registry.get` import every
  module of the registry's packages (:meth:`Registry.load_all`) before refusing it, so a stale index never
  hides an entry from a run; a name close to a listed one (a misspelling: :func:`did_you_mean`) is refused at
  once with the suggestion, nothing imported; ``tests/test_registry_index.py`` compares the index with the registrations,
  entry by entry, so it cannot drift;
* a module of the user's (``--import``) registers as before; a name the index gives to another module is
  refused as registered twice, as it was when every built-in module was imported first.
"""

from __future__ import annotations

import fnmatch
import functools
import importlib
import json
import pkgutil
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Generic, TypeVar

from jascl.errors import ConfigError

T = TypeVar("T")

#: the index of the indexed registries: section (:attr:`Registry.index_section`) -> name -> record
INDEX_FILE = Path(__file__).with_name("registry_index.json")


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """``" (did you mean 'jascl'?)"`` for the closest of ``choices`` to a misspelt ``name`` (difflib's ratio at
    least 0.6, case ignored), or "" when none is close. Nothing is imported: give the registry's :meth:`Registry.list`."""
    import difflib

    options = {c.lower(): c for c in choices}
    close = difflib.get_close_matches(str(name).lower(), list(options), n=2, cutoff=0.6)
    if not close:
        return ""
    return " (did you mean " + " or ".join(repr(options[c]) for c in close) + "?)"


@functools.cache
def read_index(path: Path = INDEX_FILE) -> dict[str, dict[str, dict[str, Any]]]:
    """The stored index (section -> name -> record), read once per process; {} where the file is missing."""
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def index_of(registries: Iterable[Registry[Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """The index the registrations make, once every module of each registry's packages is imported."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for registry in registries:
        registry.load_all()
        assert registry.index_section is not None, f"the {registry.kind} registry has no index section"
        out[registry.index_section] = registry.records()
    return out


class Registry(Generic[T]):
    """A named collection of factories with a decorator to register entries.

    Args:
        kind: what the registry holds ("backbone", "method"), used in messages.
        index_section: its section of the index (None: not indexed; every entry comes from an imported module).
        packages: the packages whose modules register its entries (what :meth:`load_all` imports).
        index_file: the index (the shipped one by default; tests give their own).
    """

    def __init__(
        self, kind: str, index_section: str | None = None, packages: Sequence[str] = (), index_file: Path = INDEX_FILE
    ) -> None:
        self.kind = kind
        self.index_section = index_section
        self.packages = tuple(packages)
        self._index_file = index_file
        self._entries: dict[str, Callable[..., T]] = {}
        #: what the index stores of every registered entry: its module, its description, and what subclasses add
        self._records: dict[str, dict[str, Any]] = {}
        self._unregistered: set[str] = set()  # indexed names unregistered in this process

    def _stored(self) -> dict[str, dict[str, Any]]:
        if self.index_section is None:
            return {}
        return read_index(self._index_file).get(self.index_section, {})

    def _record(self, name: str) -> dict[str, Any] | None:
        """``name``'s record: from its registration if its module is imported, else from the index; None if neither."""
        if name in self._records:
            return self._records[name]
        if name in self._unregistered:
            return None
        return self._stored().get(name)

    def register(
        self, name: str, doc: str | None = None, *, module: str | None = None
    ) -> Callable[[Callable[..., T]], Callable[..., T]]:
        """Decorator registering ``fn`` under ``name``.

        Args:
            doc: the one-line description (default: the first line of ``fn``'s docstring).
            module: the module that registers it (default ``fn.__module__``): what :meth:`get` imports.
        """

        def decorator(fn: Callable[..., T]) -> Callable[..., T]:
            origin = module or fn.__module__
            known = self._record(name)
            if name in self._entries or (known is not None and known["module"] != origin):
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._entries[name] = fn
            text = doc if doc is not None else (fn.__doc__ or "").strip().splitlines()
            self._records[name] = {
                "module": origin,
                "doc": text if isinstance(text, str) else (text[0] if text else ""),
            }
            return fn

        return decorator

    def unregister(self, name: str) -> None:
        """Remove ``name`` (e.g. to register a new version of it in a notebook, or after a test)."""
        self.get(name)
        del self._entries[name]
        del self._records[name]
        if name in self._stored():
            self._unregistered.add(name)

    def load_all(self) -> None:
        """Import every module of the registry's packages (but those named ``_...``, which register nothing), so
        that every entry is registered: what the index is written from, and the fallback for a name it lacks."""
        for package in self.packages:
            root = importlib.import_module(package)
            for found in pkgutil.walk_packages(root.__path__, prefix=f"{package}."):
                if not any(part.startswith("_") for part in found.name.split(".")):
                    importlib.import_module(found.name)

    def _load(self, name: str) -> bool:
        """Register ``name`` if it is not yet: import its module (by the index), else every module; True if it is."""
        if name in self._entries:
            return True
        record = self._record(name)
        if record is not None:
            importlib.import_module(record["module"])
        elif did_you_mean(name, self.list()):
            return False  # a misspelling of a listed name: refused at once, nothing imported
        if name not in self._entries:
            self.load_all()
        return name in self._entries

    def get(self, name: str) -> Callable[..., T]:
        """The factory of ``name``, its module imported if need be; a one-line ConfigError for an unknown name."""
        if not self._load(name):
            known = self.list()
            raise ConfigError(
                f"unknown {self.kind} {name!r}{did_you_mean(name, known)}; choose one of: {', '.join(known)}"
            )
        return self._entries[name]

    def create(self, name: str, **kwargs) -> T:
        return self.get(name)(**kwargs)

    def list(self, pattern: str = "*") -> list[str]:
        """The registered names matching ``pattern`` (indexed ones included, imported or not)."""
        names = set(self._entries) | (set(self._stored()) - self._unregistered)
        return sorted(n for n in names if fnmatch.fnmatch(n, pattern))

    def describe(self, name: str) -> str:
        record = self._record(name)
        return record["doc"] if record is not None else ""

    def module(self, name: str) -> str:
        """The module that registers ``name`` ("" for an unknown name); nothing is imported."""
        record = self._record(name)
        return record["module"] if record is not None else ""

    def records(self) -> dict[str, dict[str, Any]]:
        """The index records of the registered entries (those of imported modules), by name."""
        return {name: dict(self._records[name]) for name in sorted(self._records)}

    def __contains__(self, name: str) -> bool:
        return self._record(name) is not None
