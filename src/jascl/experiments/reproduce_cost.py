"""The GPU-hour estimate of a ``jascl reproduce`` plan (``--dry-run``), from the paper's compute table.

The paper times one session per benchmark family (table "Computational analysis for Session 1", JASCL
column, one A100 40GB): Med JASCL-Disjoint 4h 06m (U-Net, session 1: 5 classes x 5 shots, 200 epochs), Med
Semi-Supervised-JASCL 5h 18m (MedFormer, the same 25 labelled volumes plus 25 unlabelled, 200 epochs),
Natural-JASCL 1h 43m (SAM ViT-B, session 1: 5 classes x 10 shots, 10 epochs). A session of a job is costed
by its size, *labelled training samples x epochs*, relative to that timed session:

    hours(t) = hours_timed x (samples_t x epochs_t) / (samples_timed x epochs_timed)

so a base session of 200 TotalSegmentator volumes costs 8x a 25-volume session 1, and a natural base of 4,700
BDD images at 10 SAM epochs 94x. The whole timed session (its evaluation included) scales with the data, so
where evaluation is most of a session the base sessions are overestimated; the estimate is a planning figure.

Samples of a session: ``shots x`` its taught classes (new and recurring), or its ``train`` cap for a
``shots: all`` session; a ``shots: all`` session without a cap takes the paper's own split table where it has
one (:data:`PAPER_BASE_SAMPLES`: CholecSeg8k's 3,246 training images, table "Dataset splits for 2D robotic
surgery benchmark") and is otherwise costed like the timed session (said in the output: COCO-O's Painting).
Families the compute table does not time borrow the rate of the nearest timed one, and the output names it:
surgery, COCO-O and DeepLab natural runs SAM's (the only 2D timing), Med-Mixed the Disjoint U-Net's.
Epochs are the job's resolved ones (SAM's 10, the quick mode's fraction).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from jascl.experiments.reproduce_plan import VANILLA_BASE, Job, Plan, base_groups, base_key, job_protocol, quick_epochs

if TYPE_CHECKING:
    from jascl.protocols.schema import Protocol


@dataclasses.dataclass(frozen=True)
class Timing:
    """One session the paper timed: hours on one A100 and the labelled samples x epochs it trained."""

    hours: float
    samples: int
    epochs: int
    what: str

    def hours_per_sample_epoch(self) -> float:
        return self.hours / (self.samples * self.epochs)


#: the compute table's JASCL column, per benchmark family
TIMINGS = {
    "med": Timing(4.1, 25, 200, "Med JASCL-Disjoint session 1, U-Net: 4h 06m"),
    "med-ss": Timing(5.3, 25, 200, "Med Semi-Supervised-JASCL session 1, MedFormer: 5h 18m"),
    "natural": Timing(1.717, 50, 10, "Natural-JASCL session 1, SAM ViT-B, 10 epochs: 1h 43m"),
}

#: families the compute table does not time -> the timed family whose rate they borrow
BORROWED = {"surgery": "natural", "coco-o": "natural"}

#: training samples of ``shots: all`` sessions without a ``train`` cap, from the paper's split tables
PAPER_BASE_SAMPLES = {("surgery", "cholec"): 3246, ("surgery-cil", "organs"): 3246}


def family(protocol: str) -> str | None:
    """The benchmark family of a protocol name (None for the embedded synthetic / bench protocols)."""
    name = Path(protocol).stem
    if name.startswith(("synthetic", "bench", "constraint")):
        return None
    if name == "med-ss":
        return "med-ss"
    for prefix in ("coco-o", "med", "natural", "surgery"):
        if name.startswith(prefix):
            return prefix
    return None


def session_samples(protocol: Protocol, t: int) -> int | None:
    """Labelled training samples of session ``t`` (None: a ``shots: all`` session of unknown size)."""
    s = protocol.sessions[t]
    if s.shots is not None:
        return s.shots * (len(s.new_classes) + len(s.recurring_classes))
    if s.train is not None:
        return s.train
    return PAPER_BASE_SAMPLES.get((protocol.name.split("-first")[0], s.name))


@dataclasses.dataclass
class Estimate:
    """GPU-hours of a plan: base sessions and incremental sessions apart, and what the figure rests on."""

    base_hours: float = 0.0
    incremental_hours: float = 0.0
    base_sessions: int = 0
    incremental_sessions: int = 0
    longest_hours: float = 0.0  # a session 0, then the longest sessions after it: the wall time with GPUs to spare
    notes: list[str] = dataclasses.field(default_factory=list)
    embedded: list[str] = dataclasses.field(default_factory=list)

    @property
    def hours(self) -> float:
        return self.base_hours + self.incremental_hours


def _epochs(job: Job, protocol: Protocol, quick: bool) -> tuple[int, int]:
    from jascl.engine.config import resolve_config

    config = resolve_config(protocol.training, protocol.path, None, list(job.overrides))
    epochs = (config.epochs_base, config.epochs_incremental)
    return quick_epochs(*epochs) if quick else epochs


def estimate(plan: Plan, seeds: int) -> Estimate:
    """The plan's GPU-hours: every shared base (the vanilla one, or a family's keyed one) counted once per base
    and seed, every other session once per method and seed, each costed by its size (module docstring); and its
    longest chain, one job's session 0 and the sessions after it (a launcher's wall time with GPUs to spare)."""
    out = Estimate()
    bases: set[tuple] = set()
    for job in plan.jobs.values():
        fam = family(job.protocol)
        if fam is None:
            out.embedded.append(Path(job.protocol).stem)
            continue
        timed = fam if fam in TIMINGS else BORROWED.get(fam, "natural")
        if fam == "natural" and "backbone=sam-vitb" not in job.overrides:
            note = "natural runs without SAM (DeepLab) costed at SAM ViT-B's rate (the paper times no DeepLab run)"
        elif fam in BORROWED:
            note = f"{fam} costed at {TIMINGS[timed].what.split(',')[0]}'s rate (the paper times no {fam} run)"
        else:
            note = ""
        if note and note not in out.notes:
            out.notes.append(note)
        rate = TIMINGS[timed]
        protocol = job_protocol(job)
        epochs_base, epochs_inc = _epochs(job, protocol, plan.quick)
        n = len(protocol.sessions)

        def hours(t: int, rate: Timing = rate, protocol: Protocol = protocol) -> float:
            samples = session_samples(protocol, t)
            if samples is None:
                unknown = f"{protocol.name} session {t} ({protocol.sessions[t].name}): size not in the paper, costed like the timed session"
                if unknown not in out.notes:
                    out.notes.append(unknown)
                samples = rate.samples
            epochs = epochs_base if t == 0 else epochs_inc
            return rate.hours_per_sample_epoch() * samples * epochs

        groups = base_groups(job.methods)
        own = len(groups.get("", []))
        shared = len(job.methods) - own
        keyed = [(base_key(job), k) for k in groups if k not in ("", VANILLA_BASE)]
        new_keyed = [k for k in keyed if k not in bases]
        new_base = VANILLA_BASE in groups and base_key(job) not in bases
        bases.update([base_key(job), *keyed])
        base_runs = (1 if new_base else 0) + len(new_keyed) + own
        incremental = sum(hours(t) for t in range(1, n))
        out.base_hours += base_runs * hours(0) * seeds
        out.base_sessions += base_runs * seeds
        out.incremental_hours += (shared + own) * incremental * seeds
        out.incremental_sessions += (shared + own) * (n - 1) * seeds
        out.longest_hours = max(out.longest_hours, hours(0) + incremental)
    return out


def describe_estimate(plan: Plan, seeds: int) -> list[str]:
    """The estimate's lines of the ``--dry-run`` text."""
    est = estimate(plan, seeds)
    lines: list[str] = []
    if est.base_sessions or est.incremental_sessions:
        lines.append(
            f"  estimate: about {est.hours:.0f} GPU-hours on one A100 (base sessions {est.base_sessions} x "
            f"{_per(est.base_hours, est.base_sessions)} h = {est.base_hours:.0f} h, incremental sessions "
            f"{est.incremental_sessions} x {_per(est.incremental_hours, est.incremental_sessions)} h = "
            f"{est.incremental_hours:.0f} h; each session costed by labelled samples x epochs against the paper's "
            "compute table: " + "; ".join(t.what for t in TIMINGS.values()) + ")"
        )
        lines.append(
            f"  with --launcher and a GPU for every job at once: at least {est.longest_hours:.0f} h of wall time (a "
            "session-0 base, then the longest cell after it; the jobs of every row and seed run side by side)"
        )
        lines += [f"  ({note})" for note in est.notes]
    if est.embedded:
        lines.append(f"  {', '.join(dict.fromkeys(est.embedded))}: an embedded benchmark, minutes per method on a CPU")
    return lines


def _per(total: float, count: int) -> str:
    return f"{total / count:.1f}" if count else "0"
