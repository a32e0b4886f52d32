"""``jascl reproduce``: run one of the paper's tables and print the published number beside the measured one.

The plan (:mod:`jascl.experiments.reproduce_plan`) groups a table's cells into compare jobs; this module runs
them, one :func:`jascl.experiments.compare.run_compare` per job, and measures every cell: mean ± std over the
seeds, from the run folders, in the table's own unit (``scale``). With a launcher, every job's bases and cells
are first one set of launcher jobs (:func:`jascl.experiments.fanout.fan_out`), and the compares only collect.

Partial results: the table is written from what is on disk, not from what a job returns, so it is there at
every moment of a reproduction:

* ``reproduce.md`` / ``.csv`` / ``.json`` are rewritten as soon as a session finishes (each time a session
  starts, the previous one's ``metrics.json`` is read), after every job, and when the reproduction stops
  (SIGTERM / Ctrl-C, a failed job, the end). A killed process (SIGKILL, a scheduler's time limit) leaves the
  table of the sessions finished before it;
* a cell is *measured* when every seed has its value, *partial* (mean of the seeds so far, "k/n seeds") when
  some have, else pending ("—"); the title says "n of m cells";
* a job that fails (an error in one method or setting) marks its unfinished cells ``failed`` with the reason
  and the next job runs; a method that cannot be built (e.g. an optional dependency not installed) is left out
  of its job before it runs, its cells ``failed`` with the one-line reason, and the job's other methods run; the command then exits 1;
* ``jascl reproduce TABLE --out DIR --report`` re-renders the table from ``DIR`` without training.

Quick mode (``--quick``): every session trains a :data:`~jascl.experiments.reproduce_plan.QUICK_EPOCH_DIVISOR`-th
of its epochs (at least one) on the first seed only; the output says "QUICK" in its title and its default
folder ends in ``-quick``. It checks that a table's whole path runs (on the stand-in: ``tab_set1_part`` in
minutes on two cores) and shows the direction of the results; its numbers are not the table's setting.

Folder layout::

    <out>/<job>/seed-<s>/...      one compare folder per job (see jascl.experiments.compare)
    <out>/reproduce.{md,csv,json}
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from jascl.errors import ConfigError, JasclError, TrainingError
from jascl.experiments.compare import mean_std
from jascl.experiments.fanout import share_base
from jascl.experiments.reproduce_jobs import cells_finished, fan_out_plan, manifest_for, owners_of
from jascl.experiments.reproduce_plan import (
    PERCENT_METRICS,
    QUICK_EPOCH_DIVISOR,
    STATUS_PLANNED,
    Job,
    Plan,
    check_roots,
    job_protocol,
    method_base,
    plan_table,
    quick_epochs,
    roots_for,
)
from jascl.paper.tables import Cell, PaperTable
from jascl.protocols.schema import Protocol
from jascl.results.records import RunResults, SessionRecord
from jascl.results.reproduce_table import write_reproduce

log = logging.getLogger("jascl")


@dataclasses.dataclass
class MethodRecords:
    """What one method of one job and seed has finished: a record per session (None: not yet) and Total Drop
    (NaN until every session is done)."""

    sessions: list[SessionRecord | None]
    total_drop: float = math.nan


#: job -> seed -> method -> its finished sessions
Collected = dict[str, dict[int, dict[str, MethodRecords]]]


def _record(path: Path, t: int) -> SessionRecord | None:
    if not path.is_file():
        return None
    try:
        return SessionRecord.from_json(json.loads(path.read_text()), t, str(path))
    except (OSError, ValueError, JasclError):  # being written, or not a record: not finished
        return None


def read_seed(folder: Path, protocol: Protocol, methods: Sequence[str]) -> dict[str, MethodRecords]:
    """The finished sessions of ``methods`` in one compare seed folder (a run folder).

    A finished run's ``results.json`` is read as it is; otherwise every session whose ``metrics.json`` exists:
    session 0 from the method's own folder, else the keyed or shared base it starts from."""
    from jascl.evaluation.metrics import total_drop

    results = folder / "results.json"
    if results.is_file():
        run = RunResults.read(results)
        if all(m in run.methods for m in methods):
            return {m: MethodRecords(list(run.methods[m].sessions), float(run.methods[m].total_drop)) for m in methods}
    out: dict[str, MethodRecords] = {}
    for m in methods:
        records: list[SessionRecord | None] = []
        for t, session in enumerate(protocol.sessions):
            own = folder / m / f"s{t}-{session.name}" / "metrics.json"
            record = _record(own, t)
            if record is None and t == 0:
                base = method_base(m)
                shared = folder / ("base" if base == "vanilla" else f"base-{base}") / "metrics.json"
                record = _record(shared, 0) if base else None
            records.append(record)
        drop = math.nan
        if all(r is not None for r in records) and records[0] is not None and records[0].all > 0:
            try:
                drop = float(total_drop([r.all for r in records if r is not None]))
            except ValueError:
                drop = math.nan
        out[m] = MethodRecords(records, drop)
    return out


