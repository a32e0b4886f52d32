"""``jascl compare``, ``sweep``, ``report`` and ``bench``."""

from __future__ import annotations

import argparse
from pathlib import Path

from jascl.cli.common import _console, _data_args, _echo, _protocol_and_overrides
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
    from jascl.experiments.launcher import parse_launcher
    from jascl.experiments.sweep import run_sweep, sweep_table

    launcher = parse_launcher(args.launcher, args.launcher_opt, args.devices)

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
                launcher=launcher,
                **_data_args(args),
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
    from contextlib import ExitStack

    from jascl.experiments.preflight import RunLock

    with ExitStack() as held:  # a run still writing into a folder the report goes into: one line, nothing written
        for folder in _folders_written_into(args.runs, out):
            held.enter_context(RunLock(folder, "jascl report"))
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


def _folders_written_into(runs: list[str], out: Path) -> list[Path]:
    """The run folders a report into ``out`` writes into: each of ``runs`` that holds ``out``, and the run folders
    below it (a multi-seed folder's ``seed-*/``), so that a run still training there keeps them to itself."""
    target = out.resolve()
    folders: list[Path] = []
    for run in map(Path, runs):
        if run.is_dir() and target.is_relative_to(run.resolve()):
            folders += [run, *sorted(p.parent for p in run.glob("**/run.json") if p.parent != run)]
    return folders


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
