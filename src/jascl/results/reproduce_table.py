"""The published-beside-measured table of ``jascl reproduce`` (``reproduce.json``), for the command, its files
and the report: one row per paper row, per paper column the paper's value, jascl's (mean ± std over seeds) and Δ."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jascl.fileio import atomic_write_text
from jascl.results.fidelity import footnotes, mark
from jascl.results.report import md_table

#: metrics published in percent whatever the table's scale: Total Drop, and the PAS retention (the share of
#: unlabelled pixels whose pseudo-label passes both filters, jascl's pseudo-label ``coverage``)
PERCENT_METRICS = ("total_drop", "retention")


def _fmt(value: float | None, metric: str, scale: float) -> str:
    """Printed like the paper: percentages with one decimal, mIoU (scale 100) with two, fractions with three;
    the compute table's parameters (M) and MACs (T) with two decimals, hours with three (two significant digits
    below 0.01: a toy run's seconds)."""
    if value is None or value != value:  # None or NaN
        return "—"
    if metric in PERCENT_METRICS:
        return f"{value:.1f}"
    if metric in ("params_m", "tflops", "hours"):
        if 0 < abs(value) < 0.01:
            return f"{value:.2g}"
        return f"{value:.3f}" if metric == "hours" else f"{value:.2f}"
    return f"{value:.2f}" if scale != 1 else f"{value:.3f}"


def _fmt_delta(value: float | None, metric: str, scale: float) -> str:
    text = _fmt(value, metric, scale)
    if text == "—" or text.startswith("-"):
        return text
    return "0" if float(text) == 0 else f"+{text}"


#: what a cell that is not (yet) measured shows in the jascl column
_UNFINISHED = {"pending": "—", "failed": "failed"}


def row_label(row: str, cells: list[Mapping[str, Any]]) -> str:
    """The row's first column: its printed name with its method's fidelity mark (``Gen-Replay [S]``; the footnotes
    under the table, :func:`reproduce_footnotes`, say what the marks mean); a row with no method as it is."""
    method = next((c["method"] for c in cells if c.get("method")), None)
    return f"{row} [{mark(method).rsplit('[', 1)[1]}" if method else row


def reproduce_footnotes(summary: Mapping[str, Any]) -> list[str]:
    """The fidelity footnotes of the table's methods (none for a table without methods)."""
    methods = [c["method"] for c in summary["cells"] if c.get("method")]
    return footnotes(methods) if methods else []


def reproduce_table(summary: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Rows of the paper; per paper column three columns: paper, measured (± std over seeds), Δ.

    A cell finished by some seeds shows their mean with "(k/n seeds)"; one no seed has finished yet "—"."""
    scale = float(summary.get("scale", 1))
    n = len(summary.get("seeds", []))
    columns: list[str] = list(dict.fromkeys(c["column"] for c in summary["cells"]))
    header = ["Row"]
    for col in columns:
        header += [f"{col} paper", f"{col} jascl", f"{col} Δ"]
    by_row: dict[str, list[Mapping[str, Any]]] = {}
    for c in summary["cells"]:
        by_row.setdefault(c["row"], []).append(c)
    rows = []
    for name, cells in by_row.items():
        row = [row_label(name, cells)] + [""] * (3 * len(columns))
        for c in cells:
            metric = str(c.get("metric") or summary["metric"])
            i = 1 + 3 * columns.index(c["column"])
            row[i] = _fmt(c["published"], metric, scale)
            if c["status"] in ("measured", "partial"):
                text = _fmt(c["measured"], metric, scale)
                done = int(c.get("seeds_done", n))
                if done > 1:
                    text += f" ± {_fmt(c['std'], metric, scale)}"
                if c["status"] == "partial":
                    text += f" ({done}/{n} seeds)"
                row[i + 1] = text
                row[i + 2] = _fmt_delta(c["delta"], metric, scale)
            else:
                row[i + 1] = _UNFINISHED.get(c["status"], c["status"])
        rows.append(row)
    return header, rows


def reproduce_title(summary: Mapping[str, Any]) -> str:
    """The table's title: what it is, where it was measured, quick mode, seeds, and how many cells are done."""
    seeds = summary.get("seeds", [])
    where = (
        f"measured on the stand-in benchmark {summary['stand_in']} (the published numbers are a reference, "
        "not a target)"
        if summary.get("stand_in")
        else "measured on the table's protocol"
    )
    seed_text = (
        f"{len(seeds)} seed{'s' if len(seeds) != 1 else ''} ({', '.join(map(str, seeds))})" if seeds else "no seeds"
    )
    parts = [f"{summary['table']}: {summary['caption']}"]
    if summary.get("quick"):
        divisor = summary.get("quick_epoch_divisor")
        share = f"1/{divisor} of the epochs" if divisor else "fewer epochs"
        parts.append(f"QUICK mode ({share}, one seed: a smoke test, not the table's setting)")
    if summary.get("device"):
        where += f" on {summary['device']}"
    parts += [where] + ([f"mean ± std over {seed_text}"] if seeds or "device" not in summary else [])
    if "cells_total" in summary:
        parts.append(f"{summary['cells_measured']} of {summary['cells_total']} cells")
    return " · ".join(parts)


def not_measured(summary: Mapping[str, Any]) -> list[str]:
    """One line per reason a cell was not measured, with the rows it concerns."""
    reasons: dict[str, list[str]] = {}
    for c in summary["cells"]:
        if c["status"] not in ("measured", "planned", "partial", "pending") and c.get("reason"):
            reasons.setdefault(f"{c['status']}: {c['reason']}", []).append(c["row"])
    return [f"{r} ({', '.join(dict.fromkeys(rows))})" for r, rows in reasons.items()]


def write_reproduce(summary: Mapping[str, Any], out: str | Path) -> dict[str, Path]:
    """Write ``reproduce.md`` (the side-by-side table, skipped cells with reasons, the table's notes),
    ``reproduce.csv`` (one row per cell) and ``reproduce.json``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    header, rows = reproduce_table(summary)
    lines = [f"**{reproduce_title(summary)}**", "", md_table(header, rows)]
    notes = reproduce_footnotes(summary)
    if notes:
        lines += [""] + [f"- {line}" for line in notes]
    reasons = not_measured(summary)
    if reasons:
        lines += ["", "Not measured:", ""] + [f"- {r}" for r in reasons]
    if summary.get("notes"):
        lines += ["", "Notes on the paper's table:", ""] + [f"- {n}" for n in summary["notes"]]
    paths = {"md": out / "reproduce.md", "csv": out / "reproduce.csv", "json": out / "reproduce.json"}
    atomic_write_text(paths["md"], "\n".join(lines) + "\n")
    csv = ["table,row,column,method,published,measured_mean,measured_std,delta,status,seeds_done,per_seed"]
    for c in summary["cells"]:

        def num(v: Any) -> str:
            return "" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.6g}"

        fields = [
            summary["table"],
            c["row"],
            c["column"],
            c["method"] or "",
            num(c["published"]),
            num(c["measured"]),
            num(c["std"]),
            num(c["delta"]),
            c["status"],
            str(c.get("seeds_done", len(c["values"]))),
            ";".join(num(v) for v in c["values"]),
        ]
        csv.append(",".join('"' + f.replace('"', '""') + '"' if ("," in f or '"' in f) else f for f in fields))
    atomic_write_text(paths["csv"], "\n".join(csv) + "\n")
    atomic_write_text(paths["json"], json.dumps(summary, indent=1, default=float))
    return paths
