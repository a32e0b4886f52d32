"""The paper's compute table on the device at hand (``jascl reproduce compute``).

The table ("Computational analysis for Session 1") gives, per benchmark row, parameters (M), FLOPs (T) and the
training time of session 1 with JASCL and without it (the Vanilla baseline), on one A100 40GB. Here:

* parameters and MACs per forward of the row's backbone, at the paper's input size with the classes of the
  row's session 1 (:func:`jascl.experiments.model_info.model_info` on the meta device: instant, no weights);
  the paper's "FLOPs (T)" are multiply-accumulates (the MedFormer row's 1.10 T is MedFormer's MACs per
  128x160x96 forward, see the table's notes), so MACs are what is printed beside them. GAS adds a buffer, not
  parameters, and the replay's classifier pass on 40 prototypes adds no visible MACs, as in the paper;
* the training time of session 1 with ``jascl`` and with ``vanilla``, measured: one compare run of the row's
  protocol (its first two sessions, the row's backbone; SAM 10 epochs as the paper's text says), both methods
  from one shared base; the session's wall time (training and evaluation, ``seconds`` of its
  ``metrics.json``), in hours, on this machine's device (named in the title).

With ``--stand-in`` every row's time is that of the table's stand-in benchmark with its own backbone (one run;
the rows' parameters and MACs stay their backbones' at the paper's sizes), so the whole path runs on a CPU;
``--quick`` trains a quarter of the epochs. The table is written after the model sizes and again after every
run, so an interrupted reproduction shows what it measured.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from jascl.errors import ConfigError
from jascl.experiments.reproduce_plan import Job, job_protocol, paper_epochs, quick_epochs, roots_for
from jascl.paper.tables import Cell, PaperTable
from jascl.results.reproduce_table import write_reproduce

#: the methods of the table's two columns
WITH, WITHOUT = "jascl", "vanilla"


def _row_cells(table: PaperTable) -> dict[str, list[Cell]]:
    rows: dict[str, list[Cell]] = {}
    for cell in table.cells():
        rows.setdefault(cell.row, []).append(cell)
    return rows


def compute_jobs(table: PaperTable, stand_in: bool = False) -> dict[str, Job]:
    """Row name -> the compare job that times its session 1 (one shared job with ``stand_in``)."""
    from jascl.protocols import get_protocol

    if stand_in and not table.stand_in:
        raise ConfigError(f"table {table.label} names no stand_in benchmark; run it on its protocol")
    jobs: dict[str, Job] = {}
    for row, cells in _row_cells(table).items():
        first = cells[0]
        protocol = table.stand_in if stand_in else first.protocol
        if not protocol:
            raise ConfigError(f"{table.source}: row {row!r} names no protocol")
        if stand_in:
            overrides: list[str] = []
        else:
            backbone = first.backbone or get_protocol(protocol).training.get("backbone")
            overrides = [*([f"backbone={first.backbone}"] if first.backbone else []), *paper_epochs(backbone, {})]
        key = "_".join([Path(protocol).stem, *overrides, "first2"]).replace("/", "-")
        jobs[row] = Job(key=key, protocol=protocol, sessions=2, overrides=tuple(overrides), shots=None,
                        methods=[WITHOUT, WITH])  # fmt: skip
    return jobs


def model_size(cell: Cell) -> dict[str, float]:
    """Parameters (M) and MACs (T) per forward of the cell's backbone at the paper's input size, with the
    classes of its protocol's session 1."""
    from jascl.experiments.model_info import model_info
    from jascl.protocols import get_protocol

    protocol = get_protocol(str(cell.protocol))
    backbone = cell.backbone or str(protocol.training.get("backbone"))
    info = model_info(backbone, num_classes=len(protocol.seen_classes(1)), device="meta")
    return {"params_m": float(info["params_m"]), "tflops": float(info["gmacs"]) / 1e3}


def _session_hours(folder: Path, method: str, protocol) -> float:
    """Hours of session 1 of ``method`` in a run folder (NaN until it is finished)."""
    path = folder / method / f"s1-{protocol.sessions[1].name}" / "metrics.json"
    try:
        return float(json.loads(path.read_text())["seconds"]) / 3600.0
    except (OSError, ValueError, KeyError, TypeError):
        return math.nan


def device_name(device: str | None) -> str:
    """The device a run trains on, in words (``cuda`` with its name, or ``cpu`` with its thread count)."""
    import torch

    from jascl.engine.optim import resolve_device

    where = resolve_device(device or "auto")
    if where.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(where)})"
    return f"{where.type} ({torch.get_num_threads()} threads)"


