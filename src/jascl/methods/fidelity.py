"""How close a registered method is to its source: the fidelity label every method carries, and how tables show it.

A method registers a label (``METHODS.register(..., fidelity=..., flags=...)``), kept in the registry index so that
``jascl methods`` shows it without importing the method:

* ``faithful`` -- the source's method, adapted to dense prediction only where it must be;
* ``simplified: <what>`` -- a part of the source is left out or replaced (the text says which);
* ``reconstructed: <from what>`` -- the source could not be read in full; the method is rebuilt from what could
  (the text names it).

Flags name settings a reader must know to compare rows: :data:`FLAGS` (e.g. ``uses exemplars``: it keeps real
samples, or parts of them, of earlier sessions; ``test-time domain oracle``: it is told each test sample's domain).

Every results table marks each row with a footnote mark (:func:`jascl.results.fidelity.mark`: ``[S,E]`` =
simplified, uses exemplars) and lists, under the table, the label of every marked row
(:func:`jascl.results.fidelity.footnotes`). A composed method (``a+b``) carries
the least faithful of its parts' labels, naming the parts, and the union of their flags.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from jascl.errors import ConfigError

#: the kinds of label, most faithful first, and their marks
KINDS = {"faithful": "F", "simplified": "S", "reconstructed": "R"}
#: the setting flags a method may carry, and their marks
FLAGS = {
    "uses exemplars": "E",
    "test-time domain oracle": "D",
    "annotation oracle": "A",
    "pre-trained weights needed": "W",
}
#: the mark of a method without a label (a user's method, or a run folder's name the registry does not know)
UNLABELLED = "?"


def check_fidelity(name: str, fidelity: str, flags: Sequence[str]) -> None:
    """A one-line ConfigError unless ``fidelity`` is "" (not stated), ``faithful``, ``simplified: <what>`` or
    ``reconstructed: <from what>`` and every flag is one of :data:`FLAGS`."""
    kind, _, text = fidelity.partition(":")
    ok = fidelity in ("", "faithful") or (kind in ("simplified", "reconstructed") and text.strip() != "")
    if not ok:
        raise ConfigError(
            f"method {name}: fidelity {fidelity!r}: use 'faithful', 'simplified: <what>' or 'reconstructed: <from what>'"
        )
    unknown = [f for f in flags if f not in FLAGS]
    if unknown:
        raise ConfigError(f"method {name}: unknown fidelity flags {unknown}; known: {', '.join(FLAGS)}")


@dataclass(frozen=True)
class Fidelity:
    """A method's fidelity label and setting flags.

    Attributes:
        label: ``faithful``, ``simplified: ...``, ``reconstructed: ...`` or "" (not stated).
        flags: setting flags (:data:`FLAGS`).
    """

    label: str = ""
    flags: tuple[str, ...] = ()

    @property
    def kind(self) -> str:
        """``faithful``, ``simplified``, ``reconstructed`` or "" (not stated)."""
        return self.label.partition(":")[0].strip()

    @property
    def mark(self) -> str:
        """The footnote mark: the kind's letter, then the flags' (``S,E``); :data:`UNLABELLED` without a label."""
        return ",".join([KINDS.get(self.kind, UNLABELLED), *(FLAGS[f] for f in self.flags if f in FLAGS)])

    def text(self) -> str:
        """The label and flags in one line."""
        return "; ".join([self.label or "not stated", *self.flags])


def combine(parts: Sequence[tuple[str, Fidelity]]) -> Fidelity:
    """The label of a composed method: the least faithful kind among the parts, naming the parts that are not
    faithful; the union of the flags (in the parts' order)."""
    order = ["faithful", "simplified", "reconstructed"]
    kinds = [f.kind for _, f in parts]
    if any(k not in order for k in kinds):
        label = ""
    elif all(k == "faithful" for k in kinds):
        label = "faithful"
    else:
        worst = max(kinds, key=order.index)
        label = f"{worst}: " + "; ".join(f"{p}: {f.label}" for p, f in parts if f.kind != "faithful")
    flags = tuple(dict.fromkeys(flag for _, f in parts for flag in f.flags))
    return Fidelity(label, flags)


def legend(fidelities: Iterable[Fidelity]) -> str:
    """What the marks used by ``fidelities`` mean, in one line."""
    used = {m for f in fidelities for m in f.mark.split(",")}
    words = {**{v: k for k, v in KINDS.items()}, **{v: k for k, v in FLAGS.items()}, UNLABELLED: "no label"}
    return "Fidelity marks: " + ", ".join(
        f"{m} {words[m]}" for m in [*KINDS.values(), *FLAGS.values(), "?"] if m in used
    )
