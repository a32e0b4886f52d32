"""``jascl data download`` / ``data list`` and ``jascl weights fetch`` / ``weights list``: getting the public
datasets and the released checkpoints (the tables are :mod:`jascl.data.catalogue` and :mod:`jascl.networks.released`).

Every network access is one of these explicit commands; ``jascl run`` and the others never download anything.
"""

from __future__ import annotations

import argparse
import os

from jascl.cli.common import add_root_arguments


def _download_options(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--to", default=None, metavar="DIR", help=f"download folder (default {default})")
    p.add_argument(
        "--no-verify",
        action="store_true",
        help="accept a file without a recorded checksum (or whose checksum differs); its SHA-256 is printed",
    )
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def add_data_getting_parsers(data_sub) -> None:
    """``data download`` and ``data list`` (under the ``data`` command's subparsers)."""
    download = data_sub.add_parser(
        "download",
        help="fetch a public dataset (resumable, verified), unpack it into the layout jascl reads and print its "
        "--root line; for a dataset behind a registration, print how to get it",
    )
    download.add_argument("name", help="the dataset's root name (see 'jascl data list')")
    _download_options(download, "$JASCL_DATA; the dataset goes into DIR/NAME/")
    download.set_defaults(func=cmd_data_download)
    listing = data_sub.add_parser(
        "list",
        help="every dataset the protocols name: layout, root name, licence, size, how to get it, whether its root is set",
    )
    add_root_arguments(listing)
    listing.set_defaults(func=cmd_data_list)


def add_weights_parser(subparsers) -> argparse.ArgumentParser:
    """``weights fetch NAME`` and ``weights list``."""
    weights = subparsers.add_parser("weights", help="fetch the released checkpoints the backbones and methods use")
    sub = weights.add_subparsers(dest="weights_command", required=True)
    fetch = sub.add_parser("fetch", help="fetch a released checkpoint (resumable, verified) and print how to use it")
    fetch.add_argument("name", help="the checkpoint's name (see 'jascl weights list')")
    _download_options(fetch, "$JASCL_DATA/weights")
    fetch.set_defaults(func=cmd_weights_fetch)
    sub.add_parser("list", help="the released checkpoints: source, licence, checksum, use").set_defaults(
        func=cmd_weights_list
    )
    return weights


def cmd_data_download(args: argparse.Namespace) -> int:
    from jascl.data.getting import download_dataset

    download_dataset(args.name, args.to, no_verify=args.no_verify, progress=not args.no_progress)
    return 0


def root_status(name: str, given: dict[str, str], from_file: dict[str, str], environ=None) -> str:
    """Where the root ``name`` is set: ``--root``, the roots file, ``JASCL_ROOT_<NAME>``, ``$JASCL_DATA`` or "no"."""
    from jascl.data.catalogue import default_root
    from jascl.data.real.roots import env_var

    environ = os.environ if environ is None else environ
    if name in given:
        return "--root"
    if name in from_file:
        return "roots file"
    if environ.get(env_var(name)):
        return env_var(name)
    if default_root(name, environ) is not None:
        return "$JASCL_DATA"
    return "no"


def cmd_data_list(args: argparse.Namespace) -> int:
    """One block per dataset (readable at any terminal width): protocol roots first, then the others."""
    from jascl.data.catalogue import CATALOGUE, protocol_roots
    from jascl.data.real import parse_root_args
    from jascl.data.real.roots import read_roots_file

    given = parse_root_args(args.root)
    from_file = read_roots_file(args.roots) if args.roots else {}
    users = protocol_roots()
    for name in sorted(CATALOGUE, key=lambda n: (n not in users, n)):
        e = CATALOGUE[name]
        protocols = ", ".join(sorted(users.get(name, {}))) or "none built in"
        get = f"download, checksum {e.verification}" if e.downloadable else e.how
        print(f"{name}: {e.title}")
        print(f"  layout {e.layout} | protocols: {protocols} | root set: {root_status(name, given, from_file)}")
        print(f"  get it: {get} | size: {e.size or 'not recorded'}")
        print(f"  licence: {e.licence} | source: {e.source}")
    print(f"{len(CATALOGUE)} datasets; 'jascl data download NAME --to DIR' fetches one, or says how to get it")
    return 0


def cmd_weights_fetch(args: argparse.Namespace) -> int:
    from jascl.networks.released import fetch_weights

    fetch_weights(args.name, args.to, no_verify=args.no_verify, progress=not args.no_progress)
    return 0


def cmd_weights_list(args: argparse.Namespace) -> int:
    from jascl.networks.released import WEIGHTS

    for w in WEIGHTS.values():
        print(f"{w.name}: {w.title}")
        print(f"  checksum: {w.verification} | licence: {w.licence}")
        print(f"  source: {w.source} | file: {w.archive.url}")
        print(f"  use: {w.use.format(path='FILE')}")
    print(f"{len(WEIGHTS)} checkpoints; 'jascl weights fetch NAME --to DIR' fetches one")
    return 0
