"""``jascl study components``: the full method and one ablation per component, from the same base, over seeds."""

from __future__ import annotations

import argparse
import shlex
import time
from collections.abc import Callable
from pathlib import Path

from jascl.cli.common import _console, _data_args, _echo, _protocol_and_overrides, add_root_arguments

STUDY_HELP = (
    "full JASCL and w/o GAS / replay / PAS / unlabelled from the same base model over seeds: mean ± 95 %% "
    "interval, paired differences, the Seen / New / HM figure (resumable; --report re-renders)"
)


def add_study_parser(
    sub: argparse._SubParsersAction,
    common: Callable[[argparse.ArgumentParser], None],
    add_launcher_arguments: Callable[[argparse.ArgumentParser], None],
) -> None:
    """``jascl study components ...`` (``common``: the options every run command shares, ``--preset`` among them)."""
    study = sub.add_parser("study", help="studies of JASCL: 'jascl study components' (component ablations)")
    studies = study.add_subparsers(dest="study")
    study.set_defaults(func=lambda args: _no_study(study))
    p = studies.add_parser("components", help=STUDY_HELP, description=STUDY_HELP.replace("%%", "%"))
    common(p)
    add_root_arguments(p)
    p.add_argument(
        "--seeds",
        default=None,
        help="the seeds, e.g. 1024,7,1 (default: --num-seeds 3; an interval needs at least 2, a claim at least 3)",
    )
    p.add_argument(
        "--num-seeds", type=int, default=None, metavar="N", help="N seeds counted from the protocol's (default 3)"
    )
    p.add_argument(
        "--components",
        default="all",
        help="the components to ablate, any of gas,replay,pas,unlabelled (default all); full JASCL always runs",
    )
    p.add_argument(
        "--out", default=None, help="study folder (default runs/study-components-<protocol>); rerun to continue"
    )
    p.add_argument(
        "--report",
        action="store_true",
        help="train nothing: re-render the tables and the figure from what the --out folder holds, over --seeds "
        "if given (default: the seeds of the last command that ran the study)",
    )
    add_launcher_arguments(p)
    p.set_defaults(func=cmd_study_components)


def _no_study(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def _print_summary(console, summary: dict) -> None:
    """The headline numbers in the terminal (last all-class score, mean New, Base@last, Total Drop, and the
    paired differences); every session's numbers are in study.md."""
    from rich.table import Table

    from jascl.results.study import differences_table, format_interval

    seeds = summary["seeds"]
    metric = summary["metric"]
    table = Table(
        title=f"component study: JASCL on {summary['protocol']}, {len(seeds)} seeds "
        f"({', '.join(map(str, seeds))}); mean ± 95 % interval (Student t)"
    )
    for h in ("Variant", "method", "last all-class", "mean New", "Base@last", "Total Drop (%)"):
        table.add_column(h)
    for v in summary["variants"]:
        label = v["label"] if v["status"] == "run" else f"{v['label']} (= {v['runs_from']})"
        table.add_row(
            label,
            v["method"],
            format_interval(v["last_all"], metric),
            format_interval(v["mean_new"], metric),
            format_interval(v["base_last"], metric),
            format_interval(v["total_drop"], metric, pct=True),
        )
    console.print(table)
    if summary["differences"]:
        header, rows = differences_table(summary)
        diff = Table(title="paired differences, full minus ablation (* : the 95 % interval excludes 0)")
        for h in header:
            diff.add_column(h)
        for r in rows:
            diff.add_row(*(c.strip("`") for c in r))
        console.print(diff)
    for v in [*summary["variants"], *summary["skipped"]]:
        if v["note"]:
            console.print(f"{v['label']} ({v['method']}): {v['note']}", markup=False, highlight=False)
    for seed, why in summary["incomplete_seeds"].items():
        console.print(f"seed {seed} is not in the tables: {why}", markup=False)


def cmd_study_components(args: argparse.Namespace) -> int:
    """``jascl study components``: plan, run or resume, write and print the study; ``--report``: re-render only."""
    from jascl.engine.config import resolve_config
    from jascl.experiments.compare import parse_seeds
    from jascl.experiments.study import parse_components, plan_study

    protocol, overrides = _protocol_and_overrides(args)
    out = Path(args.out) if args.out else Path("runs") / f"study-components-{protocol.name}"
    console = _console()
    if args.report:
        from jascl.experiments.compare import parse_seeds
        from jascl.results.study import write_study

        chosen = None
        if args.seeds is not None or args.num_seeds is not None:
            chosen = parse_seeds(args.seeds, protocol.seed, args.num_seeds)
        summary = write_study(out, chosen)
        _print_summary(console, summary)
        console.print(f"re-rendered {out}/study.md (and .json, variants.csv, differences.csv, seen-new-hm.png)")
        return 0
    config = resolve_config(protocol.training, protocol.path, args.config, overrides)
    count = args.num_seeds if args.num_seeds is not None or args.seeds is not None else 3
    seeds = parse_seeds(args.seeds, protocol.seed, count)
    components = parse_components(args.components)
    plan_study(protocol, config, components)  # bad input is refused before anything trains
    from jascl.cli.common import recorded_imports
    from jascl.engine.stop import REQUEST, Stopped
    from jascl.experiments.launcher import parse_launcher
    from jascl.experiments.study import run_study

    command = shlex.join(["jascl", *args.argv])
    started = time.time()
    try:
        with REQUEST.installed():  # SIGTERM / SIGUSR1 / Ctrl-C: finish the step, checkpoint, stop resumable
            summary = run_study(
                protocol,
                config,
                seeds,
                out,
                components=components,
                command=command,
                cache_dir=args.cache_dir,
                progress=not args.no_progress,
                echo=_echo(console),
                launcher=parse_launcher(args.launcher, args.launcher_opt, args.devices),
                imports=recorded_imports(args.imports),
                **_data_args(args),
            )
    except Stopped as exc:
        console.print(f"{exc}; rerun the same command to continue the study in {out}")
        return exc.exit_code
    except KeyboardInterrupt:
        console.print(f"aborted; finished sessions are saved in {out}; rerun the same command to continue")
        return 130
    _print_summary(console, summary)
    console.print(
        f"study written to {out}/study.md (and .json, variants.csv, differences.csv, seen-new-hm.png/.csv, "
        f"compute.csv) in {time.time() - started:.0f} s"
    )
    return 0
