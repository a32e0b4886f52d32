"""Compare grids fanned out as jobs, through submitit (local processes or SLURM).

:func:`jascl.experiments.compare.run_compare` with a :class:`Launcher` runs in four steps (:func:`run_grid`):

1. for every seed, the run folder is prepared here (run files, split manifest:
   ``run_benchmark(stage="files")``), which also says which shared session-0 bases are missing
   (:mod:`jascl.experiments.bases`: the vanilla base, and one per family of methods that change session 0 alike);
2. every missing base of every seed becomes one job (``run_benchmark(stage="bases")``), all of them side by side;
3. every (method, seed) cell whose last session is not finished becomes one job
   (``run_benchmark(stage="cell")``) that trains that method's sessions into the seed's folder;
   at most ``parallel`` jobs run at a time (locally; on SLURM the scheduler decides, and
   ``parallel`` is the array's parallelism);
4. when every job has ended, the ordinary sequential compare runs over the same folders: every
   session is reused, so the tables are written by the same code, from the same files, as a
   compare without a launcher (identical numbers).

This process trains nothing: on SLURM it can run in a small job of its own while the bases, the largest
trainings of a grid, get the resources of a job like every cell. A job that fails leaves its finished sessions
and its last checkpoint; the error names it and its log, the cells whose base failed are not submitted, and
rerunning the command submits only what is still missing. Job logs go to ``<out>/launcher/`` (submitit's folder).
SLURM options: ``partition``, ``time_min``, ``gpus_per_job``, ``cpus_per_job``, ``mem_gb``, ``account``, ``qos``,
``constraint`` (see ``docs/distributed.md``).

``devices`` > 1 (``--devices N``) trains every base and every cell with N processes and DistributedDataParallel,
as ``jascl run --devices N`` does: the job has N tasks (submitit's ``tasks_per_node``), each task exports
the torch.distributed environment submitit describes (``submitit.helpers.TorchDistributedEnvironment``:
rank, world size, master address and port) and joins the process group through
:func:`jascl.distributed.init` (NCCL on GPUs, gloo on CPU). Locally each job takes N GPUs of ``gpus``
(or runs N CPU processes when none are given); on SLURM it asks for N GPUs unless ``gpus_per_job`` says
otherwise.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from jascl.engine.config import RunConfig
from jascl.errors import ConfigError, TrainingError
from jascl.protocols.schema import Protocol

LAUNCHERS = ("local", "slurm")


@dataclasses.dataclass(frozen=True)
class Launcher:
    """Where the cells of a compare grid run.

    Attributes:
        kind: ``"local"`` (processes on this machine) or ``"slurm"``.
        parallel: jobs at a time (local: default 1 per GPU in ``gpus``, else 1; SLURM: the array's parallelism,
            0 = no limit).
        gpus: local only: the GPU ids to spread the jobs over, ``devices`` GPUs per job (empty: no GPU).
        devices: processes per cell job (DistributedDataParallel when > 1; one GPU each where there are GPUs).
        time_min: a job's time limit in minutes.
        partition, account, qos, constraint, gpus_per_job, cpus_per_job, mem_gb: SLURM resources
            (``gpus_per_job`` None: ``devices``; ``cpus_per_job`` per process).
        poll_s: seconds between checks of the running jobs.
    """

    kind: str = "local"
    parallel: int = 0
    gpus: tuple[int, ...] = ()
    devices: int = 1
    time_min: int = 24 * 60
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    gpus_per_job: int | None = None
    cpus_per_job: int = 8
    mem_gb: int | None = None
    poll_s: float = 2.0

    def __post_init__(self) -> None:
        if self.kind not in LAUNCHERS:
            raise ConfigError(f"--launcher {self.kind}: choose local or slurm")
        if self.parallel < 0 or self.time_min < 1 or (self.gpus_per_job or 0) < 0 or self.cpus_per_job < 1:
            raise ConfigError("--launcher-opt: parallel >= 0, time_min >= 1, gpus_per_job >= 0, cpus_per_job >= 1")
        if self.devices < 1:
            raise ConfigError(f"--devices {self.devices}: must be >= 1")
        if self.kind == "local" and self.gpus and len(self.gpus) < self.devices:
            raise ConfigError(
                f"--devices {self.devices} with --launcher-opt gpus={','.join(map(str, self.gpus))}: "
                f"each job needs {self.devices} GPUs; give at least that many ids"
            )

    @property
    def slots(self) -> int:
        """How many jobs this process keeps running at once (SLURM: all of them, the scheduler queues)."""
        if self.kind == "slurm":
            return 10**9 if self.parallel == 0 else self.parallel
        return self.parallel or max(1, len(self.gpus) // self.devices)

    def executor(self, folder: Path) -> Any:
        """A submitit executor for this launcher, logging into ``folder``."""
        try:
            import submitit
        except ImportError:  # pragma: no cover - submitit is a dependency
            raise ConfigError("--launcher needs submitit: pip install submitit") from None
        if self.kind == "local":
            local = submitit.LocalExecutor(folder=str(folder))
            local.update_parameters(timeout_min=self.time_min, tasks_per_node=self.devices)
            return local
        try:
            ex = submitit.AutoExecutor(folder=str(folder), cluster="slurm")
        except RuntimeError as exc:  # submitit: 'Could not detect "srun"'
            raise ConfigError(
                f"--launcher slurm: {exc} (run it on a SLURM login node, or use --launcher local)"
            ) from None
        params: dict[str, Any] = {
            "timeout_min": self.time_min,
            "gpus_per_node": self.devices if self.gpus_per_job is None else self.gpus_per_job,
            "tasks_per_node": self.devices,
            "cpus_per_task": self.cpus_per_job,
            "slurm_array_parallelism": self.parallel or 256,
        }
        for key in ("partition", "account", "qos", "constraint"):
            value = getattr(self, key)
            if value:
                params[f"slurm_{key}"] = value
        if self.mem_gb:
            params["mem_gb"] = self.mem_gb
        ex.update_parameters(**params)
        return ex


_INT_KEYS = {"parallel", "time_min", "gpus_per_job", "cpus_per_job", "mem_gb"}
_STR_KEYS = {"partition", "account", "qos", "constraint"}


def parse_launcher(kind: str | None, options: Sequence[str] = (), devices: int | None = None) -> Launcher | None:
    """``--launcher KIND``, ``--launcher-opt KEY=VALUE`` (repeatable) and ``--devices N`` as a :class:`Launcher`;
    None without one.

    Keys: ``parallel``, ``gpus`` (comma-separated ids, local), ``time_min``, and for SLURM ``partition``,
    ``account``, ``qos``, ``constraint``, ``gpus_per_job``, ``cpus_per_job``, ``mem_gb``.
    """
    if kind is None:
        if options:
            raise ConfigError("--launcher-opt needs --launcher local or --launcher slurm")
        if devices is not None:
            raise ConfigError(
                f"--devices {devices} on a compare: give --launcher local or slurm (N processes per cell job), "
                "or train one run with jascl run --devices N"
            )
        return None
    values: dict[str, Any] = {"kind": kind}
    if devices is not None:
        values["devices"] = devices
    for item in options:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep:
            raise ConfigError(f"--launcher-opt {item}: write KEY=VALUE, e.g. partition=gpu")
        try:
            if key in _INT_KEYS:
                values[key] = int(value)
            elif key in _STR_KEYS:
                values[key] = value.strip()
            elif key == "gpus":
                values[key] = tuple(int(g) for g in value.split(",") if g.strip())
            else:
                allowed = ", ".join(sorted({*_INT_KEYS, *_STR_KEYS, "gpus"}))
                raise ConfigError(f"--launcher-opt {key}: unknown key; one of {allowed}")
        except ValueError:
            raise ConfigError(f"--launcher-opt {item}: {key} takes an integer") from None
    return Launcher(**values)


def cell_finished(folder: Path, method: str, protocol: Protocol) -> bool:
    """Whether ``method``'s last session in the run folder ``folder`` is complete."""
    last = protocol.sessions[-1]
    return (folder / method / f"s{len(protocol.sessions) - 1}-{last.name}" / "metrics.json").exists()


