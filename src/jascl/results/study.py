"""The component study's tables and figure, read from its folder (``jascl study components``, ``--report``).

Inputs: ``<study>/study-plan.json`` (written by :mod:`jascl.experiments.study`: the variants, which
method's runs each reads, the seeds, the commands) and every seed's run folder, ``<study>/seed-<s>/``
(``results.json`` through :class:`jascl.results.records.RunResults`; each session's ``metrics.json`` for
its wall time). Nothing is retrained and no model is built.

Quantities per variant and seed (scores are fractions; a table shows IoU ×100 as every table does):

* ``all`` per session: the all-class score after training on it;
* ``new`` / ``seen`` / ``hm`` per incremental session: the session's new classes, the classes of earlier
  sessions (the record's ``old``) and their harmonic mean (the run's own, per seed);
* ``base_last``: Base@last, the session-0 classes after the last session;
* ``total_drop``: Total Drop (%) of the all-class scores;
* ``mean_new``: New averaged over the incremental sessions (a session without new classes skipped).

Each is summarised over seeds as mean ± the half-width of the 95 % Student t interval
(:func:`jascl.evaluation.intervals.t_interval`). Per ablation, the paired difference full minus
ablation is taken seed by seed (the two ran from the same base model on the same data) and summarised
the same way (:func:`jascl.evaluation.intervals.paired_interval`). A seed enters only when every variant
finished all its sessions there; the others are listed as incomplete.

Outputs: ``study.md``, ``study.json``, ``variants.csv``, ``differences.csv``, ``seen-new-hm.png`` with
``seen-new-hm.csv`` (the numbers the bars show), ``compute.csv`` (wall time per run and seed).
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jascl.errors import ConfigError
from jascl.evaluation.intervals import Interval, paired_differences, t_interval
from jascl.fileio import atomic_write_bytes, atomic_write_text
from jascl.results.records import MethodResults, RunResults
from jascl.results.report import MISSING, format_score, md_table, metric_name, write_json

#: the study's description of itself, written by jascl.experiments.study
PLAN_FILE = "study-plan.json"

#: the quantities the paired differences are taken for: key -> (row label, a percentage?)
DIFFERENCES = {
    "total_drop": ("Δ Total Drop (pp)", True),
    "last_all": ("Δ last all-class", False),
    "base_last": ("Δ Base@last", False),
    "mean_new": ("Δ mean New", False),
}

INTERVAL_NOTE = "mean ± half-width of the 95 % confidence interval over seeds (Student t, n − 1 degrees of freedom)"


def read_plan(out: str | Path) -> dict:
    """``study-plan.json`` of a study folder.

    Raises:
        ConfigError: no plan (not a study folder) or an unreadable one, naming the file and the fix.
    """
    path = Path(out) / PLAN_FILE
    if not path.is_file():
        raise ConfigError(f"{out}: not a study folder (no {PLAN_FILE}); run 'jascl study components --out {out}' first")
    try:
        plan = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: unreadable ({exc}); rerun the study's command to write it again") from None
    for key in ("protocol", "seeds", "variants"):
        if key not in plan:
            raise ConfigError(f"{path}: missing {key!r}; rerun the study's command to write it again")
    return plan


def _mean(values: Sequence[float]) -> float:
    vals = [v for v in values if not math.isnan(v)]
    return sum(vals) / len(vals) if vals else math.nan


def _per_seed(m: MethodResults) -> dict[str, Any]:
    """The quantities of one variant in one seed (module docstring)."""
    incremental = m.sessions[1:]
    last = m.sessions[-1]
    return {
        "all": [r.all for r in m.sessions],
        "new": [r.new for r in incremental],
        "seen": [r.old for r in incremental],
        "hm": [r.hm for r in incremental],
        "base_last": last.base,
        "last_all": last.all,
        "total_drop": m.total_drop,
        "mean_new": _mean([r.new for r in incremental]),
    }


def _interval(values: Sequence[float]) -> dict[str, Any]:
    iv = t_interval(values)
    return {
        "mean": iv.mean,
        "half_width": iv.half_width,
        "low": iv.low,
        "high": iv.high,
        "n": iv.n,
        "values": list(values),
    }


def _seconds(path: Path) -> float:
    try:
        value = json.loads(path.read_text()).get("seconds")
    except (OSError, json.JSONDecodeError, AttributeError):
        return math.nan
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


def compute_rows(out: Path, seeds: Sequence[int], methods: Sequence[str]) -> list[dict[str, Any]]:
    """Wall time per run: every shared base (``base*``) and every method's sessions, per seed, from the
    ``seconds`` each session's ``metrics.json`` records (the time of the process that finished it)."""
    rows = []
    for seed in seeds:
        folder = out / f"seed-{seed}"
        for base in sorted(folder.glob("base*/metrics.json")):
            rows.append({"seed": seed, "run": base.parent.name, "sessions": 1, "seconds": _seconds(base)})
        for method in methods:
            files = sorted((folder / method).glob("s*/metrics.json"))
            if files:
                total = sum(_seconds(f) for f in files)
                rows.append({"seed": seed, "run": method, "sessions": len(files), "seconds": total})
    return rows


