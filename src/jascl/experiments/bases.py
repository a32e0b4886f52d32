"""Session-0 models that several methods of a run folder start from, and their training.

A run folder holds at most these shared bases (:func:`base_folders`):

* ``<out>/base``: the vanilla session-0 model of every method that leaves session 0 alone;
* ``<out>/base-<key>``: the session-0 model of the methods that change session 0 alike
  (:attr:`jascl.engine.plugin.Method.base_key`, e.g. the JASCL presets' stochastic classifier), trained by the
  plugins that change it (:meth:`jascl.engine.plugin.Method.base_method`).

A method that changes session 0 in a way of its own has no shared base; its session 0 is one of its sessions.
A base is complete when its ``metrics.json`` exists (:func:`missing_bases`). ``jascl run`` trains each base in its
process when the first method that starts from it comes; a launcher (:mod:`jascl.experiments.launcher`) trains
every missing base of every seed as a job of its own, and starts a method's cell once its base is complete.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from jascl import distributed
from jascl.data.types import SessionData
from jascl.engine.config import RunConfig
from jascl.engine.loop import ContinualTrainer
from jascl.engine.plugin import Method, Plugin
from jascl.engine.prototypes import PrototypeStore
from jascl.errors import ConfigError
from jascl.protocols.schema import Protocol

#: the folder of the vanilla shared base
VANILLA = "base"


def base_folders(methods: Sequence[Method]) -> dict[str, list[Method]]:
    """The shared bases ``methods`` start from: folder name (``base``, ``base-<key>``) -> the methods starting from
    it, in the order of ``methods``; bases in the order their first method is listed."""
    out: dict[str, list[Method]] = {}
    for m in methods:
        if not m.changes_base_session:
            out.setdefault(VANILLA, []).append(m)
        elif m.base_key is not None:
            out.setdefault(f"base-{m.base_key}", []).append(m)
    return out


def restorers(members: Sequence[Method]) -> list[Plugin]:
    """The plugins of ``members`` (the methods that start from one shared base) whose restore of the base asks for
    prototypes (:meth:`Plugin.restore_requests`): the base's trainer answers them ahead (:func:`ensure_base`)."""
    return [p for m in members for p in m.plugins if type(p).restore_requests is not Plugin.restore_requests]


def missing_bases(out: str | Path, methods: Sequence[Method]) -> dict[str, list[str]]:
    """The shared bases of ``methods`` not complete in the run folder ``out``: folder name -> the names of the
    methods that start from it."""
    return {
        name: [m.name for m in members]
        for name, members in base_folders(methods).items()
        if not (Path(out) / name / "metrics.json").exists()
    }


def ensure_base(
    protocol: Protocol,
    config: RunConfig,
    data: Sequence[SessionData],
    base_dir: Path,
    progress: bool = True,
    echo=print,
    method: Method | None = None,
    plugins: Sequence[Plugin] = (),
    anticipate: Sequence[Plugin] = (),
) -> None:
    """Train the shared session-0 model into ``base_dir`` unless it is already complete there.

    ``method``: the plugins that train a keyed shared base (:meth:`Method.base_method`); default none
    (the vanilla base every method that leaves session 0 alone shares). ``plugins``: added after the
    method's (the run's progress display). ``anticipate``: the plugins of the methods that start from the base
    (:func:`restorers`), whose restores' prototype calls the base's own pass answers ahead, into its prototype
    cache. A base stopped part-way continues from its progress checkpoint."""
    if distributed.broadcast_object((base_dir / "metrics.json").exists()):
        return
    method = method or Method("base")
    echo(f"session 0 ({protocol.sessions[0].name}): training the shared base model {base_dir.name}")
    trainer = ContinualTrainer(
        protocol, config, method, list(data), progress=progress, extra_plugins=plugins, anticipate=anticipate
    )
    trainer.run_session(0, trainer.initial_model(len(protocol.seen_classes(0))), PrototypeStore(), base_dir)
    distributed.barrier()  # rank 0 has written it before anyone reads it


def train_bases(
    protocol: Protocol,
    config: RunConfig,
    data: Sequence[SessionData],
    out: Path,
    methods: Sequence[Method],
    names: Sequence[str] | None = None,
    progress: bool = True,
    echo=print,
    plugins: Sequence[Plugin] = (),
) -> None:
    """Train the shared bases of ``methods`` into the run folder ``out`` (those named in ``names``; None: all),
    each unless complete.

    Raises:
        ConfigError: a name that is not a base of ``methods`` (a launcher's job built from another method list).
    """
    folders = base_folders(methods)
    unknown = sorted(set(names or ()) - set(folders))
    if unknown:
        raise ConfigError(
            f"{out}: {', '.join(unknown)} is not a shared base of the methods "
            f"{', '.join(m.name for m in methods)} (theirs: {', '.join(folders) or 'none'})"
        )
    for name, members in folders.items():
        if names is None or name in names:
            method = None if name == VANILLA else members[0].base_method()
            ensure_base(protocol, config, data, out / name, progress, echo, method, plugins, restorers(members))