def _job(protocol: Protocol, config: RunConfig, methods: Sequence[str], folder: str, kwargs: Mapping[str, Any],
         gpus: Sequence[int], devices: int, stage: str, bases: Sequence[str] | None = None) -> str:  # fmt: skip
    """One job (each of its ``devices`` tasks): ``run_benchmark(stage=stage)`` into the prepared run folder, a
    cell (``stage="cell"``: one method's sessions) or a shared base (``stage="bases"``: the named base).

    ``gpus``: the local launcher's share of the GPUs (CUDA_VISIBLE_DEVICES; rank r takes the r-th).
    """
    import importlib
    import importlib.util
    import os
    import sys

    from jascl.experiments.runner import run_benchmark

    for name in kwargs.get("imports", ()):  # the user's modules register their methods in this process too
        if name.endswith(".py"):
            spec = importlib.util.spec_from_file_location(Path(name).stem, name)
            if spec is None or spec.loader is None:
                raise ConfigError(f"--import {name}: not a Python module")
            module = importlib.util.module_from_spec(spec)
            sys.modules[Path(name).stem] = module
            spec.loader.exec_module(module)
        else:
            importlib.import_module(name)
    if gpus:  # the local launcher's share of the GPUs
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
    options = {**kwargs, "progress": False, "stage": stage, "bases": bases}
    if devices == 1:
        run_benchmark(protocol, config, list(methods), folder, **options)
        return folder
    from submitit.helpers import TorchDistributedEnvironment

    from jascl import distributed

    TorchDistributedEnvironment().export(set_cuda_visible_devices=False)  # RANK, WORLD_SIZE, MASTER_*, LOCAL_RANK
    config = dataclasses.replace(config, device=distributed.init(config.device))
    try:
        run_benchmark(protocol, config, list(methods), folder, **options)
    finally:
        distributed.shutdown()
    return folder


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """One job of a launcher: what it trains (``stage`` "cell" or "bases", see :func:`_job`) and its label."""

    protocol: Protocol
    methods: tuple[str, ...]
    folder: Path
    stage: str
    label: str
    bases: tuple[str, ...] | None = None


