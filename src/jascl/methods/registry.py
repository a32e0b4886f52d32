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

Methods compose by name: ``jascl+gaps`` (any ``a+b+...`` of registered names) is the
plugins of ``jascl`` followed by those of ``gaps``, each part built from its own
options block, so ``--set method_args.gaps...`` and ``--ablate`` (which sets
``method_args.jascl.components``) act on the composed method as on its parts.
:func:`compose_methods` refuses two parts that own the same thing -- the same
plugin type, the same default plugin replaced, the optimiser, or different
freezing policies -- with one line naming both. A composition can also be
registered under its name (:meth:`MethodRegistry.register_composition`) so that it
is listed and tested like every method.

A method is registered for the segmentation task. Another task (detection, :mod:`jascl.engine.tasks`) gets its own
implementation under the same name and options block with ``task=``::

    @METHODS.register("jascl", options=JasclOptions, options_key="jascl", task="detection")

:func:`create_method` builds the one for the protocol's task; a method without an implementation for it is
refused with one line listing those that have one (:meth:`MethodRegistry.task_methods`).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jascl.engine.config import RunConfig
from jascl.engine.plugin import Method, Plugin
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
        parts: for a composed method (``a+b``), the registered names it is made of; () otherwise.
    """

    name: str
    doc: str
    options: type | None
    options_key: str
    paper: str
    notes: str
    parts: tuple[str, ...] = ()


#: separates the parts of a composed method's name
COMPOSE = "+"


def composed_parts(name: str) -> list[str] | None:
    """The parts of a composed name (``"jascl+gaps"`` -> ``["jascl", "gaps"]``), None for a plain name."""
    if COMPOSE not in name:
        return None
    return [part.strip() for part in name.split(COMPOSE)]


def compose_methods(name: str, parts: list[tuple[str, Method]]) -> Method:
    """One method made of the plugins of ``parts`` (in order), or a one-line ConfigError where two parts own the
    same thing: a plugin type both contain, a default plugin both replace, the optimiser (both supply one), or
    the incremental freezing policy (both set one, differently).

    Args:
        name: the composed method's name (``a+b``).
        parts: ``(registered name, built method)`` per part.
    """
    owners: dict[str, tuple[str, str]] = {}  # what is owned -> (part, plugin)

    def claim(thing: str, part: str, plugin: Plugin, what: str) -> None:
        if thing in owners and owners[thing][0] != part:
            other_part, other_plugin = owners[thing]
            raise ConfigError(
                f"method {name}: {other_part} (plugin {other_plugin!r}) and {part} (plugin {plugin.name!r}) both "
                f"{what}; compose methods that do not overlap"
            )
        owners.setdefault(thing, (part, plugin.name))

    freeze: dict[str, tuple[str, str]] = {}
    for part, method in parts:
        for plugin in method.plugins:
            claim(
                f"type:{type(plugin).__module__}.{type(plugin).__qualname__}",
                part,
                plugin,
                f"contain the {type(plugin).__name__} component",
            )
            for default in plugin.replaces:
                claim(f"replaces:{default}", part, plugin, f"replace the loop's {default!r} plugin")
            if type(plugin).make_optimizer is not Plugin.make_optimizer:
                claim("optimizer", part, plugin, "supply the optimiser")
            if plugin.freeze_incremental is not None:
                freeze.setdefault(plugin.freeze_incremental, (part, plugin.name))
    if len(freeze) > 1:
        (a, (pa, na)), (b, (pb, nb)) = list(freeze.items())[:2]
        raise ConfigError(
            f"method {name}: {pa} (plugin {na!r}) freezes {a!r} and {pb} (plugin {nb!r}) freezes {b!r} in "
            f"incremental sessions; set one of them with --set method_args.<method>.freeze=..."
        )
    descriptions = " + ".join(method.description or part for part, method in parts)
    return Method(name, [p for _, method in parts for p in method.plugins], descriptions)


class MethodRegistry(Registry[Method]):
    """A :class:`~jascl.registry.Registry` of method factories that also keeps each method's options and paper."""

    def __init__(self) -> None:
        super().__init__("method")
        self._info: dict[str, MethodInfo] = {}
        #: implementations for tasks other than segmentation: task -> name -> factory
        self._task_entries: dict[str, dict[str, MethodFactory]] = {}

    def register(
        self,
        name: str,
        doc: str | None = None,
        *,
        options: type | None = None,
        options_key: str | None = None,
        paper: str = "",
        task: str = "segmentation",
    ) -> Callable[[Callable[..., Method]], Callable[..., Method]]:
        """Decorator registering ``fn``: ``fn(options, config)`` with ``options``, else ``fn(config)``.

        ``task``: the task this implementation serves; one other than "segmentation" registers beside the
        segmentation method of the same name (whose options block, paper and notes ``jascl methods`` shows)."""
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
            if task != "segmentation":
                entries = self._task_entries.setdefault(task, {})
                if name in entries:
                    raise ValueError(f"method {name!r} is already registered for the {task} task")
                entries[name] = factory
                return fn
            super(MethodRegistry, self).register(name, doc)(factory)
            self._info[name] = MethodInfo(
                name, self.describe(name), options, key, paper, inspect.cleandoc(fn.__doc__ or "")
            )
            return fn

        return decorator

    def register_composition(self, name: str, doc: str | None = None, *, paper: str = "") -> None:
        """Register the composed method ``name`` (``a+b``, parts already registered) so that it is listed, shown
        by ``jascl methods`` and run by the registry-wide tests like any method."""
        parts = composed_parts(name)
        if not parts:
            raise ValueError(f"{name!r} is not a composed name (a{COMPOSE}b)")
        factory = self._composed_factory(name, parts)
        super().register(name, doc or factory.__doc__)(factory)
        self._info[name] = self._composed_info(name, parts, doc, paper)

    def _composed_factory(self, name: str, parts: list[str]) -> MethodFactory:
        for part in parts:
            if not part or composed_parts(part) is not None or part not in self._entries:
                known = ", ".join(sorted(self._entries))
                raise ConfigError(
                    f"unknown method {part!r} in {name!r}: compose registered methods as a{COMPOSE}b; choose from: {known}"
                )
        if len(set(parts)) < len(parts):
            raise ConfigError(f"method {name!r} names a part twice")
        entries = [self._entries[p] for p in parts]

        def factory(config: RunConfig) -> Method:
            return compose_methods(name, [(p, make(config)) for p, make in zip(parts, entries)])

        factory.__doc__ = f"the plugins of {' then '.join(parts)}, each with its own options"
        factory.__module__ = entries[0].__module__
        return factory

    def _composed_info(self, name: str, parts: list[str], doc: str | None = None, paper: str = "") -> MethodInfo:
        infos = [self._info[p] for p in parts if p in self._info]
        papers = "; ".join(dict.fromkeys(i.paper for i in infos if i.paper))
        notes = "\n\n".join(f"{i.name}: {i.notes}" for i in infos if i.notes)
        return MethodInfo(
            name,
            doc or f"composition: {' + '.join(parts)} (the plugins of each, each part with its own options)",
            None,
            "",
            paper or papers,
            notes,
            tuple(parts),
        )

    def get(self, name: str) -> MethodFactory:
        """The factory of ``name``; a composed name (``a+b``) gives one that builds :func:`compose_methods`."""
        parts = composed_parts(name)
        if parts is None or name in self._entries:
            return super().get(name)
        return self._composed_factory(name, parts)

    def __contains__(self, name: str) -> bool:
        parts = composed_parts(name)
        if parts is None or name in self._entries:
            return name in self._entries
        return len(set(parts)) == len(parts) and all(p in self._entries and p for p in parts)

    def unregister(self, name: str) -> None:
        super().unregister(name)
        self._info.pop(name, None)

    def task_methods(self, task: str) -> list[str]:
        """The methods with an implementation for ``task`` (every registered one for segmentation)."""
        if task == "segmentation":
            return self.list()
        return sorted(self._task_entries.get(task, {}))

    def create_for_task(self, task: str, name: str, config: RunConfig) -> Method:
        """``name``'s implementation for ``task`` (a composed name from its parts' implementations).

        Raises:
            ConfigError: one line naming the method, the task and the methods that have an implementation.
        """
        if task == "segmentation":
            return self.create(name, config=config)
        entries = self._task_entries.get(task, {})
        parts = composed_parts(name) or [name]
        for part in parts:
            if part not in entries:
                known = ", ".join(sorted(entries)) or "none"
                raise ConfigError(
                    f"method {part!r} has no {task} implementation (this protocol's task); {task} methods: {known}"
                )
        if len(parts) == 1:
            return entries[name](config)
        if len(set(parts)) < len(parts):
            raise ConfigError(f"method {name!r} names a part twice")
        return compose_methods(name, [(p, entries[p](config)) for p in parts])

    def info(self, name: str) -> MethodInfo:
        """The registered :class:`MethodInfo` of ``name`` (a one-line ConfigError for an unknown name); a
        composed name's is made from its parts' (no options class of its own: ``options_key`` is "")."""
        self.get(name)
        if name not in self._info:
            parts = composed_parts(name)
            assert parts is not None
            return self._composed_info(name, parts)
        return self._info[name]


