"""``jascl reproduce``: run one of the paper's tables and print the published number beside the measured one.

A table (:mod:`jascl.paper.tables`) is split into *jobs*: the cells that share a protocol,
a number of sessions, a backbone and configuration overrides run as one
:func:`jascl.experiments.compare.run_compare` (one run folder per seed, the methods that
do not change session 0 sharing its base model). Every cell then gets its measured value,
mean ± std over the seeds, from that job's results, in the table's own unit (``scale``).

Cells that cannot run say why, instead of disappearing from the table:

* ``not registered``: the paper's method has no jascl implementation (yet);
* ``no protocol``: the table's protocol is not built in (e.g. ``coco-o``);
* ``not supported``: a setting the configuration refuses (the message says which);
* ``not runnable``: compute tables (``jascl model-info``) and tables of kind ``other``;
* ``not in stand-in``: with ``--stand-in``, a class row whose class the embedded benchmark lacks.

With ``--stand-in`` the table's method list runs on the embedded benchmark it names
(``stand_in``: ``synthetic-2d`` or ``synthetic-2d-ss``), with that benchmark's own backbone,
epochs and sizes and only the row and column settings of the table (e.g. ``gas.eps``),
so the whole path is exercised on a laptop; the published numbers are then only a
reference point, not a target.

Two settings are protocol keys, applied to the job's protocol rather than to the run
configuration: ``unlabelled_noise`` (the pools' noise schedule) and ``unlabelled_extra: N``
(table ``tab:unlabeled_effect``): N unlabelled samples borrowed by the column's session from
the earlier sessions' sources, split evenly over those sessions (remainder to the first) and
then over each one's sources (:func:`jascl.protocols.variants.with_unlabelled_extra`). In
``med-ss`` session 4 (BraTS) 42 resolves to ``unlabelled_sources`` TotalSegmentator 11, AMOS 11,
BCV 10, MOTS 10 (hepatic vessel 4, colon 3, lung 3); on the stand-in ``synthetic-2d-ss`` to the
earlier sessions' domains (session 3: ct, mri, us, 14 each).

Folder layout::

    <out>/<job>/seed-<s>/...      one compare folder per job (see jascl.experiments.compare)
    <out>/reproduce.{md,csv,json}
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from jascl.errors import ConfigError, JasclError
from jascl.experiments.compare import mean_std
from jascl.paper.tables import Cell, PaperTable
from jascl.results.fidelity import footnotes
from jascl.results.records import RunResults
from jascl.results.reproduce_table import PERCENT_METRICS, write_reproduce

#: training hours per session on one GPU, from the paper's compute table ("Computational analysis for
#: Session 1", JASCL column): Med JASCL-Disjoint 4h 06m (U-Net), Med Semi-Supervised-JASCL 5h 18m
#: (MedFormer), Natural-JASCL 1h 43m (SAM ViT-B). The estimate assumes every session costs the same.
HOURS_PER_SESSION = {"med": 4.1, "med-ss": 5.3, "natural": 1.72}

#: what a method's paper row needs beyond the run configuration (printed with the plan)
METHOD_NEEDS = {
    "clip-driven": "the paper's row is the universal model pre-trained on 14 datasets: give its released weights with "
    "--weights (jascl weights fetch clip-driven-swin-unetr, with --backbone swinunetr; the paper's U-Net release fits "
    "no jascl backbone); without them the row is the model trained from scratch",
    "halo": "active learning: its oracle reveals the pool's ground truth of the acquired pixels (budget "
    "method_args.halo.budget of the pool's pixels per session; oracle=false: self-training)",
}

#: override prefixes that only concern a method's incremental sessions (JASCL's settings, a baseline's options):
#: jobs that differ only in these share one session-0 base model
METHOD_ONLY_PREFIXES = ("method_args.", "gas.", "pas.", "components.")

SESSION_METRICS = ("dice", "miou", "map")
STATUS_PLANNED = "planned"


def _family(protocol: str) -> str | None:
    if protocol.startswith("synthetic") or protocol.startswith("bench"):
        return None
    if protocol == "coco-o":  # a dataset protocol whose compute the paper does not give
        return "coco-o"
    if protocol == "med-ss":
        return "med-ss"
    for prefix in ("med", "natural", "surgery"):
        if protocol.startswith(prefix):
            return prefix
    return None


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
    table: PaperTable
    stand_in: bool
    jobs: dict[str, Job]
    cells: list[PlannedCell]


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "-", text).strip("-")[:80] or "job"


def _override_text(key: str, value: Any) -> str:
    if isinstance(value, bool):
        value = str(value).lower()
    return f"{key}={value}"


def _protocol_task(name: str) -> str:
    """The task of the built-in protocol ``name`` (segmentation when it cannot be read)."""
    from jascl.protocols import builtin_protocols, load_protocol

    path = builtin_protocols().get(name)
    if path is None:
        return "segmentation"
    try:
        return load_protocol(path).task
    except JasclError:
        return "segmentation"


def plan_table(
    table: PaperTable,
    *,
    stand_in: bool = False,
    methods: Sequence[str] | None = None,
    protocols: Sequence[str] | None = None,
    check_config: Callable[[str, Sequence[str]], None] | None = None,
) -> Plan:
    """Group the table's cells into jobs; mark the cells that cannot run, with the reason.

    Args:
        table: the paper table.
        stand_in: run on the table's embedded stand-in benchmark instead of its protocol.
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
                ("a compute table: see `jascl model-info`" if table.kind == "compute" else f"metric {cell.metric}"),
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
        task = _protocol_task(protocol)
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
    return Plan(table=table, stand_in=stand_in, jobs=jobs, cells=planned)


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


