"""The method registry: a name -> factory that builds a :class:`Method` for a run configuration.

Register a method with its typed options (:mod:`jascl.methods.options`); the
registry reads and checks them from ``method_args.<key>`` and hands them to the
factory::

    @METHODS.register("ewc", options=EWCOptions, paper="Kirkpatrick et al., PNAS 2017",
                      doc="baseline: elastic weight consolidation")
    def ewc(options: EWCOptions, config: RunConfig) -> Method:
        return Method("ewc", [EWCPlugin(options)])

A factory registered without ``options`` takes the configuration alone
(``fn(config) -> Method``). ``jascl methods`` lists the registry, ``jascl methods
NAME`` prints one method's options, paper and notes (:func:`describe_method`).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jascl.engine.config import RunConfig
from jascl.engine.plugin import Method
from jascl.errors import ConfigError
from jascl.methods.options import describe_options, read_options
from jascl.registry import Registry

#: a factory as the registry stores it: the resolved run configuration -> the method
MethodFactory = Callable[[RunConfig], Method]


@dataclass(frozen=True)
class MethodInfo:
    """What the registry knows of a method besides its factory.

    Attributes:
        name: the registered name (``--methods``).
        doc: one line for ``jascl methods``.
        options: the options dataclass (None: the method has none).
        options_key: ``method_args.<options_key>`` holds its options (methods of one family can share a key).
        paper: the original paper (authors, venue, year).
        notes: the factory's docstring: what the method does here and how it deviates from the paper.
    """

    name: str
    doc: str
    options: type | None
    options_key: str
    paper: str
    notes: str


class MethodRegistry(Registry[Method]):
    """A :class:`~jascl.registry.Registry` of method factories that also keeps each method's options and paper."""

    def __init__(self) -> None:
        super().__init__("method")
        self._info: dict[str, MethodInfo] = {}

    def register(
        self,
        name: str,
        doc: str | None = None,
        *,
        options: type | None = None,
        options_key: str | None = None,
        paper: str = "",
    ) -> Callable[[Callable[..., Method]], Callable[..., Method]]:
        """Decorator registering ``fn``: ``fn(options, config)`` with ``options``, else ``fn(config)``."""
        key = options_key or name

        def decorator(fn: Callable[..., Method]) -> Callable[..., Method]:
            factory: MethodFactory
            if options is None:
                factory = fn
            else:

                def factory(config: RunConfig) -> Method:
                    return fn(read_options(options, config, key), config)

                factory.__doc__ = fn.__doc__
                factory.__module__ = fn.__module__  # where the method lives (its family, for jascl methods --paper)
            super(MethodRegistry, self).register(name, doc)(factory)
            self._info[name] = MethodInfo(
                name, self.describe(name), options, key, paper, inspect.cleandoc(fn.__doc__ or "")
            )
            return fn

        return decorator

    def unregister(self, name: str) -> None:
        super().unregister(name)
        self._info.pop(name, None)

    def info(self, name: str) -> MethodInfo:
        """The registered :class:`MethodInfo` of ``name`` (a one-line ConfigError for an unknown name)."""
        self.get(name)
        return self._info[name]


#: every registered method (the modules of :mod:`jascl.methods` register theirs when imported)
METHODS = MethodRegistry()


def create_method(name: str, config: RunConfig) -> Method:
    """The registered method ``name`` built for ``config``."""
    return METHODS.create(name, config=config)


def check_method_args(config: RunConfig) -> None:
    """Read every options block of ``config.method_args`` with its registered options class, so that an unknown
    key, a bad value or a block no method reads stops the run at once with one line, whichever methods run.

    Raises:
        ConfigError: ``method_args.<key>...: ...`` (see :func:`jascl.methods.options.read_options`).
    """
    classes = {i.options_key: i.options for i in METHODS._info.values() if i.options is not None}
    for key in config.method_args:
        if key in classes:
            read_options(classes[key], config, key)
        elif key not in METHODS:  # (a method without an options class checks its own block when it is built)
            known = ", ".join(sorted(set(classes) | set(METHODS.list())))
            raise ConfigError(
                f"method_args.{key}: no registered method reads these options; the options blocks are: {known}"
            )


def resolved_options(name: str, config: RunConfig) -> dict[str, Any] | None:
    """The options ``name`` runs with under ``config`` (defaults updated from ``method_args``), as JSON values
    (``{}`` for a registered method without options; None for a name the registry does not know, e.g. an
    ablation built from a preset)."""
    info = METHODS._info.get(name)
    if info is None:
        return None
    if info.options is None:
        return {}
    options: Any = read_options(info.options, config, info.options_key)
    return json.loads(json.dumps(dataclasses.asdict(options), default=str))


def describe_method(name: str) -> dict[str, Any]:
    """``name``'s description, paper, notes and options table (rows of name, type, default, allowed, doc)."""
    info = METHODS.info(name)
    return {
        "name": name,
        "doc": info.doc,
        "paper": info.paper,
        "notes": info.notes,
        "options_key": info.options_key,
        "options": describe_options(info.options) if info.options is not None else [],
    }
