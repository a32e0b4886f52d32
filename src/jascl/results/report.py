"""Writers for run results: tables, Markdown, CSV and JSON.

A run's results are a plain JSON-serialisable dict::

    {"protocol": "synthetic-2d", "metric": "dice", "eval_mode": "sliding-window",
     "background": "excluded from means", "seed": 1024,
     "methods": {"vanilla": {"sessions": [{"session": 0, "name": "base", "all": 0.81,
                                           "old": NaN, "new": 0.81, "base": 0.81,
                                           "background": 0.99, "per_class": {"1": 0.8}}],
                             "total_drop": 55.0, "forgetting": {"1": 0.4}}}}

Scores are fractions in ``[0, 1]``. Missing values may be ``NaN`` (in memory)
or ``None`` (after a JSON round trip); both are shown as ``—`` and written
as ``null`` (JSON) or an empty field (CSV). For metric ``"iou"`` tables show
mIoU ×100 with one decimal, as the paper does; otherwise three decimals.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jascl.fileio import atomic_write_text

__all__ = [
    "format_score",
    "table_title",
    "comparison_table",
    "session_detail_table",
    "to_markdown",
    "to_csv",
    "write_json",
    "per_class_table",
    "print_tables",
    "write_all",
]

MISSING = "—"
_SPLITS = ("all", "old", "new", "base", "background")


def _as_float(value: Any) -> float:
    """Returns ``value`` as float; ``None``/non-numeric become NaN."""
    if value is None:
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _is_iou(results: Mapping[str, Any]) -> bool:
    return str(results.get("metric", "dice")).lower() in {"iou", "miou", "jaccard"}


def format_score(value: Any, metric: str) -> str:
    """Formats a score: ×100 with 1 decimal for IoU, else 3 decimals; NaN -> ``—``."""
    v = _as_float(value)
    if math.isnan(v):
        return MISSING
    if metric.lower() in {"iou", "miou", "jaccard"}:
        return f"{100.0 * v:.1f}"
    return f"{v:.3f}"


def _fmt_pct(value: Any) -> str:
    v = _as_float(value)
    return MISSING if math.isnan(v) else f"{v:.1f}"


def table_title(results: Mapping[str, Any]) -> str:
    """One-line title stating protocol, metric, eval mode, background rule and seed.

    Example: ``"synthetic-2d · Dice (mean over foreground classes; background
    excluded) · eval: sliding-window · seed 1024"``.
    """
    bg = str(results.get("background", "excluded from means"))
    if "exclud" in bg.lower():
        averaging = "mean over foreground classes; background excluded"
    elif "includ" in bg.lower():
        averaging = "mean over all classes; background included"
    else:
        averaging = f"background: {bg}"
    name = "mIoU ×100" if _is_iou(results) else str(results.get("metric", "dice")).capitalize()
    parts = [str(results.get("protocol", "run")), f"{name} ({averaging})"]
    if results.get("eval_mode"):
        parts.append(f"eval: {results['eval_mode']}")
    if results.get("seed") is not None:
        parts.append(f"seed {results['seed']}")
    return " · ".join(parts)


def _methods(results: Mapping[str, Any]) -> Mapping[str, Any]:
    return results.get("methods", {}) or {}


def _sessions(method_result: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return list(method_result.get("sessions", []) or [])


def comparison_table(results: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Builds the method-comparison table.

    Args:
        results: Run results dict (see module docstring).

    Returns:
        ``(header, rows)``: header is ``["Method", "S0 (<name>)", ...,
        "Base@last", "Total Drop (%)"]``; one row per method with the
        ``"all"`` score per session, the ``"base"`` score at the method's last
        session and the total drop with one decimal. Sessions a method lacks
        are ``—``.
    """
    metric = str(results.get("metric", "dice"))
    methods = _methods(results)
    longest = max((_sessions(m) for m in methods.values()), key=len, default=[])
    header = ["Method"]
    for i, s in enumerate(longest):
        idx = s.get("session", i)
        header.append(f"S{idx} ({s['name']})" if s.get("name") else f"S{idx}")
    header += ["Base@last", "Total Drop (%)"]
    rows: list[list[str]] = []
    for name, m in methods.items():
        sessions = _sessions(m)
        row = [str(name)]
        for i in range(len(longest)):
            row.append(format_score(sessions[i].get("all"), metric) if i < len(sessions) else MISSING)
        row.append(format_score(sessions[-1].get("base"), metric) if sessions else MISSING)
        row.append(_fmt_pct(m.get("total_drop")))
        rows.append(row)
    return header, rows


def session_detail_table(results: Mapping[str, Any], method: str) -> tuple[list[str], list[list[str]]]:
    """Per-session detail table for one method.

    Returns:
        ``(header, rows)`` with columns Session, Name, All, Old, New, Base,
        Background; one row per session.

    Raises:
        KeyError: If ``method`` is not in ``results["methods"]``.
    """
    metric = str(results.get("metric", "dice"))
    m = _methods(results)[method]
    header = ["Session", "Name", "All", "Old", "New", "Base", "Background"]
    rows = []
    for i, s in enumerate(_sessions(m)):
        rows.append(
            [str(s.get("session", i)), str(s.get("name", ""))] + [format_score(s.get(k), metric) for k in _SPLITS]
        )
    return header, rows


