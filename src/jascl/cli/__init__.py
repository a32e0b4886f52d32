"""The ``jascl`` command line: the parser and the entry point; each command lives in a module of this package."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from jascl import __version__
from jascl.cli.common import DEFAULT_METHODS, DEFAULT_PROTOCOL, add_root_arguments, import_modules
from jascl.cli.experiments import cmd_bench, cmd_compare, cmd_report, cmd_sweep
from jascl.cli.getting import add_weights_parser
from jascl.cli.listing import add_data_parser, add_model_info_parser, cmd_backbones, cmd_methods, cmd_protocols
from jascl.cli.reproduce import cmd_reproduce
from jascl.cli.run import cmd_run
from jascl.cli.study import add_study_parser
from jascl.cli.text_embeddings import add_text_embeddings_parser
from jascl.errors import JasclError


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block), exit code 2; subcommand parsers inherit it."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; see '{self.prog} --help'\n")


def add_launcher_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--launcher",
        default=None,
        choices=["local", "slurm"],
        help="run every shared session-0 base, then every cell (a method at a seed, or a sweep's point), as its own "
        "job through submitit: local processes or SLURM jobs (a rerun submits only what is missing)",
    )
    p.add_argument(
        "--launcher-opt",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="launcher option, repeatable: parallel, gpus (local, e.g. 0,1,2,3), time_min, requeues, partition, "
        "account, qos, constraint, gpus_per_job, cpus_per_job, mem_gb",
    )
    p.add_argument(
        "--devices",
        type=int,
        default=None,
        metavar="N",
        help="with --launcher: train every base and every cell with N processes (DistributedDataParallel; one GPU "
        "each, or gloo processes on CPU)",
    )


def add_split_manifest(p: argparse.ArgumentParser, where: str = "", repeat: bool = False) -> None:
    p.add_argument(
        "--split-manifest",
        default=[] if repeat else None,
        action="append" if repeat else "store",
        metavar="FILE",
        help=f"reuse the samples (K shots, test, unlabelled) of an earlier run's manifest.json{where}",
    )


def add_num_seeds(p: argparse.ArgumentParser, start: str = "the protocol's seed") -> None:
    p.add_argument(
        "--num-seeds",
        type=int,
        default=None,
        metavar="N",
        help=f"run N seeds counted from {start} (N, N+1, ...) instead of --seeds",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="jascl", description="Continual semantic segmentation under joint nonstationarity.")
    parser.add_argument("--version", action="version", version=f"jascl {__version__}")
    sub = parser.add_subparsers(dest="command")

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--protocol", default=DEFAULT_PROTOCOL, help=f"built-in name or YAML path (default {DEFAULT_PROTOCOL})"
        )
        p.add_argument("--seed", type=int, default=None, help="override the protocol's seed (data and training)")
        p.add_argument("--config", default=None, help="YAML file of run-configuration keys")
        p.add_argument(
            "--set", action="append", metavar="KEY=VALUE", help="override a configuration key, e.g. --set epochs_base=5"
        )
        p.add_argument(
            "--preset",
            default=None,
            metavar="NAME",
            help="a named set of configuration values, e.g. 'authors' (the authors' training path; "
            "docs/method.md); --config and --set still override any of its keys",
        )
        p.add_argument(
            "--ablate",
            default=None,
            metavar="PARTS",
            help="switch JASCL components off: any of gas,pas,proto (comma-separated)",
        )
        p.add_argument("--backbone", default=None, help="backbone name (see 'jascl backbones')")
        p.add_argument(
            "--weights",
            default=None,
            metavar="PATH",
            help="local pretrained backbone weights (.safetensors, or .pth loaded with weights_only=True)",
        )
        p.add_argument("--device", default=None, help="auto, cpu, cuda, cuda:1, ...")
        p.add_argument("--eval-mode", dest="eval_mode", default=None, choices=["sliding-window", "authors"])
        p.add_argument(
            "--cache-dir", default=None, help="where generated data is cached (default $JASCL_CACHE or ~/.cache/jascl)"
        )
        p.add_argument("--no-progress", action="store_true", help="hide progress bars")
        add_import(p)

    def add_import(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--import",
            dest="imports",
            action="append",
            default=[],
            metavar="MODULE",
            help="import a module (dotted name or .py file) that registers your own methods or backbones; repeatable",
        )

    run = sub.add_parser("run", help="run a protocol for one or more methods and print the comparison table")
    common(run)
    run.set_defaults(protocol=None)  # so that --resume can tell an explicit --protocol from the default
    run.add_argument("--methods", default=None, help=f"comma-separated methods (default {DEFAULT_METHODS})")
    run.add_argument(
        "--out", default=None, help="run folder (default runs/<protocol>-seed<seed>-<time>); reused to resume"
    )
    run.add_argument(
        "--resume",
        default=None,
        metavar="RUN_DIR",
        help="continue an interrupted run from its last checkpoint, with the folder's own protocol, "
        "methods and configuration",
    )
    run.add_argument(
        "--devices",
        type=int,
        default=None,
        metavar="N",
        help="train with N processes on this machine (torchrun + DistributedDataParallel; one per GPU, "
        "or gloo processes on CPU); batch_size stays the global batch",
    )
    run.add_argument(
        "--seeds",
        default=None,
        help="run these seeds in sequence (e.g. 1024,7) into OUT/seed-<s>/ and aggregate mean ± std; resumable",
    )
    add_num_seeds(run)
    add_root_arguments(run)
    add_split_manifest(run)
    run.set_defaults(func=cmd_run)

    compare = sub.add_parser(
        "compare",
        help="run several methods over several seeds on the same splits and write the paper-style table (mean ± std)",
    )
    common(compare)
    compare.add_argument(
        "--methods",
        default=DEFAULT_METHODS,
        help=f"comma-separated methods, or 'all' (default {DEFAULT_METHODS}; see 'jascl methods')",
    )
    add_root_arguments(compare)
    add_split_manifest(compare, " for every seed (a fixed split: only the training seed varies)")
    compare.add_argument(
        "--seeds", default=None, help="the seeds, e.g. 1024,7 (default: the protocol's seed; a count: --num-seeds)"
    )
    add_num_seeds(compare)
    compare.add_argument(
        "--out", default=None, help="compare folder (default runs/compare-<protocol>); reused to resume"
    )
    add_launcher_arguments(compare)
    compare.set_defaults(func=cmd_compare)

    reproduce = sub.add_parser(
        "reproduce",
        help="run one of the paper's result tables or figures and print the published value beside the measured one",
    )
    reproduce.add_argument(
        "table", nargs="?", help="a table's label or a figure (see --list), e.g. tab_set1_part, fig_constraints"
    )
    reproduce.add_argument("--list", action="store_true", help="list the paper's tables and figures")
    reproduce.add_argument(
        "--dry-run", action="store_true", help="print the plan (jobs, shared bases, GPU-hour estimate) and stop"
    )
    reproduce.add_argument(
        "--quick",
        action="store_true",
        help="quick mode: a quarter of every session's epochs, the first seed only; labelled QUICK in the output",
    )
    reproduce.add_argument(
        "--report", action="store_true", help="re-render the output from the run folders in --out (no training)"
    )
    reproduce.add_argument(
        "--stand-in",
        action="store_true",
        help="run the table's methods on its embedded stand-in benchmark (synthetic-2d or synthetic-2d-ss)",
    )
    reproduce.add_argument("--seeds", default=None, help="the seeds, e.g. 1024,7 (default 1024; a count: --num-seeds)")
    add_num_seeds(reproduce, "1024")
    reproduce.add_argument("--out", default=None, help="folder (default runs/reproduce-<table>); reused to resume")
    reproduce.add_argument(
        "--preset", default=None, metavar="NAME", help="a named configuration preset in every job, e.g. authors"
    )
    reproduce.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="override a configuration key in every job"
    )
    reproduce.add_argument("--device", default=None, help="auto, cpu, cuda, cuda:1, ...")
    reproduce.add_argument("--cache-dir", default=None, help="synthetic data cache")
    reproduce.add_argument("--no-progress", action="store_true", help="hide progress bars")
    add_root_arguments(reproduce)
    add_launcher_arguments(reproduce)
    add_import(reproduce)
    add_split_manifest(
        reproduce,
        " in the jobs on its protocol (repeat for several protocols; other jobs select their own)",
        repeat=True,
    )
    reproduce.set_defaults(func=cmd_reproduce)

    sweep = sub.add_parser("sweep", help="run a grid of configurations (sensitivity / retention / layer-choice tables)")
    common(sweep)
    sweep.add_argument(
        "--grid",
        default="tau",
        help="comma-separated grids: eps, sigma2, shots, tau, gas-layer, or 'all' (default tau)",
    )
    sweep.add_argument("--method", default="jascl", help="method to sweep (default jascl)")
    add_root_arguments(sweep)
    add_split_manifest(sweep, " at every point (a 'shots' point selects its own)")
    sweep.add_argument(
        "--out", default=None, help="sweep folder (default runs/sweep-<protocol>-seed<seed>); reused to resume"
    )
    add_launcher_arguments(sweep)
    sweep.set_defaults(func=cmd_sweep)

    add_study_parser(sub, common, add_launcher_arguments)

    report = sub.add_parser(
        "report",
        help="HTML + Markdown report of run folders or multi-seed folders: tables, "
        "curves, per-class heat maps, overlays, pseudo-labels, config, versions",
    )
    report.add_argument(
        "runs",
        nargs="+",
        metavar="RUN_DIR",
        help="run folder(s) (jascl run --out), multi-seed folder(s) (jascl compare --out) or jascl reproduce folders",
    )
    report.add_argument("--out", default=None, help="output folder (default RUN_DIR/report)")
    report.add_argument(
        "--samples", type=int, default=2, help="test samples per session in the overlays (default 2; 0 = none)"
    )
    report.add_argument(
        "--slices",
        type=int,
        default=1,
        metavar="N",
        help="slices per test volume in the overlays: the one with the most foreground, then N - 1 spread over it",
    )
    report.add_argument("--device", default="cpu", help="where saved models run for the overlays (default cpu)")
    report.add_argument(
        "--cache-dir",
        default=None,
        help="data cache (default: the run's, recorded in run.json, if it exists; else $JASCL_CACHE or ~/.cache/jascl)",
    )
    add_root_arguments(report, recorded=True)
    report.add_argument(
        "--skip",
        action="append",
        default=[],
        metavar="SECTION[,SECTION]",
        help="leave report sections out (comma-separated, repeatable), e.g. qualitative or manifest (an unknown "
        "id lists them all); a section that cannot be produced is otherwise an error: exit 2, nothing written",
    )
    report.set_defaults(func=cmd_report)

    bench = sub.add_parser(
        "bench",
        help="training steps/s and peak memory of a plain PyTorch/MONAI loop vs jascl "
        "(vanilla, GAS + replay, PAS) and of sliding-window evaluation, with ratios",
    )
    bench.add_argument(
        "--protocol",
        default="bench-2d",
        help="workload (default bench-2d; bench-3d for volumes; bench-natural and "
        "bench-med: the paper's models and sizes, for a GPU)",
    )
    bench.add_argument("--session", type=int, default=1, help="incremental session to time (default 1)")
    bench.add_argument("--epochs", type=int, default=4, help="epochs per case; the first warms up (default 4)")
    bench.add_argument("--rounds", type=int, default=3, help="repetitions of every case, interleaved (default 3)")
    bench.add_argument(
        "--cases",
        default="all",
        help="comma-separated: plain, vanilla, gas+replay, plain-mt, pas, eval-plain, eval (default all)",
    )
    bench.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    bench.add_argument("--threads", type=int, default=0, help="torch CPU threads per case (0 = torch's default)")
    bench.add_argument("--set", action="append", metavar="KEY=VALUE", help="configuration key, e.g. precision=fp32")
    bench.add_argument("--cache-dir", default=None, help="synthetic data cache")
    bench.add_argument("--out", default=None, help="also write OUT.md and OUT.json")
    bench.add_argument("--no-progress", action="store_true")
    bench.set_defaults(func=cmd_bench)

    protocols = sub.add_parser("protocols", help="list built-in protocols, or show one protocol's sessions")
    protocols.add_argument("name", nargs="?", help="protocol name or YAML path")
    protocols.set_defaults(func=cmd_protocols)
    methods = sub.add_parser("methods", help="list registered methods, or show one method's paper, notes and options")
    methods.add_argument("name", nargs="?", help="a registered method")
    methods.add_argument(
        "--paper",
        action="store_true",
        help="every method of the paper's result tables: its rows there, jascl name, family, source paper, status",
    )
    methods.add_argument(
        "--task",
        choices=("segmentation", "detection"),
        help="list the methods implemented for this task (a detection protocol runs only those)",
    )
    add_import(methods)
    methods.set_defaults(func=cmd_methods)
    sub.add_parser("backbones", help="list registered backbones").set_defaults(func=cmd_backbones)
    add_model_info_parser(sub)
    add_data_parser(sub)
    add_text_embeddings_parser(sub)
    add_weights_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a one-line usage error (exit code 2)
        return int(exc.code or 0)
    args.argv = argv
    if args.command is None:
        parser.print_help()
        return 0
    several = getattr(args, "seeds", None) is not None or getattr(args, "num_seeds", None) is not None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and (args.command != "run" or several):
        print(
            f"jascl: error: '{args.command}{' --seeds' if args.command == 'run' else ''}' runs in one process; "
            "only 'jascl run' (one seed) trains with several processes",
            file=sys.stderr,
        )
        return 2
    try:
        import_modules(getattr(args, "imports", []))
        return int(args.func(args) or 0)
    except JasclError as exc:
        print(f"jascl: error: {exc}", file=sys.stderr)
        return exc.exit_code
