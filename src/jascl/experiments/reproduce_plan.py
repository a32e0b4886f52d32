"""The plan of ``jascl reproduce``: a paper table's cells grouped into compare jobs, and the cells that cannot run.

A table (:mod:`jascl.paper.tables`) is split into *jobs*: the cells that share a protocol, a number of
sessions, a backbone and configuration overrides run as one :func:`jascl.experiments.compare.run_compare`
(one run folder per seed, the methods that do not change session 0 sharing its base model).

Cells that cannot run say why, instead of disappearing from the table:

* ``not registered``: the paper's method has no jascl implementation (yet);
* ``no protocol``: the table's protocol is not built in;
* ``not supported``: a setting the configuration refuses (the message says which);
* ``not runnable``: tables of kind ``other`` and cells without a session or method (the compute table has
  its own runner, :mod:`jascl.experiments.reproduce_compute`);
* ``not in stand-in``: with ``--stand-in``, a class row or session the embedded benchmark lacks.

Settings the paper states outside its tables are applied here, where a table does not set them itself:
every SAM run trains :data:`PAPER_EPOCHS_BY_BACKBONE` epochs per session ("All SAM experiments were run for
10 epochs", implementation details, line 2285); the other backbones keep their protocol's epochs, which are
the paper's (medical 200, natural and surgery 100 per session; DeepLab is the natural protocols' default
backbone, so its rows run 100 like the text says).

With ``--stand-in`` the table's method list runs on the embedded benchmark it names (``stand_in``:
``synthetic-2d`` or ``synthetic-2d-ss``), with that benchmark's own backbone, epochs and sizes and only the
row and column settings of the table (e.g. ``gas.eps``), so the whole path is exercised on a laptop.

Two settings are protocol keys, applied to the job's protocol rather than to the run configuration:
``unlabelled_noise`` (the pools' noise schedule) and ``unlabelled_extra: N`` (table ``tab:unlabeled_effect``):
N unlabelled samples borrowed by the column's session from the earlier sessions' sources, split evenly over
those sessions (remainder to the first) and then over each one's sources
(:func:`jascl.protocols.variants.with_unlabelled_extra`). In ``med-ss`` session 4 (BraTS) 42 resolves to
``unlabelled_sources`` TotalSegmentator 11, AMOS 11, BCV 10, MOTS 10 (hepatic vessel 4, colon 3, lung 3); on
the stand-in ``synthetic-2d-ss`` to the earlier sessions' domains (session 3: ct, mri, us, 14 each).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any

from jascl.errors import ConfigError, JasclError
from jascl.paper.tables import Cell, PaperTable
from jascl.results.fidelity import footnotes
from jascl.results.reproduce_table import PERCENT_METRICS

#: what a method's paper row needs beyond the run configuration (printed with the plan)
METHOD_NEEDS = {
    "clip-driven": "the paper's row is the universal model pre-trained on 14 datasets: give its released weights with "
    "--weights (jascl weights fetch clip-driven-swin-unetr, with --backbone swinunetr; the paper's U-Net release fits "
    "no jascl backbone); without them the row is the model trained from scratch",
    "halo": "active learning: its oracle reveals the pool's ground truth of the acquired pixels (budget "
    "method_args.halo.budget of the pool's pixels per session; oracle=false: self-training)",
}

#: override prefixes that only concern a method's incremental sessions (JASCL's settings, a baseline's options,
#: the incremental sessions' freezing, epochs and rate): jobs that differ only in these share one session-0 base
METHOD_ONLY_PREFIXES = (
    "method_args.",
    "gas.",
    "pas.",
    "components.",
    "freeze_incremental=",
    "epochs_incremental=",
    "lr_incremental=",
)

#: metrics a run measures per session (Total Drop and retention, in percent, are derived from them)
SESSION_METRICS = ("dice", "miou", "map")
STATUS_PLANNED = "planned"

#: epochs per session the paper states for a backbone whatever the protocol ("All SAM experiments were run
#: for 10 epochs", line 2285); applied to every session where the table sets no epochs itself
PAPER_EPOCHS_BY_BACKBONE = {"sam-vitb": 10}

#: the base-session model every method starting from the shared base uses
VANILLA_BASE = "vanilla"


@dataclasses.dataclass
class Job:
    """One compare run: every cell with this protocol, session count, backbone and overrides."""

    key: str
    protocol: str
    sessions: int | None
    overrides: tuple[str, ...]
    shots: int | None
    methods: list[str] = dataclasses.field(default_factory=list)
    noise: str | None = None
    #: ``unlabelled_extra``: (session, samples) borrowed from the earlier sessions' sources, and how they resolve
    unlabelled_extra: tuple[int, int] | None = None
    borrowed: tuple[tuple[str, int], ...] = ()

    def describe(self) -> str:
        parts = [self.protocol]
        if self.sessions:
            parts.append(f"first {self.sessions} sessions")
        if self.shots is not None:
            parts.append(f"K={self.shots}")
        if self.noise:
            parts.append(f"unlabelled_noise={self.noise}")
        if self.unlabelled_extra is not None:
            session, count = self.unlabelled_extra
            lent = ", ".join(f"{name} {n}" for name, n in self.borrowed)
            parts.append(f"session {session} borrows {count} unlabelled ({lent})")
        parts.extend(self.overrides)
        return ", ".join(parts)


@dataclasses.dataclass
class PlannedCell:
    cell: Cell
    status: str = STATUS_PLANNED
    job: str | None = None
    reason: str = ""


@dataclasses.dataclass
class Plan:
    """The jobs of a table and every cell's status; ``quick``: the documented quick mode (fewer epochs, one
    seed; :data:`QUICK_EPOCH_DIVISOR`)."""

    table: PaperTable
    stand_in: bool
    jobs: dict[str, Job]
    cells: list[PlannedCell]
    quick: bool = False

    @property
    def planned(self) -> list[PlannedCell]:
        """The cells a run measures."""
        return [p for p in self.cells if p.status == STATUS_PLANNED]


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "-", text).strip("-")[:80] or "job"


def _override_text(key: str, value: Any) -> str:
    if isinstance(value, bool):
        value = str(value).lower()
    return f"{key}={value}"


@cache
def _protocol_training(name: str) -> tuple[str, Mapping[str, Any]]:
    """(task, training section) of the built-in protocol ``name`` (segmentation, {} when it cannot be read)."""
    from jascl.protocols import builtin_protocols, load_protocol

    path = builtin_protocols().get(name)
    if path is None:
        return "segmentation", {}
    try:
        protocol = load_protocol(path)
    except JasclError:
        return "segmentation", {}
    return protocol.task, dict(protocol.training)


def paper_epochs(backbone: str | None, settings: Mapping[str, Any]) -> list[str]:
    """The ``epochs_base`` / ``epochs_incremental`` overrides the paper's text gives ``backbone`` (SAM: 10 per
    session), for the keys ``settings`` (the cell's own) do not set."""
    epochs = PAPER_EPOCHS_BY_BACKBONE.get(backbone or "")
    if epochs is None:
        return []
    return [f"{key}={epochs}" for key in ("epochs_base", "epochs_incremental") if key not in settings]


def plan_table(
    table: PaperTable,
    *,
    stand_in: bool = False,
    quick: bool = False,
    methods: Sequence[str] | None = None,
    protocols: Sequence[str] | None = None,
    check_config: Callable[[str, Sequence[str]], None] | None = None,
) -> Plan:
    """Group the table's cells into jobs; mark the cells that cannot run, with the reason.

    Args:
        table: the paper table.
        stand_in: run on the table's embedded stand-in benchmark instead of its protocol.
        quick: the quick mode (recorded in the plan; the run applies it).
        methods: registered method names (default: jascl's registry).
        protocols: built-in protocol names (default: jascl's).
        check_config: ``(protocol, overrides) -> None``; raises :class:`ConfigError` on overrides the
            configuration refuses (default: resolve the protocol's configuration with them).
    """
    methods_given = methods
    if methods is None:
        from jascl.methods import METHODS

        methods = list(METHODS.list())
    if protocols is None:
        from jascl.protocols import builtin_protocols

        protocols = list(builtin_protocols())
    if check_config is None:
        check_config = _check_config
    if stand_in and not table.stand_in:
        raise ConfigError(f"table {table.label} names no stand_in benchmark; run it on its protocol")
    jobs: dict[str, Job] = {}
    planned: list[PlannedCell] = []
    refused: dict[tuple[str, tuple[str, ...]], str] = {}
    for cell in table.cells():
        p = PlannedCell(cell)
        planned.append(p)
        if table.kind in ("compute", "other") or cell.metric not in (*SESSION_METRICS, *PERCENT_METRICS):
            p.status, p.reason = (
                "not runnable",
                ("a compute table: its own runner" if table.kind == "compute" else f"metric {cell.metric}"),
            )
            continue
        if cell.metric != "total_drop" and cell.session is None:
            p.status, p.reason = "not runnable", "the column names no session"
            continue
        if not cell.method:
            p.status, p.reason = "not runnable", "no method"
            continue
        if cell.method not in methods:
            p.status, p.reason = "not registered", f"{cell.method} is not a registered method"
            continue
        protocol = table.stand_in if stand_in else cell.protocol
        if not protocol or protocol not in protocols:
            p.status, p.reason = "no protocol", f"{cell.protocol or 'no protocol'} is not a built-in protocol"
            continue
        task, training = _protocol_training(protocol)
        if task != "segmentation" and methods_given is None:
            from jascl.methods import METHODS

            if cell.method not in METHODS.task_methods(task):
                p.status, p.reason = "not registered", f"{cell.method} has no {task} implementation"
                continue
        settings = dict(cell.set)
        sessions = cell.sessions
        if stand_in:  # only the row's and column's settings: the table-level ones are the paper's sizes
            settings = {k: v for k, v in cell.set.items() if table.set.get(k, _UNSET) != v}
            available = stand_in_sessions(protocol)
            if (cell.session or 0) >= available:
                p.status, p.reason = "not in stand-in", f"{protocol} has {available} sessions"
                continue
            sessions = None if sessions is None or sessions >= available else sessions
        shots = settings.pop("shots", None)
        noise = settings.pop("unlabelled_noise", None)  # a protocol key: the pools' noise schedule
        if noise is not None and noise not in ("none", "moderate", "heavy"):
            p.status, p.reason = "not supported", f"unlabelled_noise={noise}: one of none, moderate, heavy"
            continue
        extra = settings.pop("unlabelled_extra", None)  # a protocol key: unlabelled samples from earlier sessions
        borrowed: tuple[tuple[str, int], ...] = ()
        if extra is not None:
            try:
                borrowed = resolve_unlabelled_extra(protocol, cell.session, extra)
            except JasclError as exc:
                p.status, p.reason = "not supported", str(exc)
                continue
        overrides = [_override_text(k, v) for k, v in sorted(settings.items())]
        if cell.backbone and not stand_in:
            overrides.append(f"backbone={cell.backbone}")
            if (
                cell.backbone != training.get("backbone")
                and training.get("backbone_args")
                and not any(k.startswith("backbone_args") for k in settings)
            ):  # the protocol's backbone_args belong to its own backbone (as --backbone does)
                overrides.insert(0, "backbone_args={}")
        if not stand_in:
            overrides += paper_epochs(cell.backbone or training.get("backbone"), settings)
        if cell.eval_mode:
            overrides.append(f"eval_mode={cell.eval_mode}")
        key = (protocol, tuple(overrides))
        if key not in refused:
            try:
                check_config(protocol, overrides)
                refused[key] = ""
            except JasclError as exc:
                refused[key] = str(exc)
        if refused[key]:
            p.status, p.reason = "not supported", refused[key]
            continue
        parts = [
            Path(protocol).stem,
            *overrides,
            *([f"first{sessions}"] if sessions else []),
            *([f"K{shots}"] if shots else []),
            *([f"noise-{noise}"] if noise else []),
            *([f"s{cell.session}extra{extra}"] if extra is not None else []),
        ]
        name = _slug("_".join(parts))
        job = jobs.get(name)
        if job is None:
            job = jobs[name] = Job(
                key=name,
                protocol=protocol,
                sessions=sessions,
                overrides=tuple(overrides),
                shots=None if shots is None else int(shots),
                noise=noise,
                unlabelled_extra=None if extra is None else (int(cell.session or 0), int(extra)),
                borrowed=borrowed,
            )
        if cell.method not in job.methods:
            job.methods.append(cell.method)
        p.job = name
    return Plan(table=table, stand_in=stand_in, jobs=jobs, cells=planned, quick=quick)


_UNSET = object()


def resolve_unlabelled_extra(protocol: str, session: int | None, count: Any) -> tuple[tuple[str, int], ...]:
    """``unlabelled_extra: count`` in session ``session`` of ``protocol``: (source, samples) pairs it borrows.

    Raises:
        ConfigError: not a non-negative integer, no session column, or a session with no earlier source.
    """
    from jascl.protocols import get_protocol, with_unlabelled_extra

    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ConfigError(f"unlabelled_extra={count!r}: a non-negative number of unlabelled samples")
    if session is None:
        raise ConfigError("unlabelled_extra: the column names no session to add the samples to")
    resolved = with_unlabelled_extra(get_protocol(protocol), session, count)
    return tuple((u.name, u.count) for u in resolved.sessions[session].unlabelled_sources)


def stand_in_sessions(protocol: str) -> int:
    """The number of sessions of a built-in protocol."""
    from jascl.protocols import get_protocol

    return len(get_protocol(protocol).sessions)


def _check_config(protocol: str, overrides: Sequence[str]) -> None:
    from jascl.engine.config import resolve_config
    from jascl.protocols import get_protocol

    proto = get_protocol(protocol)
    resolve_config(proto.training, proto.path, None, list(overrides))


def base_key(job: Job) -> tuple:
    """What a job's session-0 base depends on: jobs with equal keys share one base model.

    Not the unlabelled pools (``noise``, ``unlabelled_extra``): session 0 has none and its data do not change."""
    return (job.protocol, job.shots, tuple(o for o in job.overrides if not o.startswith(METHOD_ONLY_PREFIXES)))


@cache
def method_base(name: str) -> str:
    """The session-0 model method ``name`` starts from: :data:`VANILLA_BASE` (the shared base), a keyed base
    shared by a family (e.g. ``"stochastic-classifier"``, JASCL's), or ``""`` (it trains its own)."""
    from jascl.engine.config import RunConfig
    from jascl.methods.registry import create_method

    try:
        method = create_method(name, RunConfig())
    except JasclError:  # a method whose options need a run's configuration: counted as sharing the base
        return VANILLA_BASE
    return VANILLA_BASE if not method.changes_base_session else (method.base_key or "")


def base_groups(methods: Sequence[str]) -> dict[str, list[str]]:
    """Methods by the session-0 model they start from (:func:`method_base`)."""
    groups: dict[str, list[str]] = {}
    for m in methods:
        groups.setdefault(method_base(m), []).append(m)
    return groups


def root_names_of(plan: Plan) -> dict[str, list[str]]:
    """Dataset root name -> the jobs whose protocol reads it."""
    from jascl.data.real.roots import root_names
    from jascl.protocols import get_protocol

    names: dict[str, list[str]] = {}
    for job in plan.jobs.values():
        for name in root_names(get_protocol(job.protocol)):
            names.setdefault(name, []).append(job.key)
    return names


def check_roots(plan: Plan, roots: Mapping[str, Any] | None) -> None:
    """Refuse ``--root`` names no job of the plan reads, as the run would (``--dry-run`` checks them too).

    Each job then gets the roots its own protocol reads (:func:`roots_for`), so a table over several protocols
    (the CIL / DIL / CDIL tables) takes every root once.

    Raises:
        ConfigError: one line naming the first unknown root and the roots the table's protocols read.
    """
    given = sorted(roots or {})
    if not given:
        return
    known = root_names_of(plan)
    unknown = [n for n in given if n not in known]
    if unknown:
        where = (
            "the stand-in benchmarks read no dataset"
            if plan.stand_in
            else f"the table's protocols read {', '.join(sorted(known)) or 'no dataset root'}"
        )
        raise ConfigError(f"--root {unknown[0]}=...: no job of {plan.table.label} reads a root of that name ({where})")


def roots_for(job: Job, roots: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The given roots that ``job``'s protocol reads (None when none were given)."""
    if roots is None:
        return None
    from jascl.data.real.roots import root_names
    from jascl.protocols import get_protocol

    names = root_names(get_protocol(job.protocol))
    return {k: v for k, v in roots.items() if k in names}


def describe_plan(plan: Plan, seeds: Sequence[int]) -> list[str]:
    """The ``--dry-run`` text: jobs, which methods share a base, their fidelity labels and the skipped cells (the GPU-hour estimate
    follows: :func:`jascl.experiments.reproduce_cost.describe_estimate`)."""
    t = plan.table
    lines = [
        f"{t.label}: {t.caption}",
        f"  {len(plan.cells)} cells, {len(plan.planned)} to measure; seeds {', '.join(map(str, seeds))}"
        + (f"; stand-in {t.stand_in}" if plan.stand_in else "")
        + ("; QUICK mode (fewer epochs, one seed: not the paper's setting)" if plan.quick else ""),
    ]
    for job in plan.jobs.values():
        lines.append(f"  job {job.key}: {job.describe()}")
        for key, members in base_groups(job.methods).items():
            if key == VANILLA_BASE:
                lines.append(f"    share one session-0 base: {', '.join(members)}")
            elif key:
                lines.append(f"    share the {key} session-0 base: {', '.join(members)}")
            else:
                lines.append(f"    train their own session 0: {', '.join(members)}")
    planned = list(dict.fromkeys(m for job in plan.jobs.values() for m in job.methods))
    if planned:  # each method's fidelity label, and what its paper row needs beyond the configuration
        lines += [f"  {line}" for line in footnotes(planned)]
        lines += [f"  {m}: {METHOD_NEEDS[m]}" for m in planned if m in METHOD_NEEDS]
    skipped: dict[str, list[str]] = {}
    for p in plan.cells:
        if p.status != STATUS_PLANNED:
            skipped.setdefault(f"{p.status}: {p.reason}", []).append(p.cell.row)
    for reason, rows in skipped.items():
        unique = list(dict.fromkeys(rows))
        lines.append(f"  skipped ({reason}): {', '.join(unique)}")
    if not plan.jobs:
        lines.append("  nothing to run")
    return lines


#: the quick mode trains this fraction of every session's epochs (at least one) on one seed
QUICK_EPOCH_DIVISOR = 4


def quick_epochs(epochs_base: int, epochs_incremental: int) -> tuple[int, int]:
    """Epochs of the quick mode: a :data:`QUICK_EPOCH_DIVISOR`-th of each (at least 1)."""
    return max(1, epochs_base // QUICK_EPOCH_DIVISOR), max(1, epochs_incremental // QUICK_EPOCH_DIVISOR)


def job_protocol(job: Job):
    """The protocol a job runs: its first ``sessions``, K shots, noise schedule and borrowed unlabelled data."""
    from jascl.experiments.sweep import with_shots
    from jascl.protocols import get_protocol
    from jascl.protocols.variants import renamed_variant

    protocol = get_protocol(job.protocol)
    if job.sessions is not None and job.sessions < len(protocol.sessions):
        protocol = renamed_variant(
            protocol, f"{protocol.name}-first{job.sessions}", sessions=protocol.sessions[: job.sessions]
        )
    if job.shots is not None:
        protocol = with_shots(protocol, job.shots)
    if job.noise is not None:
        protocol = dataclasses.replace(protocol, unlabelled_noise=job.noise)
    if job.unlabelled_extra is not None:
        from jascl.protocols import with_unlabelled_extra

        protocol = with_unlabelled_extra(protocol, *job.unlabelled_extra)
    return protocol
