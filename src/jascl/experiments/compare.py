"""``jascl compare``: several methods, several seeds, one paper-style table with mean ± std.

Fairness is by construction: for every seed, all methods run in one run folder
(:func:`jascl.experiments.runner.run_benchmark`), so they share the protocol, the
data and K-shot manifest of that seed, the session-0 checkpoint (methods that do
not change session 0 all start from the same base model; those that do train
their own) and the evaluation code. Finished sessions are reused, so a compare
that was interrupted, or that adds a method to an earlier compare, only trains
what is missing.

Folder layout::

    <out>/seed-<s>/...          one run folder per seed (see jascl.experiments.runner)
    <out>/compare.{md,csv,json}
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jascl.engine.config import RunConfig
from jascl.errors import ConfigError
from jascl.experiments.launcher import Launcher
from jascl.fileio import atomic_write_text
from jascl.protocols.schema import Protocol
from jascl.results.fidelity import footnotes, mark
from jascl.results.records import RunResults
from jascl.results.report import MISSING, format_score, md_table, table_title

#: the largest seed count ``--num-seeds`` accepts
MAX_SEED_COUNT = 100


def parse_seeds(spec: str | int | None, base_seed: int, count: int | None = None) -> list[int]:
    """The seeds of a multi-seed command: ``--seeds`` gives seed values, ``--num-seeds`` a count.

    ``"1024"`` -> the seed 1024; ``"1024,7"`` -> those seeds (``"1024,"`` as before: 1024); ``count=3`` ->
    three seeds from ``base_seed`` (``base, base+1, base+2``); neither -> ``[base_seed]``. Earlier versions read
    a bare number as a count (``--seeds 3``); it is a seed value now, so that ``--seeds 1024`` means the
    seed 1024, and counts are ``--num-seeds``. Folders keep their ``seed-<s>/`` names, so a folder made
    with ``--seeds 3`` continues with ``--num-seeds 3``.

    Raises:
        ConfigError: both given, a count outside 1..:data:`MAX_SEED_COUNT`, or seeds that are not distinct
        non-negative integers.
    """
    if spec is not None and count is not None:
        raise ConfigError(
            f"--seeds {spec} with --num-seeds {count}: give the seed values (--seeds 1024,7) or a count from "
            "the protocol's seed (--num-seeds 3), not both"
        )
    if count is not None:
        if not 1 <= int(count) <= MAX_SEED_COUNT:
            raise ConfigError(f"--num-seeds {count}: give a count from 1 to {MAX_SEED_COUNT}")
        return [base_seed + i for i in range(int(count))]
    if spec is None:
        return [base_seed]
    text = str(spec).strip()
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
        if not seeds:
            raise ValueError
    except ValueError:
        raise ConfigError(
            f"--seeds {spec}: give seed values, e.g. 1024 or 1024,7 (a count of seeds is --num-seeds 3)"
        ) from None
    if any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise ConfigError(f"--seeds {spec}: seeds must be distinct non-negative integers")
    return seeds


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof = 1; 0 for a single value) of the non-NaN values."""
    vals = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    if not vals:
        return math.nan, math.nan
    return statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else 0.0)


def aggregate(per_seed: Mapping[int, RunResults | Mapping[str, Any]], methods: Sequence[str]) -> dict:
    """Combine the results dicts of several seeds into mean ± std per method, session and Total Drop.

    Args:
        per_seed: seed -> the results ``run_benchmark`` returned (a dict) or read back (:class:`RunResults`).
        methods: method names, in table order.

    Returns:
        ``{"seeds": [...], "metric", "methods": {name: {"sessions": [{"session", "name", "all": [mean, std],
        "old": ..., "new": ..., "values": [per-seed all]}], "total_drop": [mean, std], "total_drop_values": [...]}}}``
    """
    typed = {seed: RunResults.from_json(r, f"results of seed {seed}") for seed, r in per_seed.items()}
    seeds = list(typed)
    first = typed[seeds[0]]
    out: dict = {
        "protocol": first.protocol,
        "metric": first.metric,
        "eval_mode": first.eval_mode,
        "background": first.background,
        "seeds": seeds,
        "methods": {},
    }
    for name in methods:
        runs = [typed[s].methods[name] for s in seeds]
        n_sessions = max(len(r.sessions) for r in runs)
        sessions = []
        for t in range(n_sessions):
            records = [r.sessions[t] for r in runs if t < len(r.sessions)]
            entry: dict[str, Any] = {"session": t, "name": records[0].name}
            for key in ("all", "old", "new", "base"):
                entry[key] = list(mean_std([rec.score(key) for rec in records]))
            entry["values"] = [rec.all for rec in records]
            sessions.append(entry)
        drops = [r.total_drop for r in runs]
        out["methods"][name] = {"sessions": sessions, "total_drop": list(mean_std(drops)), "total_drop_values": drops}
    return out


