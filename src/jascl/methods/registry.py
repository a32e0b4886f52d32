"""The method registry: a name -> factory that builds a :class:`Method` for a run configuration.

Register a method with its typed options (:mod:`jascl.methods.options`); the
registry reads and checks them from ``method_args.<key>`` and hands them to the
factory::

    @METHODS.register("ewc", options=EWCOptions, paper="Kirkpatrick et al., PNAS 2017",
                      doc="baseline: elastic weight consolidation", fidelity='faithful')
    def ewc(options: EWCOptions, config: RunConfig) -> Method:
        return Method("ewc", [EWCPlugin(options)])

A factory registered without ``options`` takes the configuration alone
(``fn(config) -> Method``). ``jascl methods`` lists the registry, ``jascl methods
NAME`` prints one method's options, paper and notes (:func:`describe_method`).

The registry lists its methods from the registry index (:mod:`jascl.registry`): what the decorator was given,
and the module it ran in, for every method of every task (:class:`MethodSummary`). Listing, ``in`` and
:meth:`MethodRegistry.summary` import nothing; building a method or reading its options class and notes
(:meth:`MethodRegistry.info`) imports its module first.

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
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from jascl.engine.config import RunConfig
from jascl.engine.plugin import Method, Plugin
from jascl.errors import ConfigError
from jascl.methods.fidelity import Fidelity, check_fidelity, combine
from jascl.methods.options import describe_options, read_options
from jascl.registry import Registry, did_you_mean, read_index

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
        fidelity: ``faithful``, ``simplified: <what>`` or ``reconstructed: <from what>`` (:mod:`jascl.methods.fidelity`).
        flags: setting flags (``uses exemplars``, ``test-time domain oracle``, ...).
    """

    name: str
    doc: str
    options: type | None
    options_key: str
    paper: str
    notes: str
    parts: tuple[str, ...] = ()
    fidelity: str = ""
    flags: tuple[str, ...] = ()