def estimate_gpu_hours(plan: Plan, seeds: int) -> tuple[float, list[str]]:
    """GPU-hours of the plan from the paper's compute table (:data:`HOURS_PER_SESSION`), every shared base
    (vanilla's, or a family's keyed one) counted once per base and seed, and the protocols the table gives no
    time for (not counted)."""
    total = 0.0
    unknown: list[str] = []
    bases: set[tuple] = set()
    for job in plan.jobs.values():
        family = _family(job.protocol)
        if family is None or family not in HOURS_PER_SESSION:
            unknown.append(job.protocol)
            continue
        from jascl.protocols import get_protocol

        n = job.sessions or len(get_protocol(job.protocol).sessions)
        groups = _base_groups(job.methods)
        own_base = len(groups.get("", []))
        shared = len(job.methods) - own_base
        keyed = [(base_key(job), k) for k in groups if k not in ("", VANILLA_BASE)]
        new_keyed = [k for k in keyed if k not in bases]  # a keyed base (JASCL's) is shared across jobs too
        new_base = VANILLA_BASE in groups and base_key(job) not in bases
        bases.update([base_key(job), *keyed])
        sessions = (1 if new_base else 0) + len(new_keyed) + shared * (n - 1) + own_base * n
        total += sessions * HOURS_PER_SESSION[family] * seeds
    return total, sorted(set(unknown))


VANILLA_BASE = "vanilla"


def _base_groups(methods: Sequence[str]) -> dict[str, list[str]]:
    """Methods by the session-0 model they start from: ``"vanilla"`` (the shared base), a keyed base shared
    by a family (e.g. ``"stochastic-classifier"``, JASCL's), or ``""`` (each trains its own)."""
    from jascl.engine.config import RunConfig
    from jascl.methods.registry import create_method

    groups: dict[str, list[str]] = {}
    for m in methods:
        try:
            method = create_method(m, RunConfig())
            key = VANILLA_BASE if not method.changes_base_session else (method.base_key or "")
        except JasclError:  # a method whose options need a run's configuration: counted as sharing the base
            key = VANILLA_BASE
        groups.setdefault(key, []).append(m)
    return groups