def _pm(pair: Sequence[float], metric: str, pct: bool = False, n: int = 1) -> str:
    mean, std = pair
    if mean is None or math.isnan(mean):
        return MISSING
    if pct:
        text = f"{mean:.1f}"
        return text if n < 2 else f"{text} ± {std:.1f}"
    text = format_score(mean, metric)
    return text if n < 2 else f"{text} ± {format_score(std, metric)}"


def compare_table(summary: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    """One row per method (its name with its fidelity mark), one column per session (all-class mean ± std over
    seeds), then Total Drop (%)."""
    metric = str(summary.get("metric", "dice"))
    n = len(summary.get("seeds", []))
    methods = summary["methods"]
    longest: list[dict[str, Any]] = max((m["sessions"] for m in methods.values()), key=len, default=[])
    header = ["Method", *[f"S{s['session']} ({s['name']})" for s in longest], "Total Drop (%)"]
    rows = []
    for name, m in methods.items():
        row = [mark(name)]  # the method's fidelity mark (footnotes under the table)
        for t in range(len(longest)):
            row.append(_pm(m["sessions"][t]["all"], metric, n=n) if t < len(m["sessions"]) else MISSING)
        row.append(_pm(m["total_drop"], metric, pct=True, n=n))
        rows.append(row)
    return header, rows


def compare_title(summary: Mapping[str, Any]) -> str:
    seeds = summary.get("seeds", [])
    header = RunResults(
        protocol=str(summary.get("protocol") or "run"),
        metric=str(summary.get("metric") or "dice"),
        eval_mode=str(summary.get("eval_mode") or ""),
        background=str(summary.get("background", "excluded from means")),
    )
    base = table_title(header)
    return f"{base} · mean ± std over {len(seeds)} seed{'s' if len(seeds) != 1 else ''} ({', '.join(map(str, seeds))})"


def write_compare(summary: Mapping[str, Any], out: Path) -> dict[str, Path]:
    """Write ``compare.md``, ``compare.csv`` (one row per method, session and seed-aggregate) and ``compare.json``."""
    out.mkdir(parents=True, exist_ok=True)
    header, rows = compare_table(summary)
    notes = "".join(f"\n- {line}" for line in footnotes(summary["methods"]))
    md = f"**{compare_title(summary)}**\n\n{md_table(header, rows)}\n{notes}\n"
    paths = {"md": out / "compare.md", "csv": out / "compare.csv", "json": out / "compare.json"}
    atomic_write_text(paths["md"], md)
    lines = ["method,session,name,all_mean,all_std,old_mean,old_std,new_mean,new_std,per_seed_all"]
    for name, m in summary["methods"].items():
        for s in m["sessions"]:
            cells = [
                name,
                str(s["session"]),
                str(s["name"]),
                *(f"{v:.6g}" for key in ("all", "old", "new") for v in s[key]),
                '"' + ";".join(f"{v:.6g}" for v in s["values"]) + '"',
            ]
            lines.append(",".join(cells))
        lines.append(
            ",".join(
                [
                    name,
                    "total_drop",
                    "",
                    *(f"{v:.6g}" for v in m["total_drop"]),
                    "",
                    "",
                    "",
                    "",
                    '"' + ";".join(f"{v:.6g}" for v in m["total_drop_values"]) + '"',
                ]
            )
        )
    atomic_write_text(paths["csv"], "\n".join(lines) + "\n")
    atomic_write_text(paths["json"], json.dumps(summary, indent=1, default=float))
    return paths


def run_compare(
    protocol: Protocol,
    config: RunConfig,
    methods: Sequence[str],
    seeds: Sequence[int],
    out: str | Path,
    cache_dir: str | Path | None = None,
    progress: bool = True,
    echo=print,
    launcher: Launcher | None = None,
    **run_kwargs: Any,
) -> dict:
    """Run (or reuse) every method for every seed and write the aggregated table.

    The protocol's seed is replaced by each seed in turn (it drives data
    generation / K-shot selection and training); ``config.seed`` must be unset
    so that the training seed follows. With a ``launcher`` every missing shared session-0 base, then every
    (method, seed) cell that is not finished, runs as its own job first (:mod:`jascl.experiments.launcher`);
    the tables are then written from the same folders as without one.
    """
    from jascl.experiments.runner import run_benchmark

    if config.seed is not None:
        raise ConfigError("compare: do not set 'seed' in the configuration; give the seeds with --seeds")
    out = Path(out)
    if launcher is not None:
        from jascl.experiments.fanout import run_grid

        run_grid(
            launcher, protocol, config, methods, seeds, out, {"cache_dir": cache_dir, **run_kwargs}, progress, echo
        )
    per_seed: dict[int, dict] = {}
    for i, seed in enumerate(seeds):
        echo(f"[compare] seed {seed} ({i + 1}/{len(seeds)})")
        seeded = dataclasses.replace(protocol, seed=seed)
        per_seed[seed] = run_benchmark(
            seeded,
            config,
            methods,
            out / f"seed-{seed}",
            cache_dir=cache_dir,
            progress=progress,
            echo=echo,
            **run_kwargs,
        )
    summary = aggregate(per_seed, methods)
    write_compare(summary, out)
    return summary
