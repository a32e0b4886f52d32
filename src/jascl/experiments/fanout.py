"""Grids of run folders fanned out as the jobs of a :class:`~jascl.experiments.launcher.Launcher`: a compare's
seeds (:func:`run_grid`) and a sweep's points (:func:`jascl.experiments.sweep.run_sweep`).

:func:`fan_out` makes one set of jobs of all the folders' work (:func:`jascl.experiments.launcher.run_jobs` runs
them): every folder is prepared in this process, every missing shared session-0 base is one job, trained once
even where several folders link to it (a sweep's points share its base), and every unfinished (method, folder)
cell is one job that starts when the bases its method starts from are complete. The caller then runs its
ordinary sequential pass over the same folders: everything is reused, and the tables come from the same code.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from jascl.engine.config import RunConfig
from jascl.experiments.launcher import JobSpec, Launcher, cell_finished, failure, run_jobs
from jascl.protocols.schema import Protocol


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One run folder a launcher fills (:func:`fan_out`): ``methods`` trained into ``folder`` under ``config``.

    Attributes:
        label: names the folder's jobs (``"<base> <label>"``, ``"<method> <label>"``), e.g. ``seed 3``.
        options: this folder's ``run_benchmark`` keywords over the grid's (e.g. a sweep point's ``split_manifest``).
        borrows: shared bases linked into the folder from elsewhere, base name -> the base folder (another
            folder's, trained by its job; the folder's cells start after that job).
        bases_only: only the folder's shared bases are trained, and no run files written (a sweep's bases, which
            every point borrows).
    """

    protocol: Protocol
    config: RunConfig
    methods: tuple[str, ...]
    folder: Path
    label: str
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    borrows: Mapping[str, Path] = dataclasses.field(default_factory=dict)
    bases_only: bool = False


def share_base(source: Path, link: Path) -> None:
    """Point ``link`` at the finished base model ``source`` (a relative symlink, else a copy): how a run folder
    without a launcher takes a base trained in another folder (a sweep's, an earlier row's of a reproduction)."""
    if link.exists() or link.is_symlink() or not (source / "metrics.json").exists():
        return
    link.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.symlink(os.path.relpath(source, link.parent), link)
    except OSError:  # file systems without symlinks
        shutil.copytree(source, link)


def _borrow(source: Path, link: Path) -> bool:
    """Point ``link`` at the base folder ``source`` (a relative symlink; ``source`` is created, empty, when its job
    has not run yet). False where the file system has no symlinks: the folder then trains a base of its own."""
    if link.is_symlink() or link.exists():  # linked before (or a copy a pass without a launcher made)
        return True
    source.mkdir(parents=True, exist_ok=True)
    link.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.symlink(os.path.relpath(source, link.parent), link)
    except OSError:
        return False
    return True


def fan_out(
    launcher: Launcher,
    specs: Sequence[RunSpec],
    out: Path,
    kwargs: Mapping[str, Any],
    progress: bool = True,
    echo: Callable[[str], None] = print,
) -> None:
    """Steps 1 to 3 of the module docstring for the run folders ``specs``, all as one set of jobs: each folder is
    prepared here (``run_benchmark(stage="files")``), each missing shared base becomes one job (a base reached
    through several folders' links, once), and each unfinished (method, folder) cell a job that starts when the
    bases its method starts from are complete. ``out``: the grid's folder (job logs in ``<out>/launcher/``);
    ``kwargs``: the ``run_benchmark`` keywords of every folder.

    Raises:
        TrainingError: one line naming the failed jobs and the first's log; everything finished stays.
    """
    from jascl.experiments.bases import missing_bases
    from jascl.experiments.runner import run_benchmark
    from jascl.methods.registry import create_method

    launcher.check()
    trained_by: dict[Path, str] = {}  # a base folder (links resolved) -> the label of the job that trains it
    bases: list[JobSpec] = []
    cells: list[JobSpec] = []
    for spec in specs:
        options = {**kwargs, **spec.options}
        for name, source in spec.borrows.items():
            if not _borrow(source, spec.folder / name):
                echo(f"[launcher] {spec.label}: no symbolic links in {spec.folder}; it trains its own {name}")
        if spec.bases_only:
            built = [create_method(m, spec.config, spec.protocol.task) for m in spec.methods]
            missing = missing_bases(spec.folder, built)
        else:
            echo(f"[launcher] {spec.label}: preparing the run folder")
            missing = run_benchmark(
                spec.protocol, spec.config, spec.methods, spec.folder, progress=progress, echo=echo, stage="files",
                **options,
            )["bases"]  # fmt: skip
        after: dict[str, list[str]] = {}  # method -> the labels of the base jobs it waits for
        for name, members in missing.items():
            where = (spec.folder / name).resolve()
            if where not in trained_by:
                trained_by[where] = f"{name} {spec.label}"
                job = JobSpec(spec.protocol, spec.methods, spec.folder, "bases", trained_by[where], (name,))
                bases.append(dataclasses.replace(job, config=spec.config, options=spec.options))
            for m in members:
                after.setdefault(m, []).append(trained_by[where])
        if spec.bases_only:
            continue
        for m in spec.methods:
            if not cell_finished(spec.folder, m, spec.protocol):
                job = JobSpec(
                    spec.protocol, (m,), spec.folder, "cell", f"{m} {spec.label}", after=tuple(after.get(m, ()))
                )
                cells.append(dataclasses.replace(job, config=spec.config, options=spec.options))
    config = specs[0].config if specs else RunConfig()
    failed, skipped = run_jobs(launcher, bases + cells, config, out, kwargs, echo)
    if failed:
        raise failure(failed, len(bases) + len(cells), len(skipped))


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
    """:func:`fan_out` for a compare grid: one run folder per seed, ``<out>/seed-<s>`` (a cell starts when its own
    seed's bases are complete; other seeds' bases may still be training).

    ``kwargs``: :func:`jascl.experiments.runner.run_benchmark`'s keywords (``cache_dir``, data options, imports).

    Raises:
        TrainingError: one line naming the failed jobs and the first's log; everything finished stays.
    """
    specs = [
        RunSpec(dataclasses.replace(protocol, seed=seed), config, tuple(methods), out / f"seed-{seed}", f"seed {seed}")
        for seed in seeds
    ]
    fan_out(launcher, specs, out, kwargs, progress, echo)
