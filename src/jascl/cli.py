"""The ``jascl`` command line."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from jascl import __version__
from jascl.errors import ConfigError, JasclError

DEFAULT_PROTOCOL = "synthetic-2d"
DEFAULT_METHODS = "vanilla,jascl"


def _console():
    from rich.console import Console

    return Console()


def _echo(console):
    """Progress messages printed verbatim ("[vanilla] session 1 ..." is not rich markup)."""
    return lambda message: console.print(message, markup=False, highlight=False)


ABLATIONS = {
    "gas": "method_args.jascl.components.gas=false",
    "pas": "method_args.jascl.components.pas=false",
    "proto": "method_args.jascl.components.replay=false",
}


def _protocol_and_overrides(args: argparse.Namespace):
    """The protocol (seed applied) and the --set overrides implied by the shared run options."""
    from jascl.errors import ConfigError
    from jascl.protocols import get_protocol

    protocol = get_protocol(args.protocol)
    if args.seed is not None:
        protocol = dataclasses.replace(protocol, seed=args.seed)
    overrides = list(args.set or [])
    for flag, key in (
        ("backbone", "backbone"),
        ("device", "device"),
        ("eval_mode", "eval_mode"),
        ("weights", "weights"),
    ):
        value = getattr(args, flag)
        if value is not None:
            overrides.append(f"{key}={value}")
    if (
        args.backbone is not None
        and args.backbone != protocol.training.get("backbone")
        and not any(o.startswith("backbone_args=") for o in overrides)
    ):
        overrides.append("backbone_args={}")  # the protocol's backbone_args belong to its own backbone
    for part in filter(None, (args.ablate or "").split(",")):
        if part.strip() not in ABLATIONS:
            raise ConfigError(f"--ablate {part.strip()}: choose any of {', '.join(ABLATIONS)} (comma-separated)")
        overrides.append(ABLATIONS[part.strip()])
    return protocol, overrides


def _data_args(args: argparse.Namespace) -> dict:
    """Dataset roots and a reused split manifest (``--root``, ``--roots``, ``--split-manifest``) as run keywords."""
    from jascl.data.real import parse_root_args

    return {
        "roots": parse_root_args(getattr(args, "root", None)),
        "roots_file": getattr(args, "roots", None),
        "split_manifest": getattr(args, "split_manifest", None),
    }


def _without_devices(argv: Sequence[str]) -> list[str]:
    """``argv`` minus ``--devices N`` / ``--devices=N`` (what each torchrun process runs)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--devices":
            skip = True
        elif not a.startswith("--devices="):
            out.append(a)
    return out


#: options of ``jascl run`` that --resume takes from the run folder instead
_RESUME_CONFLICTS = (
    "protocol",
    "seed",
    "config",
    "ablate",
    "backbone",
    "weights",
    "eval_mode",
    "methods",
    "out",
    "seeds",
    "root",
    "roots",
    "split_manifest",
)


def _resume_setup(args: argparse.Namespace):
    """Protocol, configuration, methods and data options of the run folder ``args.resume``."""
    from jascl.engine.config import resolve_config
    from jascl.errors import ConfigError
    from jascl.experiments.runner import read_run_file
    from jascl.protocols import get_protocol

    given = [f"--{k.replace('_', '-')}" for k in _RESUME_CONFLICTS if getattr(args, k, None) is not None]
    if given:
        raise ConfigError(
            f"--resume {args.resume}: the run folder fixes the protocol, methods and settings; "
            f"drop {', '.join(given)} (only --device, --devices, --set of device/threads/"
            "num_workers/pin_memory/checkpoint_every/checkpoint_steps, --cache-dir and --no-progress apply)"
        )
    out = Path(args.resume)
    record = read_run_file(out)
    source = out / record["protocol_file"] if record.get("protocol_file") else record["protocol"]
    # the folder's copy of the protocol file, under the name it ran with (a YAML without 'name:' takes its file's)
    protocol = dataclasses.replace(get_protocol(str(source)), seed=int(record["seed"]), name=record["protocol"])
    overrides = list(args.set or []) + ([f"device={args.device}"] if args.device else [])
    config = resolve_config(protocol.training, protocol.path, out / "config.yaml", overrides)
    manifest = out / "manifest.json"
    data_args = {
        "roots": record.get("roots") or None,
        "roots_file": record.get("roots_file"),
        "split_manifest": str(manifest) if manifest.is_file() else record.get("split_manifest"),
    }
    args.cache_dir = args.cache_dir or record.get("cache_dir")
    return protocol, config, list(record["methods"]), out, data_args