@dataclass(frozen=True)
class MethodSummary:
    """What the registry index holds of a method: enough to list it, without importing its module.

    Attributes:
        name: the registered name.
        doc: one line for ``jascl methods``.
        paper: the original paper (authors, venue, year).
        options_key: ``method_args.<options_key>`` holds its options ("" for a composed method).
        options: the qualified name of its options dataclass ("" without one).
        module: the module that registers it (imported when the method is first used).
        parts: for a composed method (``a+b``), the registered names it is made of; () otherwise.
        fidelity: the fidelity label (:mod:`jascl.methods.fidelity`); "" when not stated.
        flags: setting flags.
    """

    name: str
    doc: str
    paper: str
    options_key: str
    options: str
    module: str
    parts: tuple[str, ...] = ()
    fidelity: str = ""
    flags: tuple[str, ...] = ()


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
    """A :class:`~jascl.registry.Registry` of method factories that also keeps each method's options and paper.

    This registry holds the segmentation implementations; :meth:`for_task` gives the registry of another task's
    (its index section ``methods.<task>``), which ``register(..., task=...)`` fills.
    """

    def __init__(self, task: str = "segmentation", packages: tuple[str, ...] = ("jascl.methods",)) -> None:
        segmentation = task == "segmentation"
        super().__init__(
            "method" if segmentation else f"{task} method", "methods" if segmentation else f"methods.{task}", packages
        )
        self.task = task
        self._info: dict[str, MethodInfo] = {}
        #: the registries of other tasks' implementations, by task
        self._tasks: dict[str, MethodRegistry] = {}

    def for_task(self, task: str) -> MethodRegistry:
        """The registry of ``task``'s implementations (this one for its own task)."""
        if task == self.task:
            return self
        if task not in self._tasks:
            self._tasks[task] = MethodRegistry(task, self.packages)
        return self._tasks[task]

    def task_registries(self) -> list[MethodRegistry]:
        """This registry and those of every other task with an implementation (indexed or registered)."""
        tasks = {s.split(".", 1)[1] for s in read_index(self._index_file) if s.startswith("methods.")}
        return [self, *(self.for_task(t) for t in sorted(tasks | set(self._tasks)))]

    def register(  # type: ignore[override]  # the method registry's decorator takes the options, paper and task
        self,
        name: str,
        doc: str | None = None,
        *,
        options: type | None = None,
        options_key: str | None = None,
        paper: str = "",
        task: str = "segmentation",
        fidelity: str = "",
        flags: Sequence[str] = (),
    ) -> Callable[[Callable[..., Method]], Callable[..., Method]]:
        """Decorator registering ``fn``: ``fn(options, config)`` with ``options``, else ``fn(config)``.

        ``task``: the task this implementation serves; one other than "segmentation" registers beside the
        segmentation method of the same name (whose options block, paper and notes ``jascl methods`` shows).
        ``fidelity`` and ``flags``: how close it is to its source (:mod:`jascl.methods.fidelity`)."""
        if task != self.task:
            return self.for_task(task).register(
                name,
                doc,
                options=options,
                options_key=options_key,
                paper=paper,
                task=task,
                fidelity=fidelity,
                flags=flags,
            )
        check_fidelity(name, fidelity, flags)
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
            Registry.register(self, name, doc, module=fn.__module__)(factory)
            qualified = f"{options.__module__}.{options.__qualname__}" if options is not None else ""
            self._records[name].update(
                paper=paper, options_key=key, options=qualified, parts=[], fidelity=fidelity, flags=list(flags)
            )
            self._info[name] = MethodInfo(
                name,
                self.describe(name),
                options,
                key,
                paper,
                inspect.cleandoc(fn.__doc__ or ""),
                fidelity=fidelity,
                flags=tuple(flags),
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
        module = sys._getframe(1).f_globals.get("__name__", "")  # the registering module: what get() imports
        summary = self._composed_summary(name, parts, doc, paper, module)
        Registry.register(self, name, summary.doc, module=module)(factory)
        self._records[name].update(
            paper=summary.paper,
            options_key="",
            options="",
            parts=list(parts),
            fidelity=summary.fidelity,
            flags=list(summary.flags),
        )

    def _registered(self, name: str) -> bool:
        """``name`` is registered (indexed or imported) under its own name, composition or not."""
        return self._record(name) is not None

    def _composed_factory(self, name: str, parts: list[str]) -> MethodFactory:
        for part in parts:
            if not part or composed_parts(part) is not None or not (self._registered(part) or self._load(part)):
                known = ", ".join(self.list())
                raise ConfigError(
                    f"unknown method {part!r}{did_you_mean(part, self.list())} in {name!r}: compose registered "
                    f"methods as a{COMPOSE}b; choose from: {known}"
                )
        if len(set(parts)) < len(parts):
            raise ConfigError(f"method {name!r} names a part twice")

        def factory(config: RunConfig) -> Method:
            return compose_methods(name, [(p, self.get(p)(config)) for p in parts])

        factory.__doc__ = f"the plugins of {' then '.join(parts)}, each with its own options"
        factory.__module__ = self.module(parts[0])
        return factory

    def _composed_summary(
        self, name: str, parts: list[str], doc: str | None = None, paper: str = "", module: str = ""
    ) -> MethodSummary:
        summaries = [self.summary(p) for p in parts]
        fid = combine([(s.name, Fidelity(s.fidelity, s.flags)) for s in summaries])
        return MethodSummary(
            name,
            doc or f"composition: {' + '.join(parts)} (the plugins of each, each part with its own options)",
            paper or "; ".join(dict.fromkeys(s.paper for s in summaries if s.paper)),
            "",
            "",
            module or summaries[0].module,
            tuple(parts),
            fid.label,
            fid.flags,
        )

    def get(self, name: str) -> MethodFactory:
        """The factory of ``name``; a composed name (``a+b``) gives one that builds :func:`compose_methods`."""
        parts = composed_parts(name)
        if parts is None or self._registered(name):
            return super().get(name)
        return self._composed_factory(name, parts)

    def __contains__(self, name: str) -> bool:
        parts = composed_parts(name)
        if parts is None or self._registered(name):
            return self._registered(name)
        return len(set(parts)) == len(parts) and all(p and self._registered(p) for p in parts)

    def unregister(self, name: str) -> None:
        super().unregister(name)
        self._info.pop(name, None)

    def task_methods(self, task: str) -> list[str]:
        """The methods with an implementation for ``task`` (every registered one for segmentation)."""
        return self.for_task(task).list()

    def create_for_task(self, task: str, name: str, config: RunConfig) -> Method:
        """``name``'s implementation for ``task`` (a composed name from its parts' implementations).

        Raises:
            ConfigError: one line naming the method, the task and the methods that have an implementation.
        """
        if task == self.task:
            return self.create(name, config=config)
        registry = self.for_task(task)
        parts = composed_parts(name) or [name]
        for part in parts:
            if not (registry._registered(part) or registry._load(part)):
                known = ", ".join(registry.list()) or "none"
                raise ConfigError(
                    f"method {part!r} has no {task} implementation (this protocol's task); {task} methods: {known}"
                )
        if len(parts) == 1:
            return registry.get(name)(config)
        if len(set(parts)) < len(parts):
            raise ConfigError(f"method {name!r} names a part twice")
        return compose_methods(name, [(p, registry.get(p)(config)) for p in parts])

    def summary(self, name: str) -> MethodSummary:
        """What the index holds of ``name`` (doc, paper, options block, module, parts), without importing it; a
        composed name's is made from its parts'. A one-line ConfigError for an unknown name."""
        record = self._record(name)
        if record is None:
            parts = composed_parts(name)
            if parts is None or name not in self:
                self.get(name)  # the one-line error (or, for a method the index lacks, its registration)
                return self.summary(name)
            return self._composed_summary(name, parts)
        return MethodSummary(
            name,
            record["doc"],
            record["paper"],
            record["options_key"],
            record["options"],
            record["module"],
            tuple(record["parts"]),
            record.get("fidelity", ""),
            tuple(record.get("flags", ())),
        )

    def info(self, name: str) -> MethodInfo:
        """The registered :class:`MethodInfo` of ``name`` (its module imported; a one-line ConfigError for an
        unknown name); a composed name's is made from its parts' (no options class of its own: ``options_key``
        is "")."""
        self.get(name)
        if name in self._info:
            return self._info[name]
        summary = self.summary(name)
        notes = "\n\n".join(f"{p}: {i.notes}" for p in summary.parts if (i := self.info(p)).notes)
        return MethodInfo(
            name, summary.doc, None, "", summary.paper, notes, summary.parts, summary.fidelity, summary.flags
        )


#: every registered method (listed from the registry index; each module of :mod:`jascl.methods` registers its
#: methods when imported, which :meth:`MethodRegistry.get` does on first use)
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
    readers: dict[str, str] = {}  # options block -> a method that reads it (the index says; nothing imported)
    for name in METHODS.list():
        summary = METHODS.summary(name)
        if summary.options:
            readers.setdefault(summary.options_key, name)
    for key in config.method_args:
        if key in readers:
            options = METHODS.info(readers[key]).options
            assert options is not None
            read_options(options, config, key)
        elif key not in METHODS:  # (a method without an options class checks its own block when it is built)
            known = ", ".join(sorted(set(readers) | set(METHODS.list())))
            raise ConfigError(
                f"method_args.{key}: no registered method reads these options; the options blocks are: {known}"
            )


def resolved_options(name: str, config: RunConfig) -> dict[str, Any] | None:
    """The options ``name`` runs with under ``config`` (defaults updated from ``method_args``), as JSON values
    (``{}`` for a registered method without options; None for a name the registry does not know, e.g. an
    ablation built from a preset)."""
    if name not in METHODS:
        return None
    info = METHODS.info(name)
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
        "fidelity": info.fidelity,
        "flags": list(info.flags),
        "notes": info.notes,
        "options_key": info.options_key,
        "options": options,
    }