def describe_plan(plan: Plan, seeds: Sequence[int]) -> list[str]:
    """The ``--dry-run`` text: jobs, which methods share a base, skipped cells, and the GPU-hour estimate."""
    t = plan.table
    lines = [
        f"{t.label}: {t.caption}",
        f"  {len(plan.cells)} cells, {sum(p.status == STATUS_PLANNED for p in plan.cells)} to measure; "
        f"seeds {', '.join(map(str, seeds))}" + (f"; stand-in {t.stand_in}" if plan.stand_in else ""),
    ]
    for job in plan.jobs.values():
        lines.append(f"  job {job.key}: {job.describe()}")
        for key, members in _base_groups(job.methods).items():
            if key == VANILLA_BASE:
                lines.append(f"    share one session-0 base: {', '.join(members)}")
            elif key:
                lines.append(f"    share the {key} session-0 base: {', '.join(members)}")
            else:
                lines.append(f"    train their own session 0: {', '.join(members)}")
    planned = list(dict.fromkeys(m for job in plan.jobs.values() for m in job.methods))
    if planned:
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
    hours, unknown = estimate_gpu_hours(plan, len(seeds))
    embedded = [p for p in unknown if _family(p) is None and Path(p).stem.startswith(("synthetic", "bench"))]
    if hours:
        lines.append(
            f"  estimate: about {hours:.0f} GPU-hours (the paper's compute table: hours per session "
            f"{', '.join(f'{k} {v}' for k, v in HOURS_PER_SESSION.items())}; every session costed like session 1)"
        )
    if embedded:
        lines.append(f"  {', '.join(embedded)}: an embedded benchmark, minutes per method on a CPU")
    if len(unknown) > len(embedded):
        lines.append(
            f"  no time in the paper for {', '.join(p for p in unknown if p not in embedded)} (not in the estimate)"
        )
    return lines


def _job_protocol(job: Job):
    from jascl.experiments.sweep import with_shots
    from jascl.protocols import get_protocol

    protocol = get_protocol(job.protocol)
    if job.sessions is not None and job.sessions < len(protocol.sessions):
        protocol = dataclasses.replace(
            protocol, sessions=protocol.sessions[: job.sessions], name=f"{protocol.name}-first{job.sessions}"
        )
    if job.shots is not None:
        protocol = with_shots(protocol, job.shots)
    if job.noise is not None:
        protocol = dataclasses.replace(protocol, unlabelled_noise=job.noise)
    if job.unlabelled_extra is not None:
        from jascl.protocols import with_unlabelled_extra

        protocol = with_unlabelled_extra(protocol, *job.unlabelled_extra)
    return protocol


def run_plan(
    plan: Plan,
    seeds: Sequence[int],
    out: str | Path,
    *,
    overrides: Sequence[str] = (),
    echo: Callable[[str], None] = print,
    **compare_kwargs: Any,
) -> dict[str, dict[int, RunResults]]:
    """Run (or reuse) every job for every seed; returns job -> seed -> results."""
    from jascl.engine.config import resolve_config
    from jascl.experiments.compare import run_compare

    out = Path(out)
    results: dict[str, dict[int, RunResults]] = {}
    first_with_base: dict[tuple, Job] = {}
    for i, job in enumerate(plan.jobs.values()):
        echo(f"[reproduce] job {i + 1}/{len(plan.jobs)}: {job.describe()} — {', '.join(job.methods)}")
        owner = first_with_base.setdefault(base_key(job), job)
        if owner is not job:
            for seed in seeds:
                source = out / owner.key / f"seed-{seed}"
                for base in sorted(source.glob("base*")) if source.is_dir() else []:  # base, base-<key>
                    _share_base(base, out / job.key / f"seed-{seed}" / base.name)
        protocol = _job_protocol(job)
        config = resolve_config(protocol.training, protocol.path, None, [*job.overrides, *overrides])
        run_compare(protocol, config, job.methods, seeds, out / job.key, echo=echo, **compare_kwargs)
        results[job.key] = {s: RunResults.read(out / job.key / f"seed-{s}" / "results.json") for s in seeds}
    return results