def collect(plan: Plan, seeds: Sequence[int], out: str | Path) -> Collected:
    """Every job's finished sessions under ``out``, per seed."""
    out = Path(out)
    collected: Collected = {}
    for job in plan.jobs.values():
        protocol = job_protocol(job)
        collected[job.key] = {s: read_seed(out / job.key / f"seed-{s}", protocol, job.methods) for s in seeds}
    return collected


def _measure_one(cell: Cell, m: MethodRecords | None) -> float:
    """The cell's quantity in one seed's records, as a fraction (NaN where it is not there yet)."""
    if m is None:
        return math.nan
    if cell.metric == "total_drop":
        return float(m.total_drop)
    if cell.session is None or cell.session >= len(m.sessions):
        return math.nan
    record = m.sessions[cell.session]
    if record is None:
        return math.nan
    if cell.metric == "retention":
        return 100.0 * record.pseudo_label_value("coverage")
    if cell.class_id is not None:
        return float(record.per_class.get(str(cell.class_id), math.nan))
    return float(record.all)


def _finished(cell: Cell, m: MethodRecords | None) -> bool:
    """Whether the session(s) behind ``cell`` are finished in one seed (a value may still be NaN: an absent class)."""
    if m is None:
        return False
    if cell.metric == "total_drop":
        return all(r is not None for r in m.sessions)
    return cell.session is not None and cell.session < len(m.sessions) and m.sessions[cell.session] is not None


def measure(
    plan: Plan, collected: Collected, seeds: Sequence[int], failed: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """Published beside measured for every cell: ``{"table", "stand_in", "seeds", "cells": [...], ...}``.

    A cell's measured value is the mean ± sample std over the seeds that finished it, in the table's unit
    (scores times ``scale``; Total Drop in percent as published); ``delta`` = measured mean − published.
    Status: ``measured`` (every seed), ``partial`` (some), ``pending`` (none yet), ``failed`` (its job raised:
    ``failed[job]`` is the reason), ``missing`` (finished without a value), or the plan's reason it cannot run.
    """
    t = plan.table
    failed = failed or {}
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
            "seeds_done": 0,
            "delta": None,
        }
        if p.status == STATUS_PLANNED and p.job is not None:
            per_seed = collected.get(p.job, {})
            done = [s for s in seeds if _finished(c, per_seed.get(s, {}).get(str(c.method)))]
            factor = 1.0 if c.metric in PERCENT_METRICS else t.scale
            values = [_measure_one(c, per_seed[s][str(c.method)]) * factor for s in done]
            mean, std = mean_std(values)
            entry["seeds_done"] = len(done)
            if not done:
                reason = failed.get(f"{p.job}/{c.method}", failed.get(p.job))
                entry["status"], entry["reason"] = ("failed", reason) if reason else ("pending", "")
            elif c.class_id is not None and plan.stand_in and all(math.isnan(v) for v in values):
                entry["status"], entry["reason"] = "not in stand-in", f"class {c.class_id} is not in {t.stand_in}"
            elif math.isnan(mean):
                entry["status"], entry["reason"] = "missing", "the run has no value for this cell"
            else:
                complete = len(done) == len(seeds)
                entry.update(
                    measured=mean,
                    std=std,
                    values=values,
                    status="measured" if complete else "partial",
                    reason="" if complete else f"{len(done)}/{len(seeds)} seeds",
                    delta=None if c.value is None else mean - c.value,
                )
        cells.append(entry)
    runnable = [e for e in cells if e["status"] in ("measured", "partial", "pending", "failed", "missing")]
    return {
        "table": t.label,
        "caption": t.caption,
        "metric": t.metric,
        "scale": t.scale,
        "stand_in": t.stand_in if plan.stand_in else None,
        "quick": plan.quick,
        **({"quick_epoch_divisor": QUICK_EPOCH_DIVISOR} if plan.quick else {}),
        "seeds": list(seeds),
        "cells_measured": sum(e["status"] == "measured" for e in runnable),
        "cells_total": len(runnable),
        "notes": list(t.notes),
        "cells": cells,
    }