def summarise(out: str | Path, seeds: Sequence[int] | None = None) -> dict[str, Any]:
    """Everything the study's tables and figure show, from the study folder (module docstring).

    ``seeds``: the seeds to show, in this order (default: those of the plan's last command; a study whose seeds
    were run by different commands into one folder is shown whole by naming them all).
    """
    out = Path(out)
    plan = read_plan(out)
    plan_seeds = list(plan["seeds"]) if seeds is None else list(dict.fromkeys(int(s) for s in seeds))
    variants = [v for v in plan["variants"] if v["status"] != "skipped"]
    sources = list(dict.fromkeys(v["runs_from"] for v in variants))
    runs: dict[int, RunResults] = {}
    incomplete: dict[int, str] = {}
    for seed in plan_seeds:
        path = out / f"seed-{seed}" / "results.json"
        if not path.is_file():
            incomplete[seed] = "no results.json (not finished)"
            continue
        results = RunResults.read(path)
        lengths = {m: len(results.methods[m].sessions) for m in sources if m in results.methods}
        missing = [m for m in sources if m not in lengths]
        if missing or len(set(lengths.values())) != 1:
            incomplete[seed] = f"missing {', '.join(missing)}" if missing else "unequal session counts"
            continue
        runs[seed] = results
    seeds = list(runs)
    first = next(iter(runs.values()), RunResults())
    sessions = first.session_names() if runs else []
    per_variant: dict[str, list[dict[str, Any]]] = {
        v["method"]: [_per_seed(runs[s].methods[v["runs_from"]]) for s in seeds] for v in variants
    }
    rows = []
    for v in variants:
        seeds_q = per_variant[v["method"]]
        entry = {k: v[k] for k in ("component", "label", "method", "status", "runs_from", "note")}
        entry["all"] = [{"session": t, "name": n, **_interval([q["all"][t] for q in seeds_q])} for t, n in sessions]
        for key in ("new", "seen", "hm"):
            entry[key] = [
                {"session": t, "name": n, **_interval([q[key][t - 1] for q in seeds_q])} for t, n in sessions[1:]
            ]
        for key in ("base_last", "last_all", "total_drop", "mean_new"):
            entry[key] = _interval([q[key] for q in seeds_q])
        rows.append(entry)
    full = next((per_variant[v["method"]] for v in variants if v["component"] == "full"), None)
    differences = []
    for v in variants:
        if v["component"] == "full" or full is None:
            continue
        for key in DIFFERENCES:
            diffs = paired_differences([q[key] for q in full], [q[key] for q in per_variant[v["method"]]])
            differences.append(
                {
                    "component": v["component"],
                    "label": v["label"],
                    "method": v["method"],
                    "quantity": key,
                    **_interval(diffs),
                }
            )
    # the same session-0 model gives the same session-0 scores (compared as text: NaN equals NaN)
    same_base = {seed: len({f"{runs[seed].methods[m].sessions[0].all:.12g}" for m in sources}) == 1 for seed in seeds}
    compute = compute_rows(out, plan_seeds, sources)
    return {
        "study": plan.get("study", "components"),
        "protocol": plan["protocol"],
        "task": plan.get("task", "segmentation"),
        "metric": first.metric,
        "background": first.background,
        "interval": INTERVAL_NOTE,
        "seeds": seeds,
        "incomplete_seeds": {str(k): v for k, v in incomplete.items()},
        "sessions": [{"session": t, "name": n} for t, n in sessions],
        "variants": rows,
        "skipped": [
            {k: v[k] for k in ("component", "label", "method", "note")}
            for v in plan["variants"]
            if v["status"] == "skipped"
        ],
        "differences": differences,
        "same_base": {str(k): v for k, v in same_base.items()},
        "compute": {
            "runs": compute,
            "total_seconds": sum(r["seconds"] for r in compute),
            "commands": plan.get("commands", []),
        },
    }


