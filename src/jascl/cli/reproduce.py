"""``jascl reproduce``: the paper's tables, its figures and its compute table, published beside measured."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from jascl.cli.common import _console, _echo


def _listing(console) -> None:
    from rich.table import Table

    from jascl.experiments.reproduce_figures import FIGURES, figure_table
    from jascl.paper.tables import paper_tables

    listing = Table(title="the paper's result tables and figures (jascl reproduce TARGET)")
    for h in ("target", "kind", "protocol", "stand-in", "rows x cols", "caption"):
        listing.add_column(h, no_wrap=h == "target")
    for t in paper_tables().values():
        caption = t.caption if len(t.caption) < 90 else t.caption[:87] + "..."
        listing.add_row(
            t.label, t.kind, t.protocol or "—", t.stand_in or "—", f"{len(t.rows)} x {len(t.columns)}", caption
        )
    for f in FIGURES.values():
        caption = f.caption if len(f.caption) < 90 else f.caption[:87] + "..."
        table, _ = figure_table(f, stand_in=False)
        stand_in, _ = figure_table(f, stand_in=True)
        protocols = ", ".join(dict.fromkeys(str(r.protocol) for r in table.rows))
        stand_ins = ", ".join(dict.fromkeys(str(r.protocol) for r in stand_in.rows))
        listing.add_row(f.name, "figure", protocols, stand_ins, f"{len(f.panels)} panels", caption)
    console.print(listing)


def _print_table(console, header: list[str], rows: list[list[str]], title: str, notes: Sequence[str] = ()) -> None:
    from rich.table import Table

    shown = Table(title=title)
    for h in header:
        shown.add_column(h)
    for r in rows:
        shown.add_row(*r)
    console.print(shown)
    for line in notes:  # the fidelity footnotes of the rows' marks
        console.print(line, markup=False, highlight=False)


def _default_out(label: str, args: argparse.Namespace) -> Path:
    suffix = ("-stand-in" if args.stand_in else "") + ("-quick" if args.quick else "")
    return Path(args.out) if args.out else Path("runs") / f"reproduce-{label.replace(':', '-')}{suffix}"


def cmd_reproduce(args: argparse.Namespace) -> int:
    """``jascl reproduce``: a paper table's (or figure's) configuration run through compare, published beside
    measured; ``--report`` re-renders a reproduction's output from its folder."""
    from jascl.experiments.compare import parse_seeds
    from jascl.paper.tables import get_table

    console = _console()
    if args.list or not args.table:
        _listing(console)
        if not args.list:
            console.print("give a target to reproduce it, e.g. jascl reproduce tab_set1_part --stand-in --dry-run")
        return 0
    from jascl.cli.common import _data_args, recorded_imports
    from jascl.experiments.reproduce_figures import FIGURES

    seeds = parse_seeds(args.seeds, 1024, args.num_seeds)
    if args.table in FIGURES:
        return _figure(args, console, seeds)
    table = get_table(args.table)
    if table.kind == "compute":
        return _compute(args, console, table)
    from jascl.experiments.reproduce import report_reproduce, run_reproduce
    from jascl.experiments.reproduce_cost import describe_estimate
    from jascl.experiments.reproduce_plan import check_roots, describe_plan, plan_table
    from jascl.results.reproduce_table import reproduce_footnotes, reproduce_table, reproduce_title

    out = _default_out(table.label, args)
    if args.report:
        summary = report_reproduce(table, out, stand_in=args.stand_in, quick=args.quick)
        _print_table(console, *reproduce_table(summary), reproduce_title(summary), reproduce_footnotes(summary))
        console.print(f"re-rendered {out}/reproduce.{{md,csv,json}} from the run folders there")
        return 0
    data = _data_args(args)
    if args.dry_run:
        plan = plan_table(table, stand_in=args.stand_in, quick=args.quick)
        check_roots(plan, data["roots"])
        shown = seeds[:1] if args.quick else seeds
        for line in describe_plan(plan, shown) + describe_estimate(plan, len(shown)):
            console.print(line, markup=False, highlight=False)
        return 0
    from jascl.engine.stop import REQUEST, Stopped
    from jascl.experiments.launcher import parse_launcher

    try:
        with REQUEST.installed():
            summary = run_reproduce(
                table,
                seeds,
                out,
                stand_in=args.stand_in,
                quick=args.quick,
                overrides=_overrides(args),
                echo=_echo(console),
                cache_dir=args.cache_dir,
                progress=not args.no_progress,
                imports=recorded_imports(args.imports),
                launcher=parse_launcher(args.launcher, args.launcher_opt, args.devices),
                **data,
            )
    except Stopped as exc:
        console.print(f"{exc}; the finished cells are in {out}/reproduce.md; rerun the same command to continue")
        return exc.exit_code
    except KeyboardInterrupt:
        console.print(f"aborted; the finished cells are in {out}/reproduce.md; rerun the same command to continue")
        return 130
    _print_table(console, *reproduce_table(summary), reproduce_title(summary), reproduce_footnotes(summary))
    console.print(f"written to {out}/reproduce.{{md,csv,json}}; the runs are in {out}/<job>/seed-*/")
    return 1 if any(c["status"] == "failed" for c in summary["cells"]) else 0