def cmd_run(args: argparse.Namespace) -> int:
    from jascl import distributed

    if args.devices is not None:
        if args.devices < 1:
            from jascl.errors import ConfigError

            raise ConfigError(f"--devices {args.devices}: must be >= 1")
        if args.devices > 1 and not distributed.launched():
            from jascl.errors import ConfigError

            if args.seeds is not None:
                raise ConfigError("--devices with --seeds: run the seeds one by one (--seed S --devices N)")
            import torch

            device = args.device or "auto"
            if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()):
                if ":" in device:
                    raise ConfigError(
                        f"--device {device} with --devices {args.devices}: each process takes its own "
                        "GPU; use --device cuda"
                    )
                if args.devices > torch.cuda.device_count():
                    raise ConfigError(
                        f"--devices {args.devices}: this machine has {torch.cuda.device_count()} GPU(s); "
                        "use at most that many, or --device cpu for CPU processes"
                    )
            return distributed.launch(_without_devices(args.argv), args.devices)
    if args.resume is not None:
        protocol, config, methods, out, data_args = _resume_setup(args)
    else:
        from jascl.engine.config import resolve_config

        args.protocol = args.protocol or DEFAULT_PROTOCOL
        protocol, overrides = _protocol_and_overrides(args)
        config = resolve_config(protocol.training, protocol.path, args.config, overrides)
        methods = [m.strip() for m in (args.methods or DEFAULT_METHODS).split(",") if m.strip()]
        data_args = _data_args(args)
        if args.seeds is not None:
            return _run_seeds(args, protocol, config, methods)
        out = (
            Path(args.out)
            if args.out
            else Path("runs") / f"{protocol.name}-seed{protocol.seed}-{time.strftime('%Y%m%d-%H%M%S')}"
        )
    # Heavy imports (torch, MONAI) only after the protocol and configuration are valid,
    # so that input errors are reported at once.
    from jascl.experiments.runner import run_benchmark
    from jascl.results.report import print_tables

    config.device = distributed.init(config.device)
    if distributed.launched():
        out = Path(distributed.broadcast_object(str(out)))  # one folder, even if the ranks' clocks differ
    main = distributed.is_main()
    console = _console()
    echo = _echo(console) if main else (lambda message: None)
    if main:
        ranks = f", {distributed.world_size()} processes" if distributed.active() else ""
        console.print(
            f"jascl {__version__}: protocol [bold]{protocol.name}[/] (seed {protocol.seed}), "
            f"methods {', '.join(methods)}, backbone {config.backbone}{ranks}, output {out}"
        )
    from jascl.engine.stop import REQUEST, Stopped

    started = time.time()
    try:
        with REQUEST.installed():  # SIGTERM / SIGUSR1: finish the step, checkpoint, exit resumable
            results = run_benchmark(
                protocol,
                config,
                methods,
                out,
                cache_dir=args.cache_dir,
                progress=not args.no_progress and main,
                echo=echo,
                **data_args,
            )
    except Stopped as exc:
        if main:
            console.print(f"{exc}; continue with: jascl run --resume {out}")
        return exc.exit_code
    except KeyboardInterrupt:
        if main:
            console.print(
                f"interrupted; finished sessions and the last epoch checkpoint are saved in {out}; "
                f"continue with: jascl run --resume {out}"
            )
        return 130
    finally:
        distributed.shutdown()
    if main:
        print_tables(results, console)
        console.print(f"results written to {out}/results.{{json,csv,md}} in {time.time() - started:.0f} s")
    return 0


