"""The fidelity marks of results tables: each method's label (:mod:`jascl.methods.fidelity`) read from the registry
index (no method imported), a row's footnote mark, and the footnotes under a table."""

from __future__ import annotations

from collections.abc import Iterable

from jascl.methods.fidelity import UNLABELLED, Fidelity, legend
from jascl.methods.registry import METHODS


def method_fidelity(name: str) -> Fidelity | None:
    """The registered label of ``name`` (a composed name's from its parts), from the registry index (no import);
    None for a name the registry does not know."""
    if name not in METHODS:
        return None
    summary = METHODS.summary(name)
    return Fidelity(summary.fidelity, summary.flags)


def mark(name: str) -> str:
    """``name`` with its footnote mark: ``gen-replay [S]``; ``name [?]`` for a name the registry does not know."""
    fid = method_fidelity(name)
    return f"{name} [{fid.mark if fid else UNLABELLED}]"


def footnotes(names: Iterable[str]) -> list[str]:
    """Under a table: the legend, then one line per method, ``[S] gen-replay: simplified: ...; uses exemplars``."""
    names = list(dict.fromkeys(names))
    fids = {n: method_fidelity(n) for n in names}
    lines = [legend(f if f is not None else Fidelity() for f in fids.values())]
    for n in names:
        f = fids[n]
        lines.append(f"[{f.mark}] {n}: {f.text()}" if f is not None else f"[{UNLABELLED}] {n}: not a registered method")
    return lines
