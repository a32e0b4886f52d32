"""Benchmark protocols: built-in YAML files and the loader that validates them."""

from __future__ import annotations

from pathlib import Path

from jascl.errors import ConfigError
from jascl.protocols.parse import load_protocol, parse_protocol
from jascl.protocols.schema import ClassSpec, DomainSpec, Protocol, SessionSpec, SyntheticSpec, UnlabelledSourceSpec
from jascl.protocols.variants import with_unlabelled_extra

BUILTIN_DIR = Path(__file__).parent / "builtin"

__all__ = [
    "ClassSpec",
    "DomainSpec",
    "Protocol",
    "SessionSpec",
    "SyntheticSpec",
    "UnlabelledSourceSpec",
    "builtin_protocols",
    "get_protocol",
    "load_protocol",
    "parse_protocol",
    "with_unlabelled_extra",
]


def builtin_protocols() -> dict[str, Path]:
    """Names of the built-in protocols mapped to their YAML files."""
    return {p.stem: p for p in sorted(BUILTIN_DIR.glob("*.yaml"))}


def get_protocol(name_or_path: str | Path) -> Protocol:
    """Load a built-in protocol by name, or any protocol YAML by path."""
    builtins = builtin_protocols()
    if str(name_or_path) in builtins:
        return load_protocol(builtins[str(name_or_path)])
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        return load_protocol(path)
    from jascl.registry import did_you_mean

    hint = did_you_mean(str(name_or_path), builtins)
    raise ConfigError(f"protocol {name_or_path!r}{hint}: not a built-in ({', '.join(builtins)}) nor a YAML file path")
