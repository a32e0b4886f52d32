"""Compare grids and sweeps fanned out as jobs, through submitit (local processes or SLURM).

:func:`jascl.experiments.compare.run_compare` and :func:`jascl.experiments.sweep.run_sweep` with a
:class:`Launcher` run in four steps (:mod:`jascl.experiments.fanout`):

1. every run folder (a compare's seed, a sweep's point) is prepared here (run files, split manifest:
   ``run_benchmark(stage="files")``), which also says which shared session-0 bases are missing
   (:mod:`jascl.experiments.bases`: the vanilla base, and one per family of methods that change session 0 alike;
   a sweep's points link to the sweep's own);
2. every missing base becomes one job (``run_benchmark(stage="bases")``), submitted first;
3. every (method, folder) cell whose last session is not finished becomes one job
   (``run_benchmark(stage="cell")``) that trains that method's sessions into the folder, submitted
   once the bases its method starts from are complete (:func:`run_jobs`);
   at most ``parallel`` jobs run at a time (locally; on SLURM the scheduler decides, and
   ``parallel`` is the array's parallelism);
4. when every job has ended, the ordinary sequential compare (sweep) runs over the same folders: every
   session is reused, so the tables are written by the same code, from the same files, as without a launcher
   (identical numbers).

This process trains nothing: on SLURM it can run in a small job of its own while the bases, the largest
trainings of a grid, get the resources of a job like every cell. A job that fails leaves its finished sessions
and its last checkpoint; the error names it and its log, the cells whose base failed are not submitted, and
rerunning the command submits only what is still missing. A job that reaches its time limit stops at a step
with a checkpoint and is requeued from there (:class:`SessionsJob`). Job logs go to ``<out>/launcher/``
(submitit's folder). Options: ``parallel``, ``gpus``, ``time_min``, ``requeues``; for SLURM also ``partition``,
``gpus_per_job``, ``cpus_per_job``, ``mem_gb``, ``account``, ``qos``, ``constraint`` (see ``docs/distributed.md``).

``devices`` > 1 (``--devices N``) trains every base and every cell with N processes and DistributedDataParallel,
as ``jascl run --devices N`` does: the job has N tasks (submitit's ``tasks_per_node``), each task exports
the torch.distributed environment submitit describes (``submitit.helpers.TorchDistributedEnvironment``:
rank, world size, master address and port) and joins the process group through
:func:`jascl.distributed.init` (NCCL on GPUs, gloo on CPU). A local job's tasks meet through a file in the job
folder instead of submitit's port (which it derives from the job id, and which another process may hold: rank 0
then fails to listen and the other ranks wait for it until torch's timeout). Locally each job takes N GPUs of ``gpus``
(or runs N CPU processes when none are given); on SLURM it asks for N GPUs unless ``gpus_per_job`` says
otherwise.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from jascl.distributed import usable_cores
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
        requeues: how many times a job that reaches its time limit is requeued where it stopped
            (:class:`SessionsJob`; submitit's ``max_num_timeout``).
        partition, account, qos, constraint, gpus_per_job, cpus_per_job, mem_gb: SLURM resources
            (``gpus_per_job`` None: ``devices``; ``cpus_per_job`` per process).
        poll_s: seconds between checks of the running jobs.
    """

    kind: str = "local"
    parallel: int = 0
    gpus: tuple[int, ...] = ()
    devices: int = 1
    time_min: int = 24 * 60
    requeues: int = 3
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
        if (
            self.parallel < 0
            or self.time_min < 1
            or self.requeues < 0
            or (self.gpus_per_job or 0) < 0
            or self.cpus_per_job < 1
        ):
            raise ConfigError(
                "--launcher-opt: parallel >= 0, time_min >= 1, requeues >= 0, gpus_per_job >= 0, cpus_per_job >= 1"
            )
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

    def job_config(self, config: RunConfig, n_jobs: int) -> RunConfig:
        """The configuration each of ``n_jobs`` jobs trains with: locally, unless ``threads`` is set, this machine's
        cores shared between the processes that run at once (:meth:`slots` jobs of ``devices`` processes), as
        ``jascl run --devices N`` shares them between its ranks. Torch's default, every core for every process,
        made two jobs on a 2-core CPU 7x slower than one thread each (docs/distributed.md). SLURM: unchanged (a
        job's processes get ``cpus_per_job`` cores each)."""
        if self.kind != "local" or config.threads > 0:
            return config
        processes = min(self.slots, n_jobs) * self.devices
        return dataclasses.replace(config, threads=max(1, usable_cores() // processes))

    def check(self) -> None:
        """Refuse, before anything is prepared or written, a launcher that cannot submit here (SLURM off a SLURM
        node): the executor is made once in a temporary folder."""
        import tempfile

        with tempfile.TemporaryDirectory() as folder:
            self.executor(Path(folder))

    def executor(self, folder: Path) -> Any:
        """A submitit executor for this launcher, logging into ``folder``."""
        try:
            import submitit
        except ImportError:  # pragma: no cover - submitit is a dependency
            raise ConfigError("--launcher needs submitit: pip install submitit") from None
        if self.kind == "local":
            local = submitit.LocalExecutor(folder=str(folder), max_num_timeout=self.requeues)
            local.update_parameters(timeout_min=self.time_min, tasks_per_node=self.devices)
            return local
        try:
            ex = submitit.AutoExecutor(folder=str(folder), cluster="slurm", slurm_max_num_timeout=self.requeues)
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


_INT_KEYS = {"parallel", "time_min", "requeues", "gpus_per_job", "cpus_per_job", "mem_gb"}
_STR_KEYS = {"partition", "account", "qos", "constraint"}


def parse_launcher(kind: str | None, options: Sequence[str] = (), devices: int | None = None) -> Launcher | None:
    """``--launcher KIND``, ``--launcher-opt KEY=VALUE`` (repeatable) and ``--devices N`` as a :class:`Launcher`;
    None without one.

    Keys: ``parallel``, ``gpus`` (comma-separated ids, local), ``time_min``, ``requeues``, and for SLURM ``partition``,
    ``account``, ``qos``, ``constraint``, ``gpus_per_job``, ``cpus_per_job``, ``mem_gb``.
    """
    if kind is None:
        if options:
            raise ConfigError("--launcher-opt needs --launcher local or --launcher slurm")
        if devices is not None:
            raise ConfigError(
                f"--devices {devices} without --launcher: give --launcher local or slurm (N processes per job), "
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


def timeout_signal() -> int:
    """The signal submitit's jobs take as "the time limit is near" (its ``SUBMITIT_PREEMPT_SIGNAL``, USR2 by
    default): SLURM sends it ``signal_delay_s`` (90 s) before a job's limit, the local executor 30 s before."""
    return int(getattr(signal, "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2")))


class SessionsJob:
    """One job (each of its ``devices`` tasks): ``run_benchmark(stage=stage)`` into the prepared run folder, a
    cell (``stage="cell"``: one method's sessions) or a shared base (``stage="bases"``: the named base).

    Near its time limit the job is requeued where it stopped. submitit sends :func:`timeout_signal`; the job takes
    it as a stop request (:mod:`jascl.engine.stop`): the loop finishes its step, writes the session's checkpoint
    and stops. The job then hands the signal to the handler submitit installed, which calls :meth:`checkpoint` (a
    callable with that method is what submitit requeues after a timeout, ``submitit.helpers.Checkpointable``) and
    requeues the job, at most ``requeues`` times. The requeued job is the same call: ``run_benchmark`` resumes the
    session from its checkpoint, to the results of an uninterrupted job. Without this, a job at its limit died
    with "timed-out and not checkpointable", and its work since the last epoch's checkpoint was lost.
    With several processes the ranks stop together one step later (:class:`jascl.engine.stop.StopVote`).
    """

    def __call__(self, protocol: Protocol, config: RunConfig, methods: Sequence[str], folder: str,
                 kwargs: Mapping[str, Any], gpus: Sequence[int], devices: int, stage: str,
                 bases: Sequence[str] | None = None) -> str:  # fmt: skip
        """Train the job. ``gpus``: the local launcher's share of the GPUs (CUDA_VISIBLE_DEVICES; rank r takes the
        r-th)."""
        from jascl.engine.stop import REQUEST, Stopped

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
        limit = timeout_signal()
        submitits = signal.getsignal(limit)  # submitit's checkpoint-and-requeue handler (inside a job)
        try:
            with REQUEST.installed((signal.Signals(limit).name,)):
                self._train(protocol, config, methods, folder, {**kwargs, "stage": stage, "bases": bases}, devices)
        except Stopped as exc:
            if not callable(submitits):  # (not a submitit job)
                raise
            print(f"[launcher] {exc}; requeueing the job through submitit", file=sys.stderr, flush=True)
            submitits(limit, None)  # requeues and exits (rank 0); returns (the other ranks)
            raise
        return folder

    @staticmethod
    def _train(protocol: Protocol, config: RunConfig, methods: Sequence[str], folder: str,
               options: Mapping[str, Any], devices: int) -> None:  # fmt: skip
        from jascl.experiments.runner import run_benchmark

        options = {**options, "progress": False}
        if devices == 1:
            run_benchmark(protocol, config, list(methods), folder, **options)
            return
        from submitit import JobEnvironment
        from submitit.helpers import TorchDistributedEnvironment

        from jascl import distributed

        TorchDistributedEnvironment().export(set_cuda_visible_devices=False)  # RANK, WORLD_SIZE, MASTER_*, LOCAL_RANK
        job = JobEnvironment()
        meet = None  # on SLURM: MASTER_ADDR and MASTER_PORT, on the job's first node
        if job.cluster == "local":  # one machine: a file; submitit's port may be another process's (module docstring)
            meet = (job.paths.folder / f"{job.job_id}_rendezvous").resolve().as_uri()
        config = dataclasses.replace(config, device=distributed.init(config.device, meet))
        try:
            run_benchmark(protocol, config, list(methods), folder, **options)
        finally:
            distributed.shutdown()

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """What submitit requeues: the same call (``submitit.helpers.DelayedSubmission``); the run folder holds
        the state it resumes from."""
        from submitit.helpers import DelayedSubmission

        return DelayedSubmission(self, *args, **kwargs)


#: the callable every job runs
_job = SessionsJob()


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """One job of a launcher: what it trains (``stage`` "cell" or "bases", see :func:`_job`), its label, and the
    labels of the jobs it starts after (a cell after the base jobs of the bases its method starts from).
    ``config`` and ``options`` (``run_benchmark`` keywords), where given, replace the grid's for this job (a sweep's
    points differ in both)."""

    protocol: Protocol
    methods: tuple[str, ...]
    folder: Path
    stage: str
    label: str
    bases: tuple[str, ...] | None = None
    after: tuple[str, ...] = ()
    config: RunConfig | None = None
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def run_jobs(
    launcher: Launcher,
    jobs: Sequence[JobSpec],
    config: RunConfig,
    out: Path,
    kwargs: Mapping[str, Any],
    echo: Callable[[str], None] = print,
) -> tuple[list[tuple[JobSpec, str]], list[JobSpec]]:
    """Run every job, at most ``launcher.slots`` at once, each once the jobs it starts after have finished;
    wait for all. Returns the failed jobs with their logs (each also named in ``echo``'s lines) and the jobs not
    submitted because one they start after failed.

    Jobs are submitted in the order given among those ready. Ctrl-C or SIGTERM cancels the running jobs.
    """
    if not jobs:
        return [], []
    folder = out / "launcher"
    folder.mkdir(parents=True, exist_ok=True)
    executor = launcher.executor(folder)
    pending = list(jobs)
    running: list[tuple[Any, JobSpec, list[int]]] = []
    failed: list[tuple[JobSpec, str]] = []
    finished: set[str] = set()
    free_gpus = list(launcher.gpus) if launcher.kind == "local" else []  # SLURM: the scheduler assigns them
    n_bases = sum(spec.stage == "bases" for spec in jobs)
    what = f"{n_bases} base models and {len(jobs) - n_bases} cells" if n_bases else f"{len(jobs)} cells"
    job_config = launcher.job_config(config, len(jobs))
    threads = f", {job_config.threads} CPU threads per process" if job_config.threads != config.threads else ""
    threads += " (every core for a job that runs alone)" if threads and job_config.threads < usable_cores() else ""
    echo(f"[launcher] {what} as {launcher.kind} jobs, at most {min(launcher.slots, len(jobs))} at once{threads}")
    skipped: list[JobSpec] = []
    try:
        while True:
            lost = {spec.label for spec, _ in failed} | {spec.label for spec in skipped}
            drop = [spec for spec in pending if lost & set(spec.after)]
            while drop:  # what waits for a failed job, and what waits for that
                skipped += drop
                pending = [spec for spec in pending if spec not in drop]
                lost |= {spec.label for spec in drop}
                drop = [spec for spec in pending if lost & set(spec.after)]
            ready = [spec for spec in pending if set(spec.after) <= finished]
            if not ready and not running:
                break
            batch = ready[: max(0, launcher.slots - len(running))]
            # a job that starts alone runs alone to its end (only a job's end readies another): every core is its
            alone = not running and len(batch) == 1
            for spec in batch:
                pending.remove(spec)
                share = free_gpus[: launcher.devices]
                del free_gpus[: len(share)]
                own = launcher.job_config(spec.config or config, 1 if alone else len(jobs))
                job = executor.submit(
                    _job, spec.protocol, own, spec.methods, str(spec.folder), {**kwargs, **spec.options}, share,
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
                exc = job.exception()
                if exc is None:
                    finished.add(spec.label)
                    echo(f"[launcher] {spec.label}: finished ({len(finished) + len(failed)}/{len(jobs)})")
                else:
                    message = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
                    failed.append((spec, str(job.paths.stderr)))
                    echo(f"[launcher] {spec.label}: failed ({message}); log {job.paths.stderr}")
            running = still
    except BaseException:  # Ctrl-C, SIGTERM: do not leave orphaned jobs running
        for job, _, _ in running:
            job.cancel(check=False)
        raise
    return failed, skipped + pending  # (pending: waiting for a job that is not in the list)


def failure(failed: Sequence[tuple[JobSpec, str]], total: int, skipped: int = 0) -> TrainingError:
    """One line naming the failed jobs (of ``total``) and the log of the first; ``skipped``: the cells not
    submitted because a base model they start from failed."""
    labels = ", ".join(spec.label for spec, _ in failed)
    waiting = f"; {skipped} cells were not submitted, their base model missing" if skipped else ""
    return TrainingError(
        f"{len(failed)} of {total} jobs failed ({labels}); the first's log: {failed[0][1]}{waiting}; "
        "rerun the same command to resubmit only what is missing"
    )