def _job_overrides(job: Job, protocol: Protocol, overrides: Sequence[str], quick: bool) -> list[str]:
    """The job's overrides, the user's after them, then the quick mode's epochs (a fraction of the resolved ones)."""
    combined = [*job.overrides, *overrides]
    if not quick:
        return combined
    from jascl.engine.config import resolve_config

    config = resolve_config(protocol.training, protocol.path, None, combined)
    base, incremental = quick_epochs(config.epochs_base, config.epochs_incremental)
    return [*combined, f"epochs_base={base}", f"epochs_incremental={incremental}"]


class _Refresher:
    """Rewrites the table when the set of finished sessions under ``out`` changed since the last write."""

    def __init__(self, plan: Plan, seeds: Sequence[int], out: Path, failed: Mapping[str, str]) -> None:
        self.plan, self.seeds, self.out, self.failed = plan, list(seeds), out, failed
        self._seen: int | None = None
        self.summary: dict[str, Any] = {}

    def __call__(self, force: bool = False) -> dict[str, Any]:
        finished = sum(1 for _ in self.out.glob("*/seed-*/**/metrics.json")) if self.out.is_dir() else 0
        if force or finished != self._seen:
            self._seen = finished
            self.summary = measure(self.plan, collect(self.plan, self.seeds, self.out), self.seeds, self.failed)
            write_reproduce(self.summary, self.out)
        return self.summary


def run_plan(
    plan: Plan,
    seeds: Sequence[int],
    out: str | Path,
    *,
    overrides: Sequence[str] = (),
    echo: Callable[[str], None] = print,
    roots: Mapping[str, Any] | None = None,
    **compare_kwargs: Any,
) -> dict[str, Any]:
    """Run (or reuse) every job for every seed, the table rewritten as sessions finish; returns the summary.

    A job that raises (other than a stop request) is recorded as failed and the next job runs. With a
    ``launcher`` (in ``compare_kwargs``) the bases and cells of every job and seed are one set of jobs first
    (:func:`~jascl.experiments.reproduce_jobs.fan_out_plan`), all jobs' cells side by side; each job's compare
    then only collects, and a job with a cell that did not finish is failed with the launcher's error (nothing
    trains in this process)."""
    from jascl.engine.config import resolve_config
    from jascl.engine.stop import Stopped
    from jascl.experiments.compare import run_compare

    out = Path(out)
    check_roots(plan, roots)
    launcher = compare_kwargs.pop("launcher", None)
    if launcher is not None:
        launcher.check()  # (SLURM off a SLURM node: refused before anything is written)
    manifests = compare_kwargs.get("split_manifest")
    names = {job_protocol(job).name for job in plan.jobs.values()}
    for path in [manifests] if isinstance(manifests, (str, Path)) else manifests or []:
        if not any(manifest_for(name, [path]) for name in names):
            raise ConfigError(
                f"--split-manifest {path}: written by a run of none of this table's protocols ({', '.join(sorted(names))})"
            )
    failed: dict[str, str] = {}
    refresh = _Refresher(plan, seeds, out, failed)

    def echo_and_refresh(message: str) -> None:
        echo(message)
        refresh()

    prepared: dict[str, tuple | Exception] = {}

    def prepare(job: Job) -> tuple[Protocol, Any, dict[str, Any], list[str]]:
        """The job's protocol, configuration, compare keywords and the methods that can be built (once)."""
        if job.key not in prepared:
            protocol = job_protocol(job)
            try:
                overridden = _job_overrides(job, protocol, overrides, plan.quick)
                config = resolve_config(protocol.training, protocol.path, None, overridden)
                kwargs = {**compare_kwargs, "split_manifest": manifest_for(protocol.name, manifests)}
                prepared[job.key] = (protocol, config, kwargs, _creatable(job, config, protocol.task, failed, echo))
            except Exception as exc:
                prepared[job.key] = exc
        result = prepared[job.key]
        if isinstance(result, Exception):
            raise result
        return result

    owners = owners_of(plan, manifests)
    unfinished = ""
    if launcher is not None:
        unfinished = fan_out_plan(plan, seeds, out, launcher, owners, prepare, roots, compare_kwargs, echo_and_refresh)
    try:
        for i, job in enumerate(plan.jobs.values()):
            echo(f"[reproduce] job {i + 1}/{len(plan.jobs)}: {job.describe()} — {', '.join(job.methods)}")
            owner = owners[job.key]
            if owner is not job:
                for seed in seeds:
                    source = out / owner.key / f"seed-{seed}"
                    for base in sorted(source.glob("base*")) if source.is_dir() else []:  # base, base-<key>
                        share_base(base, out / job.key / f"seed-{seed}" / base.name)
            try:
                protocol, config, kwargs, methods = prepare(job)
                if methods and launcher is not None and not cells_finished(job, protocol, methods, seeds, out):
                    raise TrainingError(f"its launcher jobs did not all finish: {unfinished}")
                if methods:
                    run_compare(
                        protocol, config, methods, seeds, out / job.key, echo=echo_and_refresh,
                        roots=roots_for(job, roots), **kwargs,
                    )  # fmt: skip
            except Stopped:
                raise
            except Exception as exc:  # one failed job: its cells say why, the others still run
                failed[job.key] = f"{type(exc).__name__}: {exc}".splitlines()[0]
                log.exception("reproduce job %s failed", job.key)
                echo(f"[reproduce] job {job.key} failed ({failed[job.key]}); going on with the next job")
            refresh(force=True)
    finally:
        summary = refresh(force=True)
    return summary