def compute_summary(
    table: PaperTable,
    sizes: dict[str, dict[str, float]],
    hours: dict[str, dict[str, float]],
    *,
    stand_in: bool,
    quick: bool,
    device: str,
) -> dict[str, Any]:
    """The reproduce summary of the compute table (the format :func:`jascl.experiments.reproduce.measure`
    writes): parameters and MACs per row, session-1 hours per row and method, beside the published values."""
    cells = []
    for row, row_cells in _row_cells(table).items():
        for c in row_cells:
            value = (
                sizes.get(row, {}).get(c.metric, math.nan)
                if c.metric in ("params_m", "tflops")
                else hours.get(row, {}).get(str(c.method), math.nan)
            )
            measured = not math.isnan(value)
            cells.append(
                {
                    "row": c.row, "column": c.column, "method": c.method, "metric": c.metric,
                    "published": c.value, "status": "measured" if measured else "pending", "reason": "",
                    "job": None, "measured": value if measured else None, "std": 0.0 if measured else None,
                    "values": [value] if measured else [], "seeds_done": int(measured),
                    "delta": None if not measured or c.value is None else value - c.value,
                }
            )  # fmt: skip
    notes = [
        "Measured: parameters and MACs (the paper's 'FLOPs (T)') of each row's backbone at the paper's input size; "
        f"session-1 training time (training and evaluation) of jascl and vanilla on {device}; the published times "
        "are one A100 40GB's.",
        *(
            [
                f"Stand-in: every row's time is the stand-in benchmark {table.stand_in}'s session 1 with its own backbone."
            ]
            if stand_in
            else []
        ),
        *table.notes,
    ]
    return {
        "table": table.label,
        "caption": table.caption,
        "metric": table.metric,
        "scale": 1.0,
        "stand_in": table.stand_in if stand_in else None,
        "quick": quick,
        "device": device,
        "seeds": [],
        "cells_measured": sum(c["status"] == "measured" for c in cells),
        "cells_total": len(cells),
        "notes": notes,
        "cells": cells,
    }


def describe_compute(table: PaperTable, *, stand_in: bool = False, quick: bool = False, device=None) -> list[str]:
    """The ``--dry-run`` text of the compute table."""
    jobs = compute_jobs(table, stand_in)
    lines = [f"{table.label}: {table.caption}", f"  on {device_name(device)}" + ("; QUICK mode" if quick else "")]
    for row, job in jobs.items():
        lines.append(f"  {row}: model size of its backbone; session-1 time of {WITH} and {WITHOUT}: {job.describe()}")
    return lines


def run_compute(
    table: PaperTable,
    out: str | Path,
    *,
    stand_in: bool = False,
    quick: bool = False,
    device: str | None = None,
    report_only: bool = False,
    overrides: Sequence[str] = (),
    echo: Callable[[str], None] = print,
    seed: int = 1024,
    **compare_kwargs: Any,
) -> dict[str, Any]:
    """Measure the compute table into ``out`` (``reproduce.{md,csv,json}``, one compare folder per job)."""
    from jascl.engine.config import resolve_config
    from jascl.experiments.compare import run_compare

    out = Path(out)
    where = device_name(device)
    jobs = compute_jobs(table, stand_in)
    roots = compare_kwargs.pop("roots", None)
    if roots:  # as a table's run: names no job reads are refused, each job gets its protocol's
        from jascl.data.real.roots import root_names
        from jascl.protocols import get_protocol

        known = {n for job in jobs.values() for n in root_names(get_protocol(job.protocol))}
        unknown = sorted(set(roots) - known)
        if unknown:
            raise ConfigError(
                f"--root {unknown[0]}=...: no job of {table.label} reads a root of that name "
                f"(its protocols read {', '.join(sorted(known)) or 'no dataset root'})"
            )
    sizes = {row: model_size(cells[0]) for row, cells in _row_cells(table).items()}
    hours: dict[str, dict[str, float]] = {}

    def write() -> dict[str, Any]:
        for row, job in jobs.items():
            protocol = job_protocol(job)
            folder = out / job.key / f"seed-{seed}"
            hours[row] = {m: _session_hours(folder, m, protocol) for m in (WITH, WITHOUT)}
        summary = compute_summary(table, sizes, hours, stand_in=stand_in, quick=quick, device=where)
        write_reproduce(summary, out)
        return summary

    summary = write()
    if report_only:
        return summary
    done: set[str] = set()
    try:
        for job in jobs.values():
            if job.key in done:
                continue
            done.add(job.key)
            echo(f"[reproduce] {table.label}: timing session 1 of {WITH} and {WITHOUT} ({job.describe()})")
            protocol = job_protocol(job)
            extra = [*job.overrides, *overrides, *([f"device={device}"] if device else [])]
            config = resolve_config(protocol.training, protocol.path, None, extra)
            if quick:
                base, incremental = quick_epochs(config.epochs_base, config.epochs_incremental)
                extra += [f"epochs_base={base}", f"epochs_incremental={incremental}"]
                config = resolve_config(protocol.training, protocol.path, None, extra)
            run_compare(
                protocol, config, job.methods, [seed], out / job.key, echo=echo, roots=roots_for(job, roots),
                **compare_kwargs,
            )  # fmt: skip
            summary = write()
    finally:
        summary = write()
    return summary