#: every registered method (the modules of :mod:`jascl.methods` register theirs when imported)
METHODS = MethodRegistry()


def create_method(name: str, config: RunConfig, task: str = "segmentation") -> Method:
    """The registered method ``name`` built for ``config``, in its implementation for ``task`` (the protocol's)."""
    return METHODS.create_for_task(task, name, config)


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
    if info is None and name in METHODS and composed_parts(name):
        info = METHODS.info(name)
    if info is None:
        return None
    if info.parts:  # a composed method: each part's options under its own key
        out: dict[str, Any] = {}
        for part in info.parts:
            key = METHODS.info(part).options_key
            if key not in out:
                part_options = resolved_options(part, config)
                if part_options:
                    out[key] = part_options
        return out
    if info.options is None:
        return {}
    options: Any = read_options(info.options, config, info.options_key)
    return json.loads(json.dumps(dataclasses.asdict(options), default=str))


def describe_method(name: str) -> dict[str, Any]:
    """``name``'s description, paper, notes and options table (rows of name, type, default, allowed, doc).

    A composed method has no options block of its own (``options_key`` ""): its rows are its parts' options,
    named ``<part's options key>.<option>`` (``jascl.gas.eps``), i.e. relative to ``method_args``.
    """
    info = METHODS.info(name)
    if info.parts:
        rows: list[dict[str, Any]] = []
        keys: set[str] = set()
        for part in info.parts:
            sub = describe_method(part)
            if sub["options_key"] in keys:
                continue
            keys.add(sub["options_key"])
            rows.extend({**row, "name": f"{sub['options_key']}.{row['name']}"} for row in sub["options"])
        options = rows
    else:
        options = describe_options(info.options) if info.options is not None else []
    return {
        "name": name,
        "doc": info.doc,
        "paper": info.paper,
        "notes": info.notes,
        "options_key": info.options_key,
        "options": options,
    }