def _share_base(source: Path, link: Path) -> None:
    """Point ``link`` at an earlier job's finished base model (a relative symlink, else a copy)."""
    import os
    import shutil

    if link.exists() or not (source / "metrics.json").exists():
        return
    link.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.symlink(os.path.relpath(source, link.parent), link)
    except OSError:
        shutil.copytree(source, link)


def _measure_one(cell: Cell, res: RunResults) -> float:
    """The cell's quantity in one seed's results, as a fraction (NaN where the run has no such value)."""
    m = res.methods.get(str(cell.method))
    if m is None:
        return math.nan
    if cell.metric == "total_drop":
        return float(m.total_drop)
    if cell.session is None or cell.session >= len(m.sessions):
        return math.nan
    record = m.sessions[cell.session]
    if cell.metric == "retention":
        return 100.0 * record.pseudo_label_value("coverage")
    if cell.class_id is not None:
        return float(record.per_class.get(str(cell.class_id), math.nan))
    return float(record.all)


def measure(plan: Plan, results: Mapping[str, Mapping[int, RunResults]]) -> dict[str, Any]:
    """Published beside measured for every cell: ``{"table", "stand_in", "seeds", "cells": [...]}``.

    A cell's measured value is the mean ± sample std over seeds, in the table's unit (scores times
    ``scale``; Total Drop in percent as published); ``delta`` = measured mean − published.
    """
    t = plan.table
    seeds: list[int] = sorted({s for per_seed in results.values() for s in per_seed})
    cells = []
    for p in plan.cells:
        c = p.cell
        entry: dict[str, Any] = {
            "row": c.row,
            "column": c.column,
            "method": c.method,
            "metric": c.metric,
            "published": c.value,
            "status": p.status,
            "reason": p.reason,
            "job": p.job,
            "measured": None,
            "std": None,
            "values": [],
            "delta": None,
        }
        if p.status == STATUS_PLANNED and p.job is not None and p.job in results:
            factor = 1.0 if c.metric in PERCENT_METRICS else t.scale
            values = [_measure_one(c, results[p.job][s]) * factor for s in sorted(results[p.job])]
            mean, std = mean_std(values)
            if c.class_id is not None and plan.stand_in and all(math.isnan(v) for v in values):
                entry["status"], entry["reason"] = "not in stand-in", f"class {c.class_id} is not in {t.stand_in}"
            elif not math.isnan(mean):
                entry.update(
                    measured=mean,
                    std=std,
                    values=values,
                    status="measured",
                    delta=None if c.value is None else mean - c.value,
                )
            else:
                entry["status"], entry["reason"] = "missing", "the run has no value for this cell"
        cells.append(entry)
    return {
        "table": t.label,
        "caption": t.caption,
        "metric": t.metric,
        "scale": t.scale,
        "stand_in": t.stand_in if plan.stand_in else None,
        "seeds": seeds,
        "notes": list(t.notes),
        "cells": cells,
    }


def run_reproduce(
    table: PaperTable,
    seeds: Sequence[int],
    out: str | Path,
    *,
    stand_in: bool = False,
    overrides: Sequence[str] = (),
    echo: Callable[[str], None] = print,
    protocols: Sequence[str] | None = None,
    **compare_kwargs: Any,
) -> dict[str, Any]:
    """Plan, run and measure ``table``; write ``reproduce.{md,csv,json}`` into ``out`` and return the summary.

    ``protocols``: the protocol names (or YAML paths) a table may name, default the built-in ones."""
    plan = plan_table(table, stand_in=stand_in, protocols=protocols)
    if not plan.jobs:
        reasons = sorted({f"{p.status} ({p.reason})" for p in plan.cells})
        raise ConfigError(f"table {table.label}: no cell can run here: {'; '.join(reasons)}")
    results = run_plan(plan, seeds, out, overrides=overrides, echo=echo, **compare_kwargs)
    summary = measure(plan, results)
    write_reproduce(summary, out)
    return summary
