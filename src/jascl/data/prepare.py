"""``jascl data prepare``: preprocess every sample of a protocol's datasets into the store, in parallel.

The store (:mod:`jascl.data.real.store`) is what ``jascl run``, ``compare`` and ``reproduce`` read: with
the same cache folder (``--cache-dir``, else ``$JASCL_CACHE``, else ``~/.cache/jascl``) they find every
sample preprocessed and its labels indexed, and decode nothing. Without ``prepare`` a run preprocesses
each sample on first access, one after another.

For every dataset entry whose root is set, every record of the copy (training, test and label-free)
is decoded with its layout (the readers ``jascl data check`` and runs use), checked, preprocessed with
MONAI and written as a store entry, by ``workers`` processes. The labels' class index that a run's
K-shot selection reads (``<cache>/real/labels-*.json``) is filled on the way, so a run does not read
the label files again.

Resumable: an entry is written as a temporary folder renamed into place, so an interrupted
``prepare`` (Ctrl-C, a killed worker, a power cut) leaves complete entries and temporary folders only;
Ctrl-C is the main process's alone (the workers ignore it): it ends the workers at once, abandoning the
samples in progress, keeps the label index read so far, and says how many entries are complete;
the temporary folders of the abandoned samples are removed once the workers have ended (those of a
process killed outright stay until the next ``prepare``, which removes them), and the next ``prepare`` skips
the complete entries and builds the rest. A sample that cannot be read or preprocessed is one problem line
(naming its file and the fix); the others are prepared all the same.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

from jascl.data.real import DatasetSource, SampleStore, open_source, resolve_roots
from jascl.data.real.sources import PREPROCESS_VERSIONS
from jascl.data.real.store import open_entry, remove_abandoned, store_folder
from jascl.data.synthetic import default_cache_dir
from jascl.data.workers import PrepareReport, run_pool
from jascl.distributed import usable_cores
from jascl.errors import ConfigError, DataError
from jascl.protocols.schema import Protocol

#: memory a worker may need for one large CT (decoded int16 -> float32, resampling): the default number of
#: workers keeps (workers x this) within the machine's memory. Measured peak RSS for a 512 x 512 x 300 CT resampled
#: to 1.5 mm, of which 0.8 GiB is torch's and MONAI's libraries (``benchmarks/data_pipeline.py``,
#: docs/performance.md): 3.9 GiB with MONAI's float64 resampling, 1.8 GiB in float32, 2.1-2.5 GiB once a worker
#: kept its freed memory between volumes (:mod:`jascl.data.heap`), 1.3 GiB resampled axis by axis
#: (:mod:`jascl.data.resample`); the rest is headroom for larger CTs
WORKER_MEMORY_GIB = 3.0


def default_workers() -> int:
    """One worker per core, at most one per :data:`WORKER_MEMORY_GIB` of the machine's memory."""
    cpus = usable_cores()
    try:
        memory_gib = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (ValueError, OSError, AttributeError):
        return max(1, cpus)
    return max(1, min(cpus, int(memory_gib // WORKER_MEMORY_GIB)))


# --- the command -----------------------------------------------------------------------------------------------


def prepare_protocol(
    protocol: Protocol,
    roots: Mapping[str, str | Path] | None = None,
    roots_file: str | Path | None = None,
    cache_dir: str | Path | None = None,
    workers: int | None = None,
    echo: Callable[[str], None] = print,
    progress: bool | None = None,
    environ: Mapping[str, str] | None = None,
    remove_outdated: bool = False,
) -> PrepareReport:
    """Fill the store with every sample of ``protocol``'s datasets (see the module docstring).

    Args:
        roots: root name -> folder (``--root``); ``roots_file`` and ``environ`` (``JASCL_ROOT_<NAME>``) fill the
            rest, as for ``jascl run``.
        roots_file: a YAML file of root names to folders (``--roots``).
        environ: the environment to read ``JASCL_ROOT_<NAME>`` from (default ``os.environ``).
        cache_dir: the cache folder (default ``$JASCL_CACHE`` or ``~/.cache/jascl``).
        workers: worker processes (default :func:`default_workers`); each uses ``cores // workers`` threads.
        progress: show a progress bar (None: when the error stream is a terminal).
        remove_outdated: delete the store's entries of an earlier preprocessing version (:func:`outdated_entries`;
            by default they are counted in a note).

    Raises:
        ConfigError: a protocol without datasets, a detection protocol, ``workers < 1``, an unknown root name.
        DataError: a worker process died (killed, out of memory): the entries written so far are kept.
    """
    if not protocol.uses_datasets:
        raise ConfigError(
            f"{protocol.path}: a synthetic protocol has no datasets to prepare (its data is generated and cached "
            "by the run); give a protocol with a 'datasets' section (jascl protocols)"
        )
    if protocol.task == "detection":
        raise ConfigError(
            f"{protocol.path}: protocol {protocol.name} is a detection protocol, whose images are read as they "
            "are; nothing to prepare (jascl data check checks its copies)"
        )
    workers = default_workers() if workers is None else int(workers)
    if workers < 1:
        raise ConfigError(f"--workers {workers}: give at least 1 worker process")
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    report = PrepareReport(store=store_folder(cache))
    resolved = resolve_roots(protocol, roots, roots_file, environ, problems=report.problems)
    sources: dict[str, DatasetSource] = {}
    for name, spec in protocol.datasets.items():
        if spec.root in resolved:
            src = open_source(protocol, spec, resolved[spec.root], report.problems)
            if src is not None:
                sources[name] = src
    _remove_stale(cache, echo)
    _remove_outdated(cache, remove_outdated, echo)

    store = SampleStore(protocol, sources, cache)
    jobs: dict[Path, list] = {}  # entry folder -> [ref, build, label signature or None]
    for name, src in sources.items():
        wanted = dict(src.unindexed(cache, src.train_pool + src.test_pool))
        for rid in sorted(src.records):
            path = store.entry_path(f"{name}/{rid}")
            job = jobs.setdefault(path, [f"{name}/{rid}", True, None])
            if rid in wanted and job[2] is None:
                job[2] = wanted[rid]
    report.samples = len(jobs)
    todo = []
    for path, (ref, _, sig) in jobs.items():
        complete = open_entry(path) is not None
        report.complete += complete
        if not complete or sig is not None:
            todo.append((ref, not complete, sig))
    echo(
        f"[prepare] {report.samples} sample(s) in {len(sources)} dataset(s); {report.complete} already prepared, "
        f"{sum(b for _, b, _ in todo)} to preprocess with {workers} worker process(es) into {report.store}"
    )
    start = time.perf_counter()
    if todo:
        try:
            run_pool(protocol, sources, cache, todo, workers, report, progress)
        except KeyboardInterrupt:
            echo(
                f"[prepare] interrupted: {report.complete + report.built} of {report.samples} entries are complete "
                f"in {report.store}, and kept; run the same command again to resume"
            )
            raise
    report.seconds = time.perf_counter() - start
    return report


#: a run preprocesses its missing store entries in parallel (:func:`fill_store`) only from this many on, and when
#: their files hold at least :data:`FILL_MIN_BYTES`: starting a pool costs 4.3 s on a 2-core machine (the fork
#: server imports torch and MONAI), which 16 CTs of 512 x 512 x 300 (1.3 GiB of .nii.gz) repay twice over (144-155 s
#: -> 71-74 s) and 16 of 256 x 256 x 150 (0.16 GiB) do not (13 s either way; docs/performance.md); below either,
#: the run builds them on first access
FILL_MIN_ENTRIES = 16
FILL_MIN_BYTES = 256 * 2**20


def fill_store(
    store: SampleStore,
    refs: Sequence[str],
    workers: int = -1,
    echo: Callable[[str], None] = print,
    progress: bool | None = None,
    stop: Callable[[], bool] | None = None,
) -> PrepareReport:
    """Preprocess, in parallel, the store entries of ``refs`` that are missing: what a run does before it trains
    when ``jascl data prepare`` has not filled the store (``prepare_workers``), so that its first pass, which it
    would otherwise pay one sample after another on first access (the test splits in the main process, at
    evaluation), runs on every core.

    Nothing is done when fewer than :data:`FILL_MIN_ENTRIES` entries are missing, when their files hold less than
    :data:`FILL_MIN_BYTES`, or with one worker (``workers``: -1 for :func:`default_workers`); the run then builds
    them on first access as before. ``stop`` (a run's stop request) is asked twice a second: when it says yes, the
    workers are ended, the entries written are kept and the report is returned with ``stopped`` set (the run then
    stops before its first session).

    Raises:
        DataError: a sample that cannot be prepared (the first one's line and how many), after every other entry
            was written; or a worker process died. The entries written are kept either way.
    """
    workers = default_workers() if workers < 0 else workers
    report = PrepareReport(store=store_folder(store.cache_dir))
    missing: dict[Path, str] = {}
    for ref in refs:
        path = store.entry_path(ref)
        if path not in missing and open_entry(path) is None:
            missing[path] = ref
    report.samples = len(missing)
    if workers < 2 or len(missing) < FILL_MIN_ENTRIES or _file_bytes(store, missing.values()) < FILL_MIN_BYTES:
        return report
    echo(
        f"[data] preprocessing {len(missing)} sample(s) this run reads, with {workers} worker processes, into "
        f"{report.store} ('jascl data prepare' does this ahead of a run; --set prepare_workers=0 to build them on "
        "first access instead)"
    )
    start = time.perf_counter()
    run_pool(
        store.protocol,
        dict(store.sources),
        store.cache_dir,
        [(r, True, None) for r in missing.values()],
        workers,
        report,
        progress,
        stop,
    )
    report.seconds = time.perf_counter() - start
    if report.stopped:
        echo(
            f"[data] stopped after {report.built} of {len(missing)} sample(s) in {report.seconds:.0f} s; the entries "
            "written are kept"
        )
        return report
    echo(f"[data] {report.built} sample(s) preprocessed in {report.seconds:.0f} s")
    if report.problems:
        more = f" (and {len(report.problems) - 1} more)" if len(report.problems) > 1 else ""
        raise DataError(f"{report.problems[0]}{more}")
    return report


def _file_bytes(store: SampleStore, refs: Iterable[str]) -> int:
    """The size of the files the samples ``refs`` are read from (a folder's files counted one level down)."""
    total = 0
    for ref in refs:
        name, rid = ref.split("/", 1)
        for path in store.sources[name].records[rid].files:
            try:
                total += sum(p.stat().st_size for p in path.iterdir()) if path.is_dir() else path.stat().st_size
            except OSError:
                continue  # a missing file is the build's problem line, not this estimate's
    return total


def outdated_entries(cache: Path) -> list[Path]:
    """Store entries made by an earlier version of their kind's preprocessing, which no run reads any more.

    An entry records its version in ``made_from.preprocess_version``; entries written before that field existed
    are version 1 (their image has one more axis than its spatial dims: ``(C, X, Y, Z)`` for a volume).
    """
    found = []
    for info_file in sorted(store_folder(cache).glob("*/*/entry.json")):
        try:
            info = json.loads(info_file.read_text())
            dims = len(info["image_shape"]) - 1
            version = info.get("made_from", {}).get("preprocess_version", 1)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue  # damaged: open_entry removes it when a run asks for it
        if dims in PREPROCESS_VERSIONS and version != PREPROCESS_VERSIONS[dims]:
            found.append(info_file.parent)
    return found


def _remove_outdated(cache: Path, remove: bool, echo: Callable[[str], None]) -> None:
    entries = outdated_entries(cache)
    if not entries:
        return
    size = sum(f.stat().st_size for e in entries for f in e.iterdir() if f.is_file()) / 2**30
    if remove:
        for entry in entries:
            shutil.rmtree(entry, ignore_errors=True)
        echo(f"[prepare] removed {len(entries)} entr(y/ies) of an earlier preprocessing version ({size:.2f} GiB)")
    else:
        echo(
            f"[prepare] note: the store holds {len(entries)} entr(y/ies) ({size:.2f} GiB) made by an earlier "
            "version of the preprocessing, which this version no longer reads; add --remove-outdated to delete them"
        )


def _remove_stale(cache: Path, echo: Callable[[str], None]) -> None:
    """Remove temporary entry folders of killed processes; point at the cache format this version no longer reads."""
    stale = remove_abandoned(cache)
    if stale:
        echo(f"[prepare] removed {stale} unfinished entr(y/ies) of interrupted runs")
    old = cache / "real" / "samples"
    if old.is_dir():
        files = list(old.rglob("*.npz"))
        if files:
            size = sum(f.stat().st_size for f in files) / 2**20
            echo(
                f"[prepare] note: {old} holds {len(files)} preprocessed sample(s) ({size:.0f} MiB) in the cache "
                "format of earlier versions, which this version no longer reads; delete that folder to free the space"
            )
