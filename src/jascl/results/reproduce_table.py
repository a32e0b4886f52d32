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
    """Printed like the paper: percentages with one decimal, mIoU (scale 100) with two, fractions with three."""
    if value is None or value != value:  # None or NaN
        return "—"
    if metric in PERCENT_METRICS:
        return f"{value:.1f}"
    return f"{value:.2f}" if scale != 1 else f"{value:.3f}"


def _fmt_delta(value: float | None, metric: str, scale: float) -> str:
    text = _fmt(value, metric, scale)
    if text == "—" or text.startswith("-"):
        return text
    return "0" if float(text) == 0 else f"+{text}"


def reproduce_table(summary: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Rows of the paper (each with its method's fidelity mark); per paper column three columns: paper, measured
    (± std over seeds), Δ."""
    scale = float(summary.get("scale", 1))
    n = len(summary.get("seeds", []))
    columns: list[str] = list(dict.fromkeys(c["column"] for c in summary["cells"]))
    header = ["Row"]
    for col in columns:
        header += [f"{col} paper", f"{col} jascl", f"{col} Δ"]
    rows: dict[str, list[str]] = {}
    for c in summary["cells"]:
        metric = str(c.get("metric") or summary["metric"])
        # the row's name with its method's fidelity mark (footnotes under the table)
        label = f"{c['row']} [{mark(c['method']).rsplit('[', 1)[1]}" if c.get("method") else c["row"]
        row = rows.setdefault(c["row"], [label] + [""] * (3 * len(columns)))
        i = 1 + 3 * columns.index(c["column"])
        row[i] = _fmt(c["published"], metric, scale)
        if c["status"] == "measured":
            text = _fmt(c["measured"], metric, scale)
            row[i + 1] = text + (f" ± {_fmt(c['std'], metric, scale)}" if n > 1 else "")
            row[i + 2] = _fmt_delta(c["delta"], metric, scale)
        else:
            row[i + 1] = c["status"]
    return header, list(rows.values())


def reproduce_title(summary: Mapping[str, Any]) -> str:
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
    return f"{summary['table']}: {summary['caption']} · {where} · mean ± std over {seed_text}"


def not_measured(summary: Mapping[str, Any]) -> list[str]:
    """One line per reason a cell was not measured, with the rows it concerns."""
    reasons: dict[str, list[str]] = {}
    for c in summary["cells"]:
        if c["status"] not in ("measured", "planned") and c.get("reason"):
            reasons.setdefault(f"{c['status']}: {c['reason']}", []).append(c["row"])
    return [f"{r} ({', '.join(dict.fromkeys(rows))})" for r, rows in reasons.items()]


def write_reproduce(summary: Mapping[str, Any], out: str | Path) -> dict[str, Path]:
    """Write ``reproduce.md`` (the side-by-side table, skipped cells with reasons, the table's notes),
    ``reproduce.csv`` (one row per cell) and ``reproduce.json``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    header, rows = reproduce_table(summary)
    lines = [f"**{reproduce_title(summary)}**", "", md_table(header, rows)]
    methods = [c["method"] for c in summary["cells"] if c.get("method")]
    if methods:
        lines += [""] + [f"- {line}" for line in footnotes(methods)]
    reasons = not_measured(summary)
    if reasons:
        lines += ["", "Not measured:", ""] + [f"- {r}" for r in reasons]
    if summary.get("notes"):
        lines += ["", "Notes on the paper's table:", ""] + [f"- {n}" for n in summary["notes"]]
    paths = {"md": out / "reproduce.md", "csv": out / "reproduce.csv", "json": out / "reproduce.json"}
    atomic_write_text(paths["md"], "\n".join(lines) + "\n")
    csv = ["table,row,column,method,published,measured_mean,measured_std,delta,status,per_seed"]
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
            ";".join(num(v) for v in c["values"]),
        ]
        csv.append(",".join('"' + f.replace('"', '""') + '"' if ("," in f or '"' in f) else f for f in fields))
    atomic_write_text(paths["csv"], "\n".join(csv) + "\n")
    atomic_write_text(paths["json"], json.dumps(summary, indent=1, default=float))
    return paths