def _overrides(args: argparse.Namespace) -> list[str]:
    return [
        *([f"preset={args.preset}"] if args.preset else []),
        *(args.set or []),
        *([f"device={args.device}"] if args.device else []),
    ]


def _figure(args: argparse.Namespace, console, seeds: list[int]) -> int:
    """A figure target: its panels' jobs, the figure (PNG + SVG) and the CSV behind it."""
    from jascl.cli.common import _data_args, recorded_imports
    from jascl.engine.stop import REQUEST, Stopped
    from jascl.experiments.reproduce_figures import FIGURES, describe_figure, report_figure, run_figure

    figure = FIGURES[args.table]
    out = _default_out(figure.name, args)
    if args.dry_run:
        for line in describe_figure(figure, seeds[:1] if args.quick else seeds, args.stand_in, args.quick):
            console.print(line, markup=False, highlight=False)
        return 0
    if args.report:
        paths = report_figure(figure, out)
    else:
        try:
            with REQUEST.installed():
                paths = run_figure(
                    figure,
                    seeds,
                    out,
                    stand_in=args.stand_in,
                    quick=args.quick,
                    overrides=_overrides(args),
                    echo=_echo(console),
                    cache_dir=args.cache_dir,
                    progress=not args.no_progress,
                    imports=recorded_imports(args.imports),
                    **_data_args(args),
                )
        except Stopped as exc:
            console.print(f"{exc}; the finished panels are drawn in {out}; rerun the same command to continue")
            return exc.exit_code
    console.print(f"written: {', '.join(str(p) for p in paths.values())}")
    import json

    summary = json.loads((out / "reproduce.json").read_text()) if (out / "reproduce.json").is_file() else {}
    return 1 if any(c["status"] == "failed" for c in summary.get("cells", [])) else 0


def _compute(args: argparse.Namespace, console, table) -> int:
    """The compute table on this machine's device: parameters and MACs per backbone, time per session."""
    from jascl.cli.common import _data_args
    from jascl.engine.stop import REQUEST, Stopped
    from jascl.experiments.reproduce_compute import describe_compute, run_compute
    from jascl.results.reproduce_table import reproduce_footnotes, reproduce_table, reproduce_title

    out = _default_out(table.label, args)
    if args.dry_run:
        for line in describe_compute(table, stand_in=args.stand_in, quick=args.quick, device=args.device):
            console.print(line, markup=False, highlight=False)
        return 0
    try:
        with REQUEST.installed():
            summary = run_compute(
                table,
                out,
                stand_in=args.stand_in,
                quick=args.quick,
                device=args.device,
                report_only=args.report,
                overrides=_overrides(args),
                echo=_echo(console),
                cache_dir=args.cache_dir,
                progress=not args.no_progress,
                **_data_args(args),
            )
    except Stopped as exc:
        console.print(f"{exc}; the finished cells are in {out}/reproduce.md; rerun the same command to continue")
        return exc.exit_code
    _print_table(console, *reproduce_table(summary), reproduce_title(summary), reproduce_footnotes(summary))
    console.print(f"written to {out}/reproduce.{{md,csv,json}}")
    return 0
