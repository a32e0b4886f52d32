"""``jascl compare``, ``sweep``, ``report`` and ``bench``."""

from __future__ import annotations

import argparse
from pathlib import Path

from jascl.cli.common import _console, _echo, _protocol_and_overrides
from jascl.cli.run import _run_seeds
from jascl.errors import ConfigError


def cmd_compare(args: argparse.Namespace) -> int:
    """``jascl compare``: like ``run --seeds``, default folder runs/compare-<protocol>; ``--methods all`` allowed."""
    from jascl.engine.config import resolve_config
    from jascl.methods import METHODS

    protocol, overrides = _protocol_and_overrides(args)
    config = resolve_config(protocol.training, protocol.path, args.config, overrides)
    names = list(METHODS.list()) if args.methods == "all" else [m.strip() for m in args.methods.split(",") if m.strip()]
    if args.out is None:
        args.out = str(Path("runs") / f"compare-{protocol.name}")
    return _run_seeds(args, protocol, config, names)


def cmd_sweep(args: argparse.Namespace) -> int:
    from jascl.experiments.sweep import GRIDS

    protocol, overrides = _protocol_and_overrides(args)
    grids = [g.strip() for g in args.grid.split(",") if g.strip()] if args.grid != "all" else list(GRIDS)
    from jascl.engine.config import resolve_config

    resolve_config(protocol.training, protocol.path, args.config, overrides)  # fail fast on bad input
    from jascl.experiments.sweep import run_sweep, sweep_table

    out = Path(args.out) if args.out else Path("runs") / f"sweep-{protocol.name}-seed{protocol.seed}"
    console = _console()
    from jascl.engine.stop import REQUEST, Stopped

    try:
        with REQUEST.installed():  # SIGTERM / SIGUSR1 / Ctrl-C: finish the step, checkpoint, stop resumable
            rows = run_sweep(
                protocol,
                grids,
                out,
                method=args.method,
                config_file=args.config,
                overrides=overrides,
                cache_dir=args.cache_dir,
                progress=not args.no_progress,
                echo=_echo(console),
            )
    except Stopped as exc:
        console.print(f"{exc}; rerun the same command to resume the sweep in {out}")
        return exc.exit_code
    except KeyboardInterrupt:
        console.print(f"aborted; rerun the same command to resume the sweep in {out} from its last checkpoint")
        return 130
    from rich.table import Table

    header, body = sweep_table(rows)
    table = Table(title=f"sweep: {args.method} on {protocol.name} (seed {protocol.seed})")
    for h in header:
        table.add_column(h, no_wrap=h == "point")
    for r in body:
        table.add_row(*r)
    console.print(table)
    console.print(f"sweep table written to {out}/sweep.{{md,csv,json}}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    """``jascl report``: roots are ``--root`` > ``--roots`` > recorded in the run folder > ``JASCL_ROOT_<NAME>``."""
    if args.samples < 0:
        raise ConfigError(f"--samples {args.samples}: must be >= 0 (0 = no qualitative overlays)")
    from jascl.data.real import parse_root_args
    from jascl.results.html import check_skip, write_report
    from jascl.results.runs import RootOptions

    skip = [s.strip() for item in args.skip for s in item.split(",") if s.strip()]
    check_skip(skip)
    roots = RootOptions(parse_root_args(args.root), args.roots)
    out = Path(args.out) if args.out else Path(args.runs[0]) / "report"
    console = _console()
    paths = write_report(
        args.runs,
        out,
        samples=args.samples,
        slices=args.slices,
        device=args.device,
        cache_dir=args.cache_dir,
        echo=lambda msg: console.print(msg, markup=False),  # "[report] ..." is not rich markup
        roots=roots,
        skip=skip,
    )
    console.print(f"report written to {paths['html']} (self-contained) and {paths['markdown']} (figures next to it)")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """``jascl bench``: throughput and peak memory of plain loops vs jascl's, and the overhead ratios."""
    from jascl.experiments.bench import CASES, run_bench, tables, to_markdown

    cases = CASES if args.cases == "all" else tuple(c.strip() for c in args.cases.split(",") if c.strip())
    console = _console()
    summary = run_bench(
        args.protocol,
        session=args.session,
        epochs=args.epochs,
        rounds=args.rounds,
        device=args.device,
        overrides=list(args.set or []),
        cases=cases,
        cache_dir=args.cache_dir,
        threads=args.threads,
        echo=_echo(console) if not args.no_progress else (lambda m: None),
    )
    from rich.table import Table

    case_rows, ratio_rows = tables(summary)
    spec = summary["spec"]
    table = Table(
        title=f"jascl bench: {spec['protocol']} session {spec['session']}, {summary['device']}, "
        f"{spec['epochs'] - 1} timed epochs x {args.rounds} rounds (median)"
    )
    for h in ("case", "throughput", "range", "peak MiB", "between epochs (s)", "ops/step (not views)"):
        table.add_column(h)
    for r in case_rows:
        table.add_row(*r)
    console.print(table)
    ratios = Table(title="ratios of throughput (targets from issue 7)")
    for h in ("ratio", "value", "target", "met", "added", "what"):
        ratios.add_column(h)
    for r in ratio_rows:
        ratios.add_row(*r)
    console.print(ratios)
    if args.out:
        from jascl.fileio import atomic_write_text

        out = Path(args.out)
        atomic_write_text(out.with_suffix(".md"), to_markdown(summary))
        atomic_write_text(out.with_suffix(".json"), __import__("json").dumps(summary, indent=1, default=float))
        console.print(f"written to {out.with_suffix('.md')} and {out.with_suffix('.json')}")
    return 0


def cmd_reproduce(args: argparse.Namespace) -> int:
    """``jascl reproduce``: a paper table's configuration run through compare, published beside measured."""
    from rich.table import Table

    from jascl.experiments.compare import parse_seeds
    from jascl.paper.tables import get_table, paper_tables

    console = _console()
    if args.list or not args.table:
        listing = Table(title="the paper's result tables (jascl reproduce TABLE)")
        for h in ("table", "kind", "protocol", "stand-in", "rows x cols", "caption"):
            listing.add_column(h, no_wrap=h == "table")
        for t in paper_tables().values():
            listing.add_row(
                t.label,
                t.kind,
                t.protocol or "—",
                t.stand_in or "—",
                f"{len(t.rows)} x {len(t.columns)}",
                t.caption if len(t.caption) < 90 else t.caption[:87] + "...",
            )
        console.print(listing)
        if not args.list:
            console.print("give a table label to reproduce it, e.g. jascl reproduce tab_set1_part --stand-in --dry-run")
        return 0
    from jascl.experiments.reproduce import describe_plan, plan_table, run_reproduce
    from jascl.results.reproduce_table import reproduce_table, reproduce_title

    table = get_table(args.table)
    seeds = parse_seeds(args.seeds, 1024)
    if args.dry_run:
        for line in describe_plan(plan_table(table, stand_in=args.stand_in), seeds):
            console.print(line, markup=False, highlight=False)
        return 0
    out = (
        Path(args.out) if args.out else Path("runs") / f"reproduce-{table.label}{'-stand-in' if args.stand_in else ''}"
    )
    from jascl.cli.common import _data_args, recorded_imports
    from jascl.engine.stop import REQUEST, Stopped
    from jascl.experiments.launcher import parse_launcher

    try:
        with REQUEST.installed():
            summary = run_reproduce(
                table,
                seeds,
                out,
                stand_in=args.stand_in,
                overrides=[
                    *([f"preset={args.preset}"] if args.preset else []),
                    *(args.set or []),
                    *([f"device={args.device}"] if args.device else []),
                ],
                echo=_echo(console),
                cache_dir=args.cache_dir,
                progress=not args.no_progress,
                imports=recorded_imports(args.imports),
                launcher=parse_launcher(args.launcher, args.launcher_opt, args.devices),
                **_data_args(args),
            )
    except Stopped as exc:
        console.print(f"{exc}; rerun the same command to continue in {out}")
        return exc.exit_code
    except KeyboardInterrupt:
        console.print(f"aborted; finished sessions are saved in {out}; rerun the same command to continue")
        return 130
    header, rows = reproduce_table(summary)
    shown = Table(title=reproduce_title(summary))
    for h in header:
        shown.add_column(h)
    for r in rows:
        shown.add_row(*r)
    console.print(shown)
    from jascl.results.fidelity import footnotes

    methods = [c["method"] for c in summary["cells"] if c.get("method")]
    for line in footnotes(methods) if methods else []:
        console.print(line, highlight=False, markup=False)
    console.print(f"written to {out}/reproduce.{{md,csv,json}}; the runs are in {out}/<job>/seed-*/")
    return 0
