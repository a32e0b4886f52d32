"""``jascl run``: one protocol for several methods, one or several seeds, several processes, resume."""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path

from jascl import __version__
from jascl.cli.common import (
    DEFAULT_METHODS,
    DEFAULT_PROTOCOL,
    _console,
    _data_args,
    _echo,
    _protocol_and_overrides,
    import_modules,
    recorded_imports,
)
from jascl.errors import ConfigError


def check_method_names(names: Sequence[str]) -> None:
    """Refuse an unknown method name (with "did you mean") from the registry index, before any method's module is
    imported: ``--methods vanilla,jascI`` stops at once, without importing torch for vanilla first."""
    from jascl.methods import METHODS

    for name in names:
        METHODS.summary(name)


def thread_count(config) -> str:
    """``"threads N"`` for the run header: ``threads`` when set, else what torch will take (all cores unless
    OMP_NUM_THREADS says otherwise; on a shared machine that can be slower than one: docs/performance.md)."""
    import torch

    if config.threads > 0:
        return f"threads {config.threads}"
    return f"threads {torch.get_num_threads()} (torch's default; --set threads=N)"


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
    "preset",
    "ablate",
    "backbone",
    "weights",
    "eval_mode",
    "methods",
    "out",
    "seeds",
    "num_seeds",
    "root",
    "roots",
    "split_manifest",
)


def _resume_setup(args: argparse.Namespace):
    """Protocol, configuration, methods and data options of the run folder ``args.resume``."""
    from jascl.engine.config import resolve_config
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
    # the modules that registered the run's own methods or backbones, imported again (those given anew already are)
    given_imports = recorded_imports(args.imports)
    imports = [*given_imports, *(m for m in record.get("imports") or [] if m not in given_imports)]
    import_modules([m for m in imports if m not in given_imports])
    data_args["imports"] = imports
    return protocol, config, list(record["methods"]), out, data_args


def cmd_run(args: argparse.Namespace) -> int:
    if args.devices is not None:
        from jascl import distributed  # (torch: only where --devices asks for it, input errors come first)

        if args.devices < 1:
            from jascl.errors import ConfigError

            raise ConfigError(f"--devices {args.devices}: must be >= 1")
        if args.devices > 1 and not distributed.launched():
            from jascl.errors import ConfigError

            if args.seeds is not None or args.num_seeds is not None:
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
        check_method_names(methods)
        several = args.seeds is not None or args.num_seeds is not None
        if not several:
            from jascl.methods.registry import create_method

            for name in methods:  # an unknown name or a composition's overlap (a+b) is refused before any work
                create_method(name, config, protocol.task)
        data_args = {**_data_args(args), "imports": recorded_imports(args.imports)}
        if several:
            return _run_seeds(args, protocol, config, methods)
        out = (
            Path(args.out)
            if args.out
            else Path("runs") / f"{protocol.name}-seed{protocol.seed}-{time.strftime('%Y%m%d-%H%M%S')}"
        )
    from jascl.experiments.preflight import check_device, check_writable, preflight

    check_writable(out, "--resume" if args.resume is not None else "--out")  # before any work: one line each
    check_device(config.device)
    preflight(out, protocol, config)  # and the backbone against the patch size
    # Heavy imports (torch, MONAI) only after the protocol and configuration are valid,
    # so that input errors are reported at once.
    from jascl import distributed
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
            f"methods {', '.join(methods)}, backbone {config.backbone}{ranks}, {thread_count(config)}, output {out}"
        )
    from jascl.engine.stop import REQUEST, Stopped

    started = time.time()
    try:
        with REQUEST.installed():  # SIGTERM / SIGUSR1 / Ctrl-C: finish the step, checkpoint, exit resumable
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
                f"aborted; finished sessions and the last checkpoint are saved in {out}; "
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
    """``jascl run --seeds S,T`` / ``--num-seeds N``: one run folder per seed under ``--out``, aggregated as mean ± std."""
    check_method_names(methods)  # before the experiments' imports (torch)
    from rich.table import Table

    from jascl.experiments.compare import compare_table, compare_title, parse_seeds, run_compare
    from jascl.experiments.launcher import parse_launcher
    from jascl.methods.registry import create_method

    seeds = parse_seeds(args.seeds, protocol.seed, getattr(args, "num_seeds", None))
    for name in methods:
        create_method(
            name, config, protocol.task
        )  # an unknown name or a composition's overlap (a+b) is refused before any work
    out = Path(args.out) if args.out else Path("runs") / f"{protocol.name}-seeds{'-'.join(map(str, seeds))}"
    console = _console()
    console.print(
        f"jascl {__version__}: protocol [bold]{protocol.name}[/], seeds {', '.join(map(str, seeds))}, "
        f"methods {', '.join(methods)}, backbone {config.backbone}, {thread_count(config)}, output {out}"
    )
    started = time.time()
    from jascl.engine.stop import REQUEST, Stopped

    try:
        with REQUEST.installed():  # SIGTERM / SIGUSR1 / Ctrl-C: finish the step, checkpoint, stop resumable
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
                imports=recorded_imports(args.imports),
                launcher=parse_launcher(
                    getattr(args, "launcher", None),
                    getattr(args, "launcher_opt", []),
                    args.devices if hasattr(args, "launcher") else None,  # jascl run's own --devices is torchrun's
                ),
            )
    except Stopped as exc:
        console.print(f"{exc}; rerun the same command to continue in {out}")
        return exc.exit_code
    except KeyboardInterrupt:
        console.print(
            f"aborted; finished sessions and the last checkpoint are saved in {out}; rerun the same command to continue"
        )
        return 130
    header, rows = compare_table(summary)
    table = Table(title=compare_title(summary))
    for h in header:
        table.add_column(h)
    for r in rows:
        table.add_row(*r)
    console.print(table)
    from jascl.results.fidelity import footnotes

    for line in footnotes(summary["methods"]):
        console.print(line, highlight=False, markup=False)
    console.print(
        f"per-seed runs in {out}/seed-*/; mean ± std written to {out}/compare.{{md,csv,json}} "
        f"in {time.time() - started:.0f} s"
    )
    return 0
