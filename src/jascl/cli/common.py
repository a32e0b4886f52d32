"""What the commands share: the console, the protocol and configuration overrides of the common options, the
dataset-root options, and importing the user's own modules (``--import``)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path

from jascl.errors import ConfigError

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
    preset = getattr(args, "preset", None)
    overrides = [f"preset={preset}"] if preset else []
    user = list(args.set or [])
    if (
        args.backbone is not None
        and args.backbone != protocol.training.get("backbone")
        and not any(o.startswith("backbone_args=") for o in user)
    ):
        # the protocol's backbone_args belong to its own backbone; reset before --set backbone_args.KEY=V
        overrides.append("backbone_args={}")
    overrides += user
    for flag, key in (
        ("backbone", "backbone"),
        ("device", "device"),
        ("eval_mode", "eval_mode"),
        ("weights", "weights"),
    ):
        value = getattr(args, flag)
        if value is not None:
            overrides.append(f"{key}={value}")
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


def recorded_imports(names: Sequence[str]) -> list[str]:
    """``--import`` values as ``run.json`` records them: a ``.py`` file by its absolute path (a resumed run may
    start in another folder), a dotted module name as given."""
    return [str(Path(n).resolve()) if n.endswith(".py") else n for n in names]


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


def add_root_arguments(p: argparse.ArgumentParser, recorded: bool = False) -> None:
    """``--root NAME=PATH`` and ``--roots FILE``; ``recorded``: for commands that read run folders, where the
    roots recorded at run time come before the environment."""
    fallback = "the root recorded in the run folder (run.json) while it exists, then " if recorded else ""
    p.add_argument(
        "--root",
        action="append",
        metavar="NAME=PATH",
        help="folder of a dataset root the protocol names (repeat per dataset); "
        f"else a --roots file, {fallback}the environment variable JASCL_ROOT_<NAME>",
    )
    p.add_argument("--roots", default=None, metavar="FILE", help="YAML file of root names to folders (NAME: PATH)")