def _run_seeds(args: argparse.Namespace, protocol, config, methods: list[str]) -> int:
    """``jascl run --seeds N``: one run folder per seed under ``--out``, aggregated as mean ± std."""
    from rich.table import Table

    from jascl.experiments.compare import compare_table, compare_title, parse_seeds, run_compare
    from jascl.methods import METHODS

    seeds = parse_seeds(args.seeds, protocol.seed)
    for name in methods:
        METHODS.get(name)
    out = Path(args.out) if args.out else Path("runs") / f"{protocol.name}-seeds{'-'.join(map(str, seeds))}"
    console = _console()
    console.print(
        f"jascl {__version__}: protocol [bold]{protocol.name}[/], seeds {', '.join(map(str, seeds))}, "
        f"methods {', '.join(methods)}, backbone {config.backbone}, output {out}"
    )
    started = time.time()
    try:
        summary = run_compare(
            protocol,
            config,
            methods,
            seeds,
            out,
            cache_dir=args.cache_dir,
            progress=not args.no_progress,
            echo=_echo(console),
            **_data_args(args),
        )
    except KeyboardInterrupt:
        console.print(f"interrupted; finished sessions are saved in {out} and are reused if you rerun the same command")
        return 130
    header, rows = compare_table(summary)
    table = Table(title=compare_title(summary))
    for h in header:
        table.add_column(h)
    for r in rows:
        table.add_row(*r)
    console.print(table)
    console.print(
        f"per-seed runs in {out}/seed-*/; mean ± std written to {out}/compare.{{md,csv,json}} "
        f"in {time.time() - started:.0f} s"
    )
    return 0


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
    try:
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
    except KeyboardInterrupt:
        console.print(f"interrupted; rerun the same command to resume the sweep in {out}")
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
    from jascl.errors import ConfigError

    if args.samples < 0:
        raise ConfigError(f"--samples {args.samples}: must be >= 0 (0 = no qualitative overlays)")
    from jascl.results.html import write_report

    out = Path(args.out) if args.out else Path(args.runs[0]) / "report"
    console = _console()
    paths = write_report(
        args.runs,
        out,
        samples=args.samples,
        device=args.device,
        cache_dir=args.cache_dir,
        echo=lambda msg: console.print(msg, markup=False),
    )  # "[report] ..." is not rich markup
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


def cmd_protocols(args: argparse.Namespace) -> int:
    from rich.table import Table

    from jascl.protocols import builtin_protocols, get_protocol

    console = _console()
    if args.name:
        p = get_protocol(args.name)
        table = Table(title=f"{p.name}: {p.description}".strip(": "))
        for col in ("session", "domains", "new classes", "recurring", "shots K", "labelled", "unlabelled", "test"):
            table.add_column(col)
        for s in p.sessions:
            names = lambda ids: ", ".join(f"{c}:{p.class_name(c)}" for c in ids) or "-"  # noqa: E731
            table.add_row(
                f"{s.index} {s.name}",
                ", ".join(s.domains),
                names(s.new_classes),
                names(s.recurring_classes),
                "all" if s.shots is None else str(s.shots),
                "all"
                if s.shots is None and s.train is None
                else (f"<= {s.num_labelled}" if s.sources else str(s.num_labelled)),
                str(s.unlabelled) + (f" + {s.unlabelled_per_class}/class" if s.unlabelled_per_class else ""),
                "all" if s.test is None else str(s.test),
            )
        console.print(table)
        console.print(f"spatial_dims={p.spatial_dims} metric={p.metric} seed={p.seed} file={p.path}")
        for d in p.datasets.values():
            console.print(
                f"dataset {d.name}: layout {d.layout}, domain {d.domain}, root name {d.root} (--root {d.root}=PATH)"
            )
        return 0
    table = Table(title="built-in protocols")
    for col in ("name", "dims", "sessions", "classes", "description"):
        table.add_column(col)
    for name, path in builtin_protocols().items():
        p = get_protocol(path)
        table.add_row(name, f"{p.spatial_dims}D", str(len(p.sessions)), str(len(p.classes) - 1), p.description)
    console.print(table)
    return 0


