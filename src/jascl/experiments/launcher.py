"""Compare grids fanned out as jobs: one job per (method, seed) cell, through submitit (local processes or SLURM).

:func:`jascl.experiments.compare.run_compare` with a :class:`Launcher` runs in three steps:

1. for every seed, the run folder is prepared here (run files, split manifest) and the shared
   session-0 base model is trained, once, in this process (``run_benchmark(stage="base")``);
2. every (method, seed) cell whose last session is not finished becomes one job
   (``run_benchmark(stage="cell")``) that trains that method's sessions into the seed's folder;
   at most ``parallel`` jobs run at a time (locally; on SLURM the scheduler decides, and
   ``parallel`` is the array's parallelism);
3. when every job has ended, the ordinary sequential compare runs over the same folders: every
   session is reused, so the tables are written by the same code, from the same files, as a
   compare without a launcher (identical numbers).

A cell that fails leaves its finished sessions and its last checkpoint; the error names the cell
and its log, and rerunning the command submits only the cells that are still missing. Job logs go to
``<out>/launcher/`` (submitit's folder). SLURM options: ``partition``, ``time_min``, ``gpus_per_job``,
``cpus_per_job``, ``mem_gb``, ``account``, ``qos``, ``constraint`` (see ``docs/distributed.md``).

``devices`` > 1 (``--devices N``) trains every cell with N processes and DistributedDataParallel, as
``jascl run --devices N`` does: the job has N tasks (submitit's ``tasks_per_node``), each task exports
the torch.distributed environment submitit describes (``submitit.helpers.TorchDistributedEnvironment``:
rank, world size, master address and port) and joins the process group through
:func:`jascl.distributed.init` (NCCL on GPUs, gloo on CPU). Locally each job takes N GPUs of ``gpus``
(or runs N CPU processes when none are given); on SLURM it asks for N GPUs unless ``gpus_per_job`` says
otherwise. The shared base still trains once, in this process, with one device.
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


def _train_cell(
    protocol: Protocol,
    config: RunConfig,
    method: str,
    folder: str,
    kwargs: Mapping[str, Any],
    gpus: Sequence[int] = (),
    devices: int = 1,
) -> str:
    """One job (each of its ``devices`` tasks): ``method``'s sessions on ``protocol`` into the prepared run folder.

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
    if devices == 1:
        run_benchmark(protocol, config, [method], folder, progress=False, stage="cell", **kwargs)
        return method
    from submitit.helpers import TorchDistributedEnvironment

    from jascl import distributed

    TorchDistributedEnvironment().export(set_cuda_visible_devices=False)  # RANK, WORLD_SIZE, MASTER_*, LOCAL_RANK
    config = dataclasses.replace(config, device=distributed.init(config.device))
    try:
        run_benchmark(protocol, config, [method], folder, progress=False, stage="cell", **kwargs)
    finally:
        distributed.shutdown()
    return method


def run_cells(
    launcher: Launcher,
    cells: Sequence[tuple[Protocol, str, Path]],
    config: RunConfig,
    out: Path,
    kwargs: Mapping[str, Any],
    echo: Callable[[str], None] = print,
) -> None:
    """Run every (protocol of a seed, method, run folder) cell as a job; wait for all; raise on failures.

    Raises:
        TrainingError: one line naming the failed cells and the log of the first; the others' results stay.
    """
    if not cells:
        return
    folder = out / "launcher"
    folder.mkdir(parents=True, exist_ok=True)
    executor = launcher.executor(folder)
    pending = list(cells)
    running: list[tuple[Any, str, list[int]]] = []
    failed: list[str] = []
    first_log = ""
    free_gpus = list(launcher.gpus)
    done = 0
    echo(f"[launcher] {len(cells)} cells as {launcher.kind} jobs, at most {min(launcher.slots, len(cells))} at once")
    try:
        while pending or running:
            while pending and len(running) < launcher.slots:
                protocol, method, run_dir = pending.pop(0)
                share = free_gpus[: launcher.devices] if launcher.kind == "local" else []
                del free_gpus[: len(share)]
                job = executor.submit(
                    _train_cell, protocol, config, method, str(run_dir), dict(kwargs), share, launcher.devices
                )
                label = f"{method} seed {protocol.seed}"
                processes = f", {launcher.devices} processes" if launcher.devices > 1 else ""
                echo(f"[launcher] submitted {label}: job {job.job_id}{processes}")
                running.append((job, label, share))
            time.sleep(launcher.poll_s if running else 0)
            still = []
            for job, label, share in running:
                if not job.done():
                    still.append((job, label, share))
                    continue
                free_gpus.extend(share)
                done += 1
                exc = job.exception()
                if exc is None:
                    echo(f"[launcher] {label}: finished ({done}/{len(cells)})")
                else:
                    message = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
                    failed.append(label)
                    log = str(job.paths.stderr)
                    first_log = first_log or log
                    echo(f"[launcher] {label}: failed ({message}); log {log}")
            running = still
    except BaseException:  # Ctrl-C, SIGTERM: do not leave orphaned jobs running
        for job, _, _ in running:
            job.cancel(check=False)
        raise
    if failed:
        raise TrainingError(
            f"{len(failed)} of {len(cells)} cells failed ({', '.join(failed)}); the first's log: {first_log}; "
            "rerun the same command to resubmit only the missing cells"
        )