def cell_jobs(cells: Sequence[tuple[Protocol, str, Path]]) -> list[JobSpec]:
    """A job per (protocol of a seed, method, run folder) cell: the method's sessions after session 0."""
    return [JobSpec(p, (m,), folder, "cell", f"{m} seed {p.seed}") for p, m, folder in cells]


def base_jobs(
    protocol: Protocol, methods: Sequence[str], folder: Path, missing: Mapping[str, Sequence[str]]
) -> list[JobSpec]:
    """A job per missing shared base of a seed's run folder (``missing``: base folder -> the methods starting
    from it, :func:`jascl.experiments.bases.missing_bases`)."""
    return [
        JobSpec(protocol, tuple(methods), folder, "bases", f"{name} seed {protocol.seed}", (name,)) for name in missing
    ]


def run_jobs(
    launcher: Launcher,
    jobs: Sequence[JobSpec],
    config: RunConfig,
    out: Path,
    kwargs: Mapping[str, Any],
    echo: Callable[[str], None] = print,
    what: str = "cells",
) -> list[tuple[JobSpec, str]]:
    """Run every job, at most ``launcher.slots`` at once; wait for all; return the failed jobs with their logs
    (each also named in ``echo``'s lines).

    ``what``: how the lines name the jobs ("cells", "base models"). Ctrl-C or SIGTERM cancels the running jobs.
    """
    if not jobs:
        return []
    folder = out / "launcher"
    folder.mkdir(parents=True, exist_ok=True)
    executor = launcher.executor(folder)
    pending = list(jobs)
    running: list[tuple[Any, JobSpec, list[int]]] = []
    failed: list[tuple[JobSpec, str]] = []
    free_gpus = list(launcher.gpus) if launcher.kind == "local" else []  # SLURM: the scheduler assigns them
    done = 0
    echo(f"[launcher] {len(jobs)} {what} as {launcher.kind} jobs, at most {min(launcher.slots, len(jobs))} at once")
    try:
        while pending or running:
            while pending and len(running) < launcher.slots:
                spec = pending.pop(0)
                share = free_gpus[: launcher.devices]
                del free_gpus[: len(share)]
                job = executor.submit(
                    _job, spec.protocol, config, spec.methods, str(spec.folder), dict(kwargs), share,
                    launcher.devices, spec.stage, spec.bases,
                )  # fmt: skip
                processes = f", {launcher.devices} processes" if launcher.devices > 1 else ""
                echo(f"[launcher] submitted {spec.label}: job {job.job_id}{processes}")
                running.append((job, spec, share))
            time.sleep(launcher.poll_s if running else 0)
            still = []
            for job, spec, share in running:
                if not job.done():
                    still.append((job, spec, share))
                    continue
                free_gpus.extend(share)
                done += 1
                exc = job.exception()
                if exc is None:
                    echo(f"[launcher] {spec.label}: finished ({done}/{len(jobs)})")
                else:
                    message = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
                    failed.append((spec, str(job.paths.stderr)))
                    echo(f"[launcher] {spec.label}: failed ({message}); log {job.paths.stderr}")
            running = still
    except BaseException:  # Ctrl-C, SIGTERM: do not leave orphaned jobs running
        for job, _, _ in running:
            job.cancel(check=False)
        raise
    return failed