def md_table(header: list[str], rows: list[list[str]]) -> str:
    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    out = [line(header), "| " + " | ".join("---" for _ in header) + " |"]
    out += [line(r) for r in rows]
    return "\n".join(out)


def per_class_table(results: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Per-class score at the last session and forgetting (best earlier score - last), per method.

    Rows are the classes of the last session (background first); class names
    come from ``results["classes"]`` (id -> name) when present.
    """
    methods = _methods(results)
    metric = str(results.get("metric", "dice"))
    names = results.get("classes", {}) or {}
    header = ["Class"]
    for name in methods:
        header += [f"{name} last", f"{name} forgetting"]
    keys: list[str] = []
    for m in methods.values():
        sessions = _sessions(m)
        if sessions:
            keys += [k for k in (sessions[-1].get("per_class") or {}) if k not in keys]
    rows = []
    for key in sorted(keys, key=_class_sort_key):
        label = f"{key} {names.get(str(key), '')}".strip()
        row = [label]
        for m in methods.values():
            sessions = _sessions(m)
            last = (sessions[-1].get("per_class") or {}).get(key) if sessions else None
            forgetting = (m.get("forgetting") or {}).get(key)
            row += [
                format_score(last, metric),
                MISSING
                if forgetting is None or math.isnan(_as_float(forgetting))
                else format_score(forgetting, metric),
            ]
        rows.append(row)
    return header, rows


def to_markdown(results: Mapping[str, Any]) -> str:
    """Renders the title, the comparison table, one detail table per method and the per-class table."""
    parts = [f"## {table_title(results)}", "", md_table(*comparison_table(results))]
    for name in _methods(results):
        parts += ["", f"### {name}: per-session detail", ""]
        parts.append(md_table(*session_detail_table(results, name)))
    parts += ["", "### per class: score at the last session and forgetting", ""]
    parts.append(md_table(*per_class_table(results)))
    return "\n".join(parts) + "\n"


def _class_sort_key(key: Any) -> tuple[int, Any]:
    try:
        return (0, int(key))
    except (TypeError, ValueError):
        return (1, str(key))


def _csv_rows(results: Mapping[str, Any]) -> list[list[Any]]:
    rows: list[list[Any]] = [["method", "session", "session_name", "split", "value"]]
    for name, m in _methods(results).items():
        for i, s in enumerate(_sessions(m)):
            head = [name, s.get("session", i), s.get("name", "")]
            for k in _SPLITS:
                rows.append(head + [k, _csv_value(s.get(k))])
            per_class = s.get("per_class", {}) or {}
            for cls in sorted(per_class, key=_class_sort_key):
                rows.append(head + [f"class:{cls}", _csv_value(per_class[cls])])
    return rows


def _csv_value(value: Any) -> str:
    v = _as_float(value)
    return "" if math.isnan(v) else repr(v)


def to_csv(results: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Writes results in long format (atomically).

    Columns: ``method, session, session_name, split, value`` where split is
    one of all/old/new/base/background or ``class:<id>``; missing values are
    empty fields. One header row plus one row per (method, session, split).

    Returns:
        The written path.
    """
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(_csv_rows(results))
    out = Path(path)
    atomic_write_text(out, buf.getvalue())
    return out


def _jsonable(obj: Any) -> Any:
    """Recursively converts NaN/inf to ``None`` and scalars/paths to plain types."""
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, bool) or obj is None or isinstance(obj, (str, int)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if hasattr(obj, "item") and callable(obj.item):  # numpy / torch scalars
        return _jsonable(obj.item())
    raise TypeError(f"cannot serialise {type(obj).__name__} to JSON")


def write_json(results: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Writes results as indented JSON (NaN -> ``null``), atomically.

    Returns:
        The written path.
    """
    text = json.dumps(_jsonable(results), indent=2, allow_nan=False) + "\n"
    out = Path(path)
    atomic_write_text(out, text)
    return out


def print_tables(results: Mapping[str, Any], console: Any = None) -> None:
    """Prints the comparison and per-method detail tables with ``rich``.

    Args:
        results: Run results dict.
        console: A ``rich.console.Console``; a new one if ``None``.
    """
    from rich.console import Console
    from rich.table import Table

    console = console or Console()

    def render(title: str, header: list[str], rows: list[list[str]]) -> Table:
        table = Table(title=title)
        for i, h in enumerate(header):
            table.add_column(h, justify="left" if i == 0 else "right", no_wrap=i == 0)
        for r in rows:
            table.add_row(*r)
        return table

    console.print(render(table_title(results), *comparison_table(results)))
    for name in _methods(results):
        console.print(render(f"{name}: per-session detail", *session_detail_table(results, name)))
    console.print(render("per class: score at the last session and forgetting", *per_class_table(results)))


def write_all(results: Mapping[str, Any], out_dir: str | os.PathLike[str]) -> dict[str, Path]:
    """Writes ``results.json``, ``results.csv`` and ``results.md`` atomically.

    Returns:
        ``{"json": path, "csv": path, "markdown": path}``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md = out / "results.md"
    atomic_write_text(md, to_markdown(results))
    return {
        "json": write_json(results, out / "results.json"),
        "csv": to_csv(results, out / "results.csv"),
        "markdown": md,
    }
