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
mIoU ×100 with one decimal, as the paper does; otherwise three decimals. Metric ``"map"`` (detection
protocols) is COCO mAP: the splits are mean per-class AP and there is no background score.
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
from jascl.results.fidelity import footnotes, mark
from jascl.results.records import SPLITS, RunResults

#: what the table functions take: the typed results, or the dict a run is about to write
ResultsLike = RunResults | Mapping[str, Any]

__all__ = [
    "format_score",
    "is_detection_metric",
    "metric_name",
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

#: how a metric is named in titles, labels and captions (any other: capitalised, e.g. "Dice")
_METRIC_NAMES = {"iou": "IoU", "miou": "IoU", "jaccard": "IoU", "map": "mAP"}


def metric_name(metric: str) -> str:
    """The metric as a report names it: ``"dice"`` -> ``"Dice"``, ``"iou"`` -> ``"IoU"``, ``"map"`` -> ``"mAP"``."""
    return _METRIC_NAMES.get(metric.lower(), metric.capitalize())


def is_detection_metric(metric: str) -> bool:
    """Whether ``metric`` scores boxes (COCO mAP of a detection protocol) rather than dense labels."""
    return metric.lower() == "map"


def _as_float(value: Any) -> float:
    """Returns ``value`` as float; ``None``/non-numeric become NaN."""
    if value is None:
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


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


def table_title(results: ResultsLike) -> str:
    """One-line title stating protocol, metric, eval mode, background rule and seed.

    Example: ``"synthetic-2d · Dice (mean over foreground classes; background
    excluded) · eval: sliding-window · seed 1024"``.
    """
    results = RunResults.from_json(results)
    if is_detection_metric(results.metric):  # whole images, boxes: no background class, no sliding window
        parts = [results.protocol, "mAP (COCO AP at IoU 0.50:0.95, mean over the classes seen so far)"]
        return " · ".join(parts + ([f"seed {results.seed}"] if results.seed is not None else []))
    bg = results.background
    if "exclud" in bg.lower():
        averaging = "mean over foreground classes; background excluded"
    elif "includ" in bg.lower():
        averaging = "mean over all classes; background included"
    else:
        averaging = f"background: {bg}"
    name = "mIoU ×100" if results.is_iou else metric_name(results.metric)
    parts = [results.protocol, f"{name} ({averaging})"]
    if results.eval_mode:
        parts.append(f"eval: {results.eval_mode}")
    if results.seed is not None:
        parts.append(f"seed {results.seed}")
    return " · ".join(parts)


def comparison_table(results: ResultsLike) -> tuple[list[str], list[list[str]]]:
    """Builds the method-comparison table.

    Args:
        results: the run's results (see module docstring).

    Returns:
        ``(header, rows)``: header is ``["Method", "S0 (<name>)", ...,
        "Base@last", "Total Drop (%)"]``; one row per method (its name with its fidelity mark,
        :func:`jascl.methods.fidelity.mark`) with the
        ``"all"`` score per session, the ``"base"`` score at the method's last
        session and the total drop with one decimal. Sessions a method lacks
        are ``—``.
    """
    results = RunResults.from_json(results)
    metric = results.metric
    header = ["Method"]
    for idx, name in results.session_names():
        header.append(f"S{idx} ({name})" if name else f"S{idx}")
    n_sessions = len(header) - 1
    header += ["Base@last", "Total Drop (%)"]
    rows: list[list[str]] = []
    for name, m in results.methods.items():
        row = [mark(name)]  # the method's fidelity mark: footnotes(results.methods) says what it means
        for i in range(n_sessions):
            row.append(format_score(m.sessions[i].all, metric) if i < len(m.sessions) else MISSING)
        row.append(format_score(m.last.base, metric) if m.last else MISSING)
        row.append(_fmt_pct(m.total_drop))
        rows.append(row)
    return header, rows


def session_detail_table(results: ResultsLike, method: str) -> tuple[list[str], list[list[str]]]:
    """Per-session detail table for one method.

    Returns:
        ``(header, rows)`` with columns Session, Name, All, Old, New, HM (of old and new), Base,
        Background (not for detection runs: a detector scores no background class); one row per session.

    Raises:
        KeyError: If ``method`` is not one of the run's methods.
    """
    results = RunResults.from_json(results)
    m = results.methods[method]
    header = ["Session", "Name", "All", "Old", "New", "HM", "Base", "Background"]
    splits = list(SPLITS)
    if is_detection_metric(results.metric):  # a detector scores no background class
        header, splits = header[:-1], [k for k in splits if k != "background"]
    rows = []
    for s in m.sessions:
        rows.append([str(s.session), s.name] + [format_score(s.score(k), results.metric) for k in splits])
    return header, rows


def md_table(header: list[str], rows: list[list[str]]) -> str:
    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    out = [line(header), "| " + " | ".join("---" for _ in header) + " |"]
    out += [line(r) for r in rows]
    return "\n".join(out)


def per_class_table(results: ResultsLike) -> tuple[list[str], list[list[str]]]:
    """Per-class score at the last session and forgetting (best earlier score - last), per method.

    Rows are the classes of the last session (background first); class names
    come from the results' ``classes`` (id -> name) when present.
    """
    results = RunResults.from_json(results)
    methods, metric = results.methods, results.metric
    header = ["Class"]
    for name in methods:
        header += [f"{name} last", f"{name} forgetting"]
    keys: list[str] = []
    for m in methods.values():
        if m.last:
            keys += [k for k in m.last.per_class if k not in keys]
    rows = []
    for key in sorted(keys, key=_class_sort_key):
        row = [f"{key} {results.classes.get(key, '')}".strip()]
        for m in methods.values():
            last = m.last.per_class.get(key) if m.last else None
            row += [format_score(last, metric), format_score(m.forgetting.get(key), metric)]
        rows.append(row)
    return header, rows


def to_markdown(results: ResultsLike) -> str:
    """Renders the title, the comparison table, one detail table per method and the per-class table."""
    results = RunResults.from_json(results)
    parts = [f"## {table_title(results)}", "", md_table(*comparison_table(results)), ""]
    parts += [f"- {line}" for line in footnotes(results.methods)]
    for name in results.methods:
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


def _csv_rows(results: RunResults) -> list[list[Any]]:
    rows: list[list[Any]] = [["method", "session", "session_name", "split", "value"]]
    for name, m in results.methods.items():
        for s in m.sessions:
            head = [name, s.session, s.name]
            for k in SPLITS:
                rows.append(head + [k, _csv_value(s.score(k))])
            for cls in sorted(s.per_class, key=_class_sort_key):
                rows.append(head + [f"class:{cls}", _csv_value(s.per_class[cls])])
    return rows


def _csv_value(value: Any) -> str:
    v = _as_float(value)
    return "" if math.isnan(v) else repr(v)


def to_csv(results: ResultsLike, path: str | os.PathLike[str]) -> Path:
    """Writes results in long format (atomically).

    Columns: ``method, session, session_name, split, value`` where split is
    one of all/old/new/base/background or ``class:<id>``; missing values are
    empty fields. One header row plus one row per (method, session, split).

    Returns:
        The written path.
    """
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(_csv_rows(RunResults.from_json(results)))
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


def print_tables(results: ResultsLike, console: Any = None) -> None:
    """Prints the comparison and per-method detail tables with ``rich``.

    Args:
        results: the run's results.
        console: A ``rich.console.Console``; a new one if ``None``.
    """
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    results = RunResults.from_json(results)

    def render(title: str, header: list[str], rows: list[list[str]]) -> Table:
        table = Table(title=title)
        for i, h in enumerate(header):
            table.add_column(h, justify="left" if i == 0 else "right", no_wrap=i == 0)
        for r in rows:
            table.add_row(*r)
        return table

    console.print(render(table_title(results), *comparison_table(results)))
    for line in footnotes(results.methods):
        console.print(line, highlight=False, markup=False)
    for name in results.methods:
        console.print(render(f"{name}: per-session detail", *session_detail_table(results, name)))
    console.print(render("per class: score at the last session and forgetting", *per_class_table(results)))


def write_all(results: Mapping[str, Any], out_dir: str | os.PathLike[str]) -> dict[str, Path]:
    """Writes ``results.json`` (``results`` as given), ``results.csv`` and ``results.md`` atomically.

    The dict is checked first (:meth:`RunResults.from_json`), so a malformed
    entry stops here rather than in a later report.

    Returns:
        ``{"json": path, "csv": path, "markdown": path}``.
    """
    typed = RunResults.from_json(results)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md = out / "results.md"
    atomic_write_text(md, to_markdown(typed))
    return {
        "json": write_json(results, out / "results.json"),
        "csv": to_csv(typed, out / "results.csv"),
        "markdown": md,
    }
