"""Dataset roots: where each dataset entry of a protocol lives on this machine (``--root NAME=PATH``, a roots
file, ``JASCL_ROOT_<NAME>``, or what ``jascl data download`` put under ``$JASCL_DATA``; never code or protocols)."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import yaml

from jascl.data.catalogue import CATALOGUE, default_root
from jascl.errors import ConfigError, DataError
from jascl.protocols.schema import Protocol

log = logging.getLogger("jascl")


def env_var(root_name: str) -> str:
    """``JASCL_ROOT_<NAME>``: the root name upper-cased, other characters as '_' (``bdd-10k`` -> ``JASCL_ROOT_BDD_10K``)."""
    return "JASCL_ROOT_" + re.sub(r"[^A-Z0-9]", "_", root_name.upper())


def parse_root_args(items: Sequence[str] | None) -> dict[str, str]:
    """``["amos=/data/AMOS", ...]`` (from ``--root``) -> ``{"amos": "/data/AMOS"}``.

    Raises:
        ConfigError: an item without ``=`` or with an empty name or path.
    """
    out: dict[str, str] = {}
    for item in items or []:
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ConfigError(f"--root {item}: expected NAME=PATH, e.g. --root amos=/data/AMOS22")
        out[name.strip()] = path.strip()
    return out


def read_roots_file(path: str | Path) -> dict[str, str]:
    """A YAML mapping ``NAME: PATH`` (``--roots FILE``)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: roots file not found (a YAML mapping of dataset root names to folders)")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, Mapping) or not all(isinstance(v, (str, Path)) for v in data.values()):
        raise ConfigError(f"{p}: must be a mapping of root names to folders, e.g. 'amos: /data/AMOS22'")
    return {str(k): str(v) for k, v in data.items()}


def root_names(protocol: Protocol) -> dict[str, list[str]]:
    """Root name -> the dataset entries (and layouts) that use it."""
    out: dict[str, list[str]] = {}
    for spec in protocol.datasets.values():
        out.setdefault(spec.root, []).append(f"{spec.name} ({spec.layout})")
    return out


def resolve_roots(
    protocol: Protocol,
    given: Mapping[str, str | Path] | None = None,
    roots_file: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    problems: list[str] | None = None,
) -> dict[str, Path]:
    """Folder of every root name the protocol uses: ``given`` (``--root``) > roots file > ``JASCL_ROOT_<NAME>`` >
    the root ``jascl data download NAME`` made ready under ``$JASCL_DATA`` (:func:`jascl.data.catalogue.default_root`).

    Args:
        problems: if given, unset roots are appended here as one-line messages
            instead of raising.

    Raises:
        DataError: a root is not set anywhere (one line naming the flag and variable to set).
        ConfigError: ``given`` names a root the protocol does not use (a typo).
    """
    environ = os.environ if environ is None else environ
    names = root_names(protocol)
    given = dict(given or {})
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise ConfigError(
            f"--root {unknown[0]}=...: protocol {protocol.name} has no dataset root of that name "
            f"(its roots: {', '.join(sorted(names)) or 'none'})"
        )
    from_file = read_roots_file(roots_file) if roots_file is not None else {}
    out: dict[str, Path] = {}
    for name, users in sorted(names.items()):
        path = given.get(name) or from_file.get(name) or environ.get(env_var(name)) or default_root(name, environ)
        if path:
            out[name] = Path(path).expanduser()
            continue
        message = (
            f"dataset root {name!r} ({', '.join(users)}) is not set; pass --root {name}=PATH or set {env_var(name)}"
        )
        if name in CATALOGUE:
            message += f" ('jascl data download {name}' fetches it or says how to get it)"
        if problems is None:
            raise DataError(f"{protocol.path}: {message}")
        problems.append(message)
    return out