def failure(failed: Sequence[tuple[JobSpec, str]], total: int, what: str, skipped: int = 0) -> TrainingError:
    """One line naming the failed jobs (of ``total`` ``what``) and the log of the first; ``skipped``: the cells
    not submitted because a base model they start from failed."""
    labels = ", ".join(spec.label for spec, _ in failed)
    waiting = f"; {skipped} cells were not submitted, their base model missing" if skipped else ""
    return TrainingError(
        f"{len(failed)} of {total} {what} failed ({labels}); the first's log: {failed[0][1]}{waiting}; "
        "rerun the same command to resubmit only what is missing"
    )


def run_grid(
    launcher: Launcher,
    protocol: Protocol,
    config: RunConfig,
    methods: Sequence[str],
    seeds: Sequence[int],
    out: Path,
    kwargs: Mapping[str, Any],
    progress: bool = True,
    echo: Callable[[str], None] = print,
) -> None:
    """The module docstring's steps 1 and 2 for a compare grid: every seed's run folder is prepared here, then
    every missing shared base is a job, then every unfinished (method, seed) cell whose bases are complete.

    ``kwargs``: :func:`jascl.experiments.runner.run_benchmark`'s keywords (``cache_dir``, data options, imports).

    Raises:
        TrainingError: one line naming the failed jobs and the first's log; everything finished stays.
    """
    from jascl.experiments.runner import run_benchmark

    bases: list[JobSpec] = []
    waiting: dict[tuple[Path, str], list[str]] = {}  # (folder, base) -> the methods starting from it
    seeded = {seed: dataclasses.replace(protocol, seed=seed) for seed in seeds}
    for seed, p in seeded.items():
        folder = out / f"seed-{seed}"
        echo(f"[compare] seed {seed}: preparing the run folder")
        missing = run_benchmark(p, config, methods, folder, progress=progress, echo=echo, stage="files", **kwargs)
        bases += base_jobs(p, methods, folder, missing["bases"])
        waiting.update({(folder, name): members for name, members in missing["bases"].items()})
    failed_bases = run_jobs(launcher, bases, config, out, kwargs, echo, "base models")
    lost = {
        (spec.folder, m) for spec, _ in failed_bases for name in spec.bases or () for m in waiting[(spec.folder, name)]
    }
    cells = [
        (p, m, out / f"seed-{seed}")
        for seed, p in seeded.items()
        for m in methods
        if not cell_finished(out / f"seed-{seed}", m, p)
    ]
    runnable = [c for c in cells if (c[2], c[1]) not in lost]
    failed_cells = run_jobs(launcher, cell_jobs(runnable), config, out, kwargs, echo)
    if failed_bases:
        raise failure(failed_bases, len(bases), "base models", len(cells) - len(runnable))
    if failed_cells:
        raise failure(failed_cells, len(runnable), "cells")