def _list_registry(registry, title: str) -> int:
    from rich.table import Table

    table = Table(title=title)
    table.add_column("name")
    table.add_column("description")
    for name in registry.list():
        table.add_row(name, registry.describe(name))
    _console().print(table)
    return 0


def cmd_methods(args: argparse.Namespace) -> int:
    """``jascl methods``: the registry; ``jascl methods NAME``: one method's paper, notes and options."""
    from rich.table import Table

    from jascl.methods import METHODS
    from jascl.methods.registry import describe_method

    if not args.name:
        return _list_registry(METHODS, "methods")
    info = describe_method(args.name)
    console = _console()
    console.print(f"[bold]{info['name']}[/bold]: {info['doc']}", highlight=False)
    if info["paper"]:
        console.print(f"paper: {info['paper']}", highlight=False)
    if info["notes"]:
        console.print(f"\n{info['notes']}\n", highlight=False)
    if not info["options"]:
        console.print("options: none")
        return 0
    table = Table(title=f"options: --set method_args.{info['options_key']}.<option>=VALUE")
    for col in ("option", "type", "default", "allowed", "description"):
        table.add_column(col)
    for row in info["options"]:
        table.add_row(row["name"], row["type"], row["default"], row["allowed"], row["doc"])
    console.print(table)
    return 0


def import_modules(names: Sequence[str]) -> None:
    """Import the user's modules (dotted names, or paths of ``.py`` files) so that what they register
    (methods, backbones, layouts) can be named on the command line.

    Raises:
        ConfigError: a module that cannot be found or fails to import, in one line.
    """
    import importlib
    import importlib.util

    for name in names:
        try:
            if name.endswith(".py"):
                path = Path(name)
                if not path.is_file():
                    raise ConfigError(f"--import {name}: no such file")
                spec = importlib.util.spec_from_file_location(path.stem, path)
                if spec is None or spec.loader is None:
                    raise ConfigError(f"--import {name}: not a Python module")
                module = importlib.util.module_from_spec(spec)
                sys.modules[path.stem] = module
                spec.loader.exec_module(module)
            else:
                importlib.import_module(name)
        except ConfigError:
            raise
        except Exception as exc:  # the user's code: say which module and what went wrong, in one line
            raise ConfigError(f"--import {name}: {type(exc).__name__}: {exc}") from None


def cmd_backbones(args: argparse.Namespace) -> int:
    from jascl.networks import BACKBONES

    return _list_registry(BACKBONES, "backbones")


def cmd_model_info(args: argparse.Namespace) -> int:
    from jascl.experiments.model_info import cmd_model_info as run

    return run(args)


def cmd_data_check(args: argparse.Namespace) -> int:
    """``jascl data check``: one line per problem and exit 2, or a per-session summary and exit 0."""
    from jascl.data.real import parse_root_args
    from jascl.protocols import get_protocol

    protocol = get_protocol(args.protocol)
    if args.seed is not None:
        protocol = dataclasses.replace(protocol, seed=args.seed)
    roots = parse_root_args(args.root)
    from jascl.data.check import check_protocol

    print(f"jascl data check: protocol {protocol.name} (seed {protocol.seed}, file {protocol.path})")
    report = check_protocol(protocol, roots, args.roots, args.cache_dir, echo=print)
    for line in report.lines():
        print(line)
    return 0 if report.ok else 2


def add_data_parser(subparsers) -> argparse.ArgumentParser:
    """``jascl data check --protocol NAME --root NAME=PATH ...``."""
    data = subparsers.add_parser("data", help="check local copies of the public datasets against a protocol")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    check = data_sub.add_parser(
        "check",
        help="open every file, check shapes / affines / label values, K-shot "
        "availability and unlabelled pools; exit 2 on any problem",
    )
    check.add_argument("--protocol", required=True, help="built-in protocol name or YAML path")
    add_root_arguments(check)
    check.add_argument("--seed", type=int, default=None, help="seed of the K-shot selection (default: the protocol's)")
    check.add_argument("--cache-dir", default=None, help="label-index cache (default $JASCL_CACHE or ~/.cache/jascl)")
    check.set_defaults(func=cmd_data_check)
    return data


