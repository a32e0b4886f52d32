"""How a reproduction's jobs (:mod:`jascl.experiments.reproduce`) share session-0 bases, and go to a launcher as
one set of jobs."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jascl.errors import ConfigError, TrainingError
from jascl.experiments.reproduce_plan import VANILLA_BASE, Job, Plan, base_key, job_protocol, method_base, roots_for
from jascl.protocols.schema import Protocol

if TYPE_CHECKING:
    from jascl.experiments.launcher import Launcher


def manifest_for(protocol: str, manifests: str | Path | Sequence[str | Path] | None) -> str | None:
    """The split manifest (``--split-manifest``, one or several) written by a run of ``protocol``, or None: each
    job on that protocol reuses its samples, the table's other jobs select their own."""
    if manifests is None:
        return None
    for path in [manifests] if isinstance(manifests, (str, Path)) else manifests:
        try:
            made_for = json.loads(Path(path).read_text()).get("protocol")
        except (OSError, ValueError, AttributeError):
            raise ConfigError(f"--split-manifest {path}: not a readable manifest.json of a run folder") from None
        if made_for == protocol:
            return str(path)
    return None


def owners_of(plan: Plan, manifests: Any) -> dict[str, Job]:
    """Job -> the job whose session-0 bases it shares (itself when it is the first with its base, or when its
    samples come from another manifest, or none, than that job's: then it trains its own session 0)."""
    first: dict[tuple, Job] = {}
    owners = {}
    for job in plan.jobs.values():
        owner = first.setdefault(base_key(job), job)
        same = manifest_for(job_protocol(owner).name, manifests) == manifest_for(job_protocol(job).name, manifests)
        owners[job.key] = owner if same else job
    return owners


def cells_finished(job: Job, protocol: Protocol, methods: Sequence[str], seeds: Sequence[int], out: Path) -> bool:
    from jascl.experiments.launcher import cell_finished

    return all(cell_finished(out / job.key / f"seed-{s}", m, protocol) for m in methods for s in seeds)


def fan_out_plan(plan: Plan, seeds: Sequence[int], out: Path, launcher: Launcher, owners: Mapping[str, Job],
             prepare: Callable[[Job], tuple], roots: Mapping[str, Any] | None, compare_kwargs: Mapping[str, Any],
             echo: Callable[[str], None]) -> str:  # fmt: skip
    """Every job's and seed's bases and cells as one set of launcher jobs (:func:`jascl.experiments.fanout.fan_out`);
    a job sharing another's session 0 links that job's bases. Returns the launcher's error ("" if none failed);
    a job that cannot be prepared is left to the sequential pass, which records why."""
    from jascl.experiments.fanout import RunSpec, fan_out

    specs = []
    for job in plan.jobs.values():
        try:
            protocol, config, kwargs, methods = prepare(job)
        except Exception:  # (recorded as this job's failure in the sequential pass)
            continue
        owner = owners[job.key]
        names = {method_base(m) for m in methods} - {""}
        bases = sorted("base" if n == VANILLA_BASE else f"base-{n}" for n in names)
        for seed in seeds:
            folder = out / job.key / f"seed-{seed}"
            borrows = {b: out / owner.key / f"seed-{seed}" / b for b in bases} if owner is not job else {}
            options = {"split_manifest": kwargs.get("split_manifest"), "roots": roots_for(job, roots)}
            label = f"{job.key} seed {seed}"
            specs.append(RunSpec(dataclasses.replace(protocol, seed=seed), config, tuple(methods), folder, label,
                                 options, borrows))  # fmt: skip
    shared = {k: v for k, v in compare_kwargs.items() if k not in ("progress", "split_manifest")}
    try:
        fan_out(launcher, specs, out, shared, compare_kwargs.get("progress", True), echo)
    except TrainingError as exc:
        echo(f"[reproduce] {exc}")
        return str(exc)
    return ""