def _creatable(job: Job, config: Any, task: str, failed: dict[str, str], echo: Callable[[str], None]) -> list[str]:
    """The job's methods that can be built under ``config``; each one refused (a missing optional dependency, an
    option the configuration rejects) is recorded as ``failed["<job>/<method>"]`` and left out, so one method's
    missing extra does not fail the table's other cells."""
    from jascl.methods.registry import create_method

    usable = []
    for method in job.methods:
        try:
            create_method(method, config, task)
        except JasclError as exc:
            failed[f"{job.key}/{method}"] = str(exc).splitlines()[0]
            echo(f"[reproduce] {method} left out of job {job.key}: {failed[f'{job.key}/{method}']}")
            continue
        usable.append(method)
    return usable


def run_reproduce(
    table: PaperTable,
    seeds: Sequence[int],
    out: str | Path,
    *,
    stand_in: bool = False,
    quick: bool = False,
    overrides: Sequence[str] = (),
    echo: Callable[[str], None] = print,
    protocols: Sequence[str] | None = None,
    **compare_kwargs: Any,
) -> dict[str, Any]:
    """Plan, run and measure ``table``; write ``reproduce.{md,csv,json}`` into ``out`` and return the summary.

    ``protocols``: the protocol names (or YAML paths) a table may name, default the built-in ones; ``quick``: the
    quick mode (module docstring), which keeps the first seed only."""
    plan = plan_table(table, stand_in=stand_in, quick=quick, protocols=protocols)
    if not plan.jobs:
        reasons = sorted({f"{p.status} ({p.reason})" for p in plan.cells})
        raise ConfigError(f"table {table.label}: no cell can run here: {'; '.join(reasons)}")
    return run_plan(plan, list(seeds)[:1] if quick else seeds, out, overrides=overrides, echo=echo, **compare_kwargs)


def report_reproduce(
    table: PaperTable,
    out: str | Path,
    *,
    stand_in: bool = False,
    quick: bool = False,
    protocols: Sequence[str] | None = None,
) -> dict:
    """Re-render ``reproduce.{md,csv,json}`` from the run folders under ``out`` (``--report``): the seeds are the
    ones found there, the cells those finished.

    Raises:
        ConfigError: ``out`` holds no job folder of this table.
    """
    out = Path(out)
    previous = out / "reproduce.json"
    if previous.is_file():  # the mode it was run in wins over the flags
        recorded = json.loads(previous.read_text())
        stand_in, quick = bool(recorded.get("stand_in")), bool(recorded.get("quick", quick))
    plan = plan_table(table, stand_in=stand_in, quick=quick, protocols=protocols)
    seeds = sorted(
        {int(p.name.split("-", 1)[1]) for job in plan.jobs for p in (out / job).glob("seed-*") if p.is_dir()}
    )
    if not seeds:
        raise ConfigError(
            f"{out}: no run folder of {table.label}'s jobs ({', '.join(plan.jobs) or 'none'}); give the --out of "
            "the reproduction" + (" (run with --stand-in? pass it here too)" if not stand_in else "")
        )
    summary = measure(plan, collect(plan, seeds, out), seeds)
    write_reproduce(summary, out)
    return summary
