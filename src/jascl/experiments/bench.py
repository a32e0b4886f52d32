"""``jascl bench``: what the framework and each part of JASCL cost, against plain loops a user would write.

Every case trains the same model (the protocol's backbone, grown to the
classes of session ``--session``, with the same freezing policy) on the same
session data with the same batch size, device and precision:

=================  =====================================================================
``plain``          a plain PyTorch/MONAI loop: DataLoader, ``DiceCELoss``, the configured optimiser
``vanilla``        jascl's loop with no method plugins (``vanilla``)
``gas+replay``     jascl with GAS and prototype replay (``jascl-no-unlabelled``)
``plain-mt``       a plain mean-teacher loop: each step adds an unlabelled batch (two
                   views), the unfiltered soft consistency loss and an EMA teacher update
``pas``            jascl with GAS, prototype replay and the PAS mean teacher, an
                   unlabelled batch every step (``jascl`` with an unlabelled phase every epoch)
``eval-plain``     MONAI ``sliding_window_inference`` + argmax over the test splits
``eval``           jascl's evaluator (confusion matrix, memory-bounded blocks) on the same
=================  =====================================================================

Training throughput is steps per second over the training steps of every
epoch after the first (warm-up); the work jascl does between epochs (the PAS
prototype pass at the start of an unlabelled phase, logging, checkpoints) is
reported separately as seconds per epoch. The warm-up epoch also counts the
operators the main process dispatches per training step, outside data loading
(:class:`OpCounter`): all of them, and those that are not views (on a GPU, roughly
the kernels launched). These counts do not depend on the machine (they are
skipped with ``compile=true``, where a dispatch mode would change what is compiled); on a GPU running a
small model, where a step's time is mostly launches, they predict the ratios.
Each case runs in a fresh process
(``python -m jascl.experiments.bench_cases``, :mod:`jascl.experiments.bench_cases`), the cases are interleaved over
``rounds`` and the median is reported; peak memory is the CUDA allocator's
peak on a GPU, and the process's peak resident set size on a CPU.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

TRAIN_CASES = ("plain", "vanilla", "gas+replay", "plain-mt", "pas")


EVAL_CASES = ("eval-plain", "eval")


CASES = TRAIN_CASES + EVAL_CASES


#: (case, baseline, target ratio of throughputs, what it shows)
RATIOS = (
    ("vanilla", "plain", 0.95, "framework overhead: jascl vanilla / plain loop"),
    ("gas+replay", "vanilla", 0.97, "GAS + prototype replay / jascl vanilla"),
    ("pas", "plain-mt", 0.90, "PAS (GAS + replay + PAS mean teacher) / plain mean teacher"),
    ("eval", "eval-plain", 0.95, "jascl evaluator / plain sliding-window loop"),
)


def run_bench(
    protocol: str,
    session: int = 1,
    epochs: int = 4,
    rounds: int = 3,
    device: str = "auto",
    overrides: Sequence[str] = (),
    cases: Sequence[str] = CASES,
    cache_dir: str | None = None,
    eval_repeats: int = 2,
    threads: int = 0,
    echo: Callable[[str], None] = print,
) -> dict:
    """Run every case ``rounds`` times, interleaved, each in a fresh process; medians and ratios."""
    from jascl.engine.config import resolve_config
    from jascl.errors import ConfigError
    from jascl.protocols import get_protocol

    p = get_protocol(protocol)
    resolve_config(p.training, p.path, None, list(overrides))  # fail fast on bad input
    if not 1 <= session < len(p.sessions):
        raise ConfigError(f"--session {session}: protocol {p.name} has incremental sessions 1..{len(p.sessions) - 1}")
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        raise ConfigError(f"--cases {','.join(unknown)}: choose from {', '.join(CASES)}")
    if epochs < 2 or rounds < 1:
        raise ConfigError(f"--epochs {epochs} --rounds {rounds}: need epochs >= 2 (the first warms up) and rounds >= 1")
    if any(c in ("plain-mt", "pas") for c in cases) and not p.sessions[session].unlabelled:
        raise ConfigError(
            f"protocol {p.name} session {session} has no unlabelled pool for the mean-teacher cases; "
            "use --protocol bench-2d or leave out plain-mt,pas"
        )
    spec = {
        "protocol": protocol,
        "session": session,
        "epochs": epochs,
        "overrides": list(overrides),
        "device": device,
        "cache_dir": cache_dir,
        "eval_repeats": eval_repeats,
        "threads": threads,
    }
    # generate and cache the data once, before any timing
    from jascl.data.sessions import load_sessions

    load_sessions(
        p, cache_dir, echo=lambda m: echo(f"[bench] {m}"), patch_size=resolve_config(p.training, p.path).patch_size
    )
    runs: dict[str, list[dict]] = {c: [] for c in cases}
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]),
    }
    for r in range(rounds):
        for case in cases:
            echo(f"[bench] round {r + 1}/{rounds}: {case}")
            done = subprocess.run(
                [sys.executable, "-m", "jascl.experiments.bench_cases", case, json.dumps(spec)],
                capture_output=True,
                text=True,
                env=env,
            )
            if done.returncode == 2 and done.stderr.startswith("jascl: error: "):  # bad input: one line
                raise ConfigError(done.stderr.strip().splitlines()[-1][len("jascl: error: ") :])
            if done.returncode != 0:
                raise RuntimeError(f"bench case {case} failed:\n{done.stderr[-4000:]}")
            runs[case].append(json.loads(done.stdout.strip().splitlines()[-1]))
    return summarise(runs, spec)


def summarise(runs: dict[str, list[dict]], spec: dict) -> dict:
    """Median throughput per case (steps or samples per second), peak memory, and the ratios of :data:`RATIOS`."""
    rows = {}
    for case, results in runs.items():
        rates = [r["steps"] / r["seconds"] for r in results if r["seconds"] > 0]
        between = [r["between_epoch_seconds"] for r in results if r.get("between_epoch_seconds") is not None]
        rows[case] = {
            "rate": statistics.median(rates) if rates else math.nan,
            "rate_min": min(rates) if rates else math.nan,
            "rate_max": max(rates) if rates else math.nan,
            "unit": "samples/s" if case in EVAL_CASES else "steps/s",
            "peak_mib": max(r["peak_mib"] for r in results),
            "memory": results[0]["memory"],
            "between_epoch_seconds": statistics.median(between) if between else None,
            "rounds": len(results),
        }
        for key in ("ops_per_step", "kernels_per_step"):  # the same in every round
            values = [r[key] for r in results if r.get(key) is not None]
            rows[case][key] = statistics.median(values) if values else None
    ratios = []
    for case, base, target, what in RATIOS:
        if case in rows and base in rows:
            value = rows[case]["rate"] / rows[base]["rate"]
            unit = "sample" if case in EVAL_CASES else "step"
            added_ms = 1000.0 / rows[case]["rate"] - 1000.0 / rows[base]["rate"]
            kernels = (
                rows[case]["kernels_per_step"] - rows[base]["kernels_per_step"]
                if rows[case].get("kernels_per_step") is not None and rows[base].get("kernels_per_step") is not None
                else None
            )
            ratios.append(
                {
                    "ratio": f"{case} / {base}",
                    "value": value,
                    "target": target,
                    "met": value >= target,
                    "what": what,
                    "added_ms": added_ms,
                    "unit": unit,
                    "added_kernels": kernels,
                }
            )
    device = next(iter(runs.values()))[0]["device"] if runs else "?"
    return {"spec": spec, "device": device, "cases": rows, "ratios": ratios}


def tables(summary: dict) -> tuple[list[list[str]], list[list[str]]]:
    """Rows of the throughput table and of the ratio table (strings)."""
    case_rows = []
    for case, row in summary["cases"].items():
        between = row["between_epoch_seconds"]
        ops = "-" if row.get("ops_per_step") is None else f"{row['ops_per_step']:.0f} ({row['kernels_per_step']:.0f})"
        case_rows.append(
            [
                case,
                f"{row['rate']:.2f} {row['unit']}",
                f"{row['rate_min']:.2f}-{row['rate_max']:.2f}",
                f"{row['peak_mib']:.0f}",
                "-" if between is None else f"{between:.3f}",
                ops,
            ]
        )
    ratio_rows = [
        [
            r["ratio"],
            f"{r['value']:.3f}",
            f">= {r['target']:.2f}",
            "yes" if r["met"] else "NO",
            f"{r.get('added_ms', math.nan):+.2f} ms/{r.get('unit', 'step')}"
            + ("" if r.get("added_kernels") is None else f", {r['added_kernels']:+.0f} kernels"),
            r["what"],
        ]
        for r in summary["ratios"]
    ]
    return case_rows, ratio_rows


def to_markdown(summary: dict) -> str:
    spec = summary["spec"]
    case_rows, ratio_rows = tables(summary)
    mem = next(iter(summary["cases"].values()))["memory"] if summary["cases"] else ""
    lines = [
        f"jascl bench · protocol {spec['protocol']} session {spec['session']} · {summary['device']} · "
        f"{spec['epochs'] - 1} timed epochs x {next(iter(summary['cases'].values()))['rounds']} rounds · "
        f"overrides: {' '.join(spec['overrides']) or 'none'}",
        "",
        f"| case | throughput (median) | range | peak memory (MiB, {mem}) | between epochs (s) "
        "| ops/step (not views) |",
        "|---|---|---|---|---|---|",
    ]
    lines += ["| " + " | ".join(r) + " |" for r in case_rows]
    lines += ["", "| ratio | value | target | met | added per step | what |", "|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(r) + " |" for r in ratio_rows]
    return "\n".join(lines) + "\n"