def format_interval(entry: Mapping[str, Any], metric: str, pct: bool = False, signed: bool = False) -> str:
    """``mean ± half-width`` as the tables show it (Total Drop in % with one decimal; ``signed``: a leading sign)."""
    mean, half = entry["mean"], entry["half_width"]
    if mean is None or math.isnan(mean):
        return MISSING
    if pct:
        text, width = (f"{mean:+.1f}" if signed else f"{mean:.1f}"), f"{half:.1f}"
    else:
        sign = ("-" if mean < 0 else "+") if signed else ""
        text, width = sign + format_score(abs(mean) if signed else mean, metric), format_score(half, metric)
    return text if half is None or math.isnan(half) else f"{text} ± {width}"


def variants_table(summary: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    """One row per variant: all-class score per session, New per incremental session, Base@last, Total Drop."""
    metric = summary["metric"]
    sessions = summary["sessions"]
    header = [
        "Variant",
        "method",
        *[f"S{s['session']} all" for s in sessions],
        *[f"S{s['session']} New" for s in sessions[1:]],
        "Base@last",
        "Total Drop (%)",
    ]
    rows = []
    for v in summary["variants"]:
        label = v["label"] if v["status"] == "run" else f"{v['label']} (= {v['runs_from']})"
        rows.append(
            [
                label,
                f"`{v['method']}`",
                *[format_interval(e, metric) for e in v["all"]],
                *[format_interval(e, metric) for e in v["new"]],
                format_interval(v["base_last"], metric),
                format_interval(v["total_drop"], metric, pct=True),
            ]
        )
    return header, rows


def differences_table(summary: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    """One row per ablation: the paired difference full minus ablation of each quantity, a star where the
    95 % interval excludes 0, and the number of seed pairs (a cell with fewer, where a seed's value is
    undefined, says its own ``n``)."""
    metric = summary["metric"]
    header = ["Component removed", "ablation", *[label for label, _ in DIFFERENCES.values()], "pairs"]
    by_method: dict[str, list[Mapping[str, Any]]] = {}
    for d in summary["differences"]:
        by_method.setdefault(d["method"], []).append(d)
    rows = []
    for method, cells in by_method.items():
        pairs = max(d["n"] for d in cells)
        row = [cells[0]["label"], f"`{method}`"]
        for d in cells:
            text = format_interval(d, metric, pct=DIFFERENCES[d["quantity"]][1], signed=True)
            if Interval(d["mean"], d["half_width"], d["n"], math.nan).excludes_zero():
                text += " *"
            row.append(text + (f" (n={d['n']})" if 0 < d["n"] < pairs else ""))
        rows.append([*row, str(pairs)])
    return header, rows


def _fmt_s(seconds: float) -> str:
    return MISSING if math.isnan(seconds) else f"{seconds:.0f}"


def to_markdown(summary: Mapping[str, Any]) -> str:
    """The study as one Markdown page: commands, the two tables, notes, the figure, the compute."""
    seeds = summary["seeds"]
    name = metric_name(summary["metric"])
    lines = [
        f"# Component study: JASCL on {summary['protocol']}",
        "",
        f"{len(seeds)} seed{'s' if len(seeds) != 1 else ''} ({', '.join(map(str, seeds)) or 'none finished'}); "
        f"scores: {name}, background {summary['background']}. Each cell: {summary['interval']}.",
        "",
    ]
    commands = summary["compute"]["commands"]
    if commands:
        lines += ["Command (as run; rerun it to continue the study, add `--report` to re-render these tables):", ""]
        lines += ["```", *[c["command"] or "(from the Python API)" for c in commands[-1:]], "```", ""]
    if summary["incomplete_seeds"]:
        lines += [
            "Not in the tables (unfinished): "
            + "; ".join(f"seed {s}: {why}" for s, why in summary["incomplete_seeds"].items()),
            "",
        ]
    same = summary["same_base"]
    if same:
        verdict = "yes" if all(same.values()) else "NO in seeds " + ", ".join(s for s, ok in same.items() if not ok)
        lines += [f"Same session-0 model for every variant (identical session-0 scores per seed): {verdict}.", ""]
    header, rows = variants_table(summary)
    lines += ["## Variants", "", md_table(header, rows), ""]
    notes = [f"- {v['label']} (`{v['method']}`): {v['note']}" for v in summary["variants"] if v["note"]]
    notes += [f"- {v['label']} (`{v['method']}`): {v['note']}" for v in summary["skipped"]]
    if notes:
        lines += ["Notes:", "", *notes, ""]
    if summary["differences"]:
        header, rows = differences_table(summary)
        lines += [
            "## Paired differences: full JASCL minus each ablation",
            "",
            "Seed by seed (same seed, same data, same base model), then mean ± 95 % half-width (paired Student t). "
            "A positive score difference means the component helps; a negative Total Drop difference means it "
            "reduces forgetting. * : the interval excludes 0.",
            "",
            md_table(header, rows),
            "",
        ]
    lines += [
        "## Seen / New / HM per session",
        "",
        "![Seen / New / HM](seen-new-hm.png)",
        "",
        "After each incremental session: Seen = the classes of earlier sessions, New = the session's new classes, "
        "HM = their harmonic mean (per seed, then averaged); bars: 95 % intervals. Numbers: `seen-new-hm.csv`.",
        "",
        "## Compute",
        "",
    ]
    compute = summary["compute"]
    runs = [[str(r["seed"]), r["run"], str(r["sessions"]), _fmt_s(r["seconds"])] for r in compute["runs"]]
    lines += [
        "Wall time per run, from each session's `metrics.json` (a resumed session counts its last process only):",
        "",
        md_table(["seed", "run", "sessions", "wall time (s)"], runs),
        "",
        f"Total: {_fmt_s(compute['total_seconds'])} s.",
        "",
    ]
    if commands:
        cmd_rows = [
            [
                c.get("started", ""),
                _fmt_s(c["seconds"] if c.get("seconds") is not None else math.nan),
                "yes" if c.get("finished") else "no",
                f"`{c['command']}`" if c["command"] else "(Python API)",
            ]
            for c in commands
        ]
        lines += [
            "Commands that ran the study:",
            "",
            md_table(["started", "wall time (s)", "finished", "command"], cmd_rows),
            "",
        ]
    return "\n".join(lines)


def _csv(rows: Sequence[Sequence[Any]]) -> str:
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(rows)
    return buf.getvalue()


def _num(v: Any) -> str:
    return "" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.10g}"


def _joined(values: Sequence[float]) -> str:
    return ";".join(_num(v) for v in values)


def write_study(out: str | Path, seeds: Sequence[int] | None = None) -> dict[str, Any]:
    """Summarise the study folder ``out`` (over ``seeds``, see :func:`summarise`) and write its tables and figure
    there; returns the summary."""
    from jascl.results.study_figure import MEASURES, seen_new_hm_figure

    out = Path(out)
    summary = summarise(out, seeds)
    atomic_write_text(out / "study.md", to_markdown(summary))
    write_json(summary, out / "study.json")
    stat = ["mean", "half_width", "low", "high", "n"]
    variant_rows: list[list[Any]] = [
        ["variant", "method", "runs_from", "quantity", "session", "session_name", *stat, "per_seed"]
    ]
    figure_rows: list[list[Any]] = [
        ["variant", "method", "session", "session_name", "measure", "mean", "half_width", "n", "per_seed"]
    ]
    for v in summary["variants"]:
        head = [v["label"], v["method"], v["runs_from"]]
        for key in ("all", "new", "seen", "hm"):
            for e in v[key]:
                variant_rows.append(
                    [*head, key, e["session"], e["name"], *(_num(e[k]) for k in stat), _joined(e["values"])]
                )
        for key in ("base_last", "last_all", "total_drop", "mean_new"):
            e = v[key]
            variant_rows.append([*head, key, "", "", *(_num(e[k]) for k in stat), _joined(e["values"])])
        for i, s in enumerate(summary["sessions"][1:]):
            for key, _ in MEASURES:
                e = v[key][i]
                figure_rows.append(
                    [
                        v["label"],
                        v["method"],
                        s["session"],
                        s["name"],
                        key,
                        _num(e["mean"]),
                        _num(e["half_width"]),
                        e["n"],
                        _joined(e["values"]),
                    ]
                )
    atomic_write_text(out / "variants.csv", _csv(variant_rows))
    atomic_write_text(out / "seen-new-hm.csv", _csv(figure_rows))
    diff_rows: list[list[Any]] = [["component", "variant", "method", "quantity", *stat, "per_seed_difference"]]
    for d in summary["differences"]:
        diff_rows.append(
            [d["component"], d["label"], d["method"], d["quantity"], *(_num(d[k]) for k in stat), _joined(d["values"])]
        )
    atomic_write_text(out / "differences.csv", _csv(diff_rows))
    compute_csv = [["seed", "run", "sessions", "seconds"]]
    compute_csv += [[r["seed"], r["run"], r["sessions"], _num(r["seconds"])] for r in summary["compute"]["runs"]]
    atomic_write_text(out / "compute.csv", _csv(compute_csv))
    bars = {
        v["label"]: [
            {key: (v[key][i]["mean"], v[key][i]["half_width"]) for key, _ in MEASURES}
            for i in range(len(summary["sessions"]) - 1)
        ]
        for v in summary["variants"]
    }
    panels = [f"S{s['session']} ({s['name']})" for s in summary["sessions"][1:]]
    atomic_write_bytes(out / "seen-new-hm.png", seen_new_hm_figure(panels, bars, metric_name(summary["metric"])))
    return summary