def add_root_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--root",
        action="append",
        metavar="NAME=PATH",
        help="folder of a dataset root the protocol names (repeat per dataset); "
        "else a --roots file or the environment variable JASCL_ROOT_<NAME>",
    )
    p.add_argument("--roots", default=None, metavar="FILE", help="YAML file of root names to folders (NAME: PATH)")


def add_model_info_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``model-info`` (kept here, free of torch imports, so the CLI starts fast)."""
    p = subparsers.add_parser(
        "model-info", help="parameters, FLOPs and training-step memory of backbones, with and without JASCL"
    )
    p.add_argument("backbone", help="registered backbone name, or 'all'")
    p.add_argument("--spatial-dims", type=int, default=None, help="2 or 3 (default: the backbone's paper-like setting)")
    p.add_argument(
        "--spatial-size", default=None, help="input size, e.g. 128x120x120 or 512 (repeated); default per backbone"
    )
    p.add_argument("--in-channels", type=int, default=None)
    p.add_argument("--num-classes", type=int, default=None, help="classifier rows incl. background")
    p.add_argument("--batch-size", type=int, default=2, help="images per training step for the memory figure")
    p.add_argument("--backbone-args", default=None, help='YAML/JSON mapping, e.g. "{encoder_name: resnet18}"')
    p.add_argument(
        "--device",
        default=None,
        choices=["cuda", "meta"],
        help="cuda: measured memory; meta: estimate (default: cuda if available)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_model_info)
    return p


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block), exit code 2; subcommand parsers inherit it."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; see '{self.prog} --help'\n")


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
        help="run several seeds in sequence (a count, or a list such as 1024,7) and aggregate mean ± std; resumable",
    )
    add_root_arguments(run)
    run.add_argument(
        "--split-manifest",
        default=None,
        metavar="FILE",
        help="reuse the samples (K shots, test, unlabelled) of an earlier run's manifest.json",
    )
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
    compare.add_argument(
        "--seeds", default="1", help="a count (seeds from the protocol's) or a list, e.g. 1024,7 (default 1)"
    )
    compare.add_argument(
        "--out", default=None, help="compare folder (default runs/compare-<protocol>); reused to resume"
    )
    compare.set_defaults(func=cmd_compare)

    sweep = sub.add_parser("sweep", help="run a grid of configurations (sensitivity / retention / layer-choice tables)")
    common(sweep)
    sweep.add_argument(
        "--grid",
        default="tau",
        help="comma-separated grids: eps, sigma2, shots, tau, gas-layer, or 'all' (default tau)",
    )
    sweep.add_argument("--method", default="jascl", help="method to sweep (default jascl)")
    sweep.add_argument(
        "--out", default=None, help="sweep folder (default runs/sweep-<protocol>-seed<seed>); reused to resume"
    )
    sweep.set_defaults(func=cmd_sweep)

    report = sub.add_parser(
        "report",
        help="HTML + Markdown report of run folders or multi-seed folders: tables, "
        "curves, per-class heat maps, overlays, pseudo-labels, config, versions",
    )
    report.add_argument(
        "runs",
        nargs="+",
        metavar="RUN_DIR",
        help="run folder(s) (jascl run --out) or multi-seed folder(s) (jascl compare --out)",
    )
    report.add_argument("--out", default=None, help="output folder (default RUN_DIR/report)")
    report.add_argument(
        "--samples", type=int, default=2, help="test samples per session in the overlays (default 2; 0 = none)"
    )
    report.add_argument("--device", default="cpu", help="where saved models run for the overlays (default cpu)")
    report.add_argument(
        "--cache-dir", default=None, help="synthetic data cache (default $JASCL_CACHE or ~/.cache/jascl)"
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
    add_import(methods)
    methods.set_defaults(func=cmd_methods)
    sub.add_parser("backbones", help="list registered backbones").set_defaults(func=cmd_backbones)
    add_model_info_parser(sub)
    add_data_parser(sub)
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
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and (args.command != "run" or getattr(args, "seeds", None)):
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


if __name__ == "__main__":
    raise SystemExit(main())
