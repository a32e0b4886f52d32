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
the next ``prepare`` skips the complete ones, removes the temporary folders of processes that no
longer run, and builds the rest. A sample that cannot be read or preprocessed is one problem line
(naming its file and the fix); the others are prepared all the same.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import resource
import shutil
import signal
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jascl.data.heap import keep_freed_memory
from jascl.data.real import DatasetSource, SampleStore, open_source, resolve_roots
from jascl.data.real.sources import PREPROCESS_VERSIONS, present_values, read_native_label
from jascl.data.real.store import open_entry, store_folder
from jascl.data.synthetic import default_cache_dir
from jascl.distributed import usable_cores
from jascl.errors import ConfigError, DataError
from jascl.fileio import stale_temporary_dirs
from jascl.protocols.schema import Protocol

#: memory a worker may need for one large CT (decoded int16 -> float32, resampling): the default number of
#: workers keeps (workers x this) within the machine's memory. Measured peak RSS for a 512 x 512 x 300 CT resampled
#: to 1.5 mm, of which 0.8 GiB is torch's and MONAI's libraries (``benchmarks/data_pipeline.py``,
#: docs/performance.md): 3.9 GiB with MONAI's float64 resampling, 1.8 GiB in float32, 2.1-2.5 GiB once a worker
#: kept its freed memory between volumes (:mod:`jascl.data.heap`), 1.3 GiB resampled axis by axis
#: (:mod:`jascl.data.resample`); the rest is headroom for larger CTs
WORKER_MEMORY_GIB = 3.0


@dataclass
class PrepareReport:
    """Outcome of :func:`prepare_protocol`.

    Attributes:
        samples: distinct store entries the protocol's datasets need.
        complete: of those, found complete (skipped).
        built: written by this call.
        indexed: label files whose classes were indexed by this call.
        problems: one line per sample that could not be prepared (or root not set).
        seconds: wall time of the preprocessing.
        worker_peak_rss_mib: the largest peak resident memory of a worker process.
        store: the store's folder.
        stopped: whether the preprocessing was stopped (``stop``) before every sample was done.
    """

    samples: int = 0
    complete: int = 0
    built: int = 0
    indexed: int = 0
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0
    worker_peak_rss_mib: float = 0.0
    store: Path | None = None
    stopped: bool = False


def default_workers() -> int:
    """One worker per core, at most one per :data:`WORKER_MEMORY_GIB` of the machine's memory."""
    cpus = usable_cores()
    try:
        memory_gib = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (ValueError, OSError, AttributeError):
        return max(1, cpus)
    return max(1, min(cpus, int(memory_gib // WORKER_MEMORY_GIB)))


# --- worker processes ------------------------------------------------------------------------------------------

_STORE: SampleStore | None = None


def _start_worker(protocol: Protocol, sources: Mapping[str, DatasetSource], cache: Path, threads: int) -> None:
    global _STORE
    import torch

    torch.set_num_threads(threads)  # the workers share the cores
    # a terminal's Ctrl-C reaches the whole process group: the main process alone acts on it (_run_pool ends the
    # workers); otherwise each worker would print a traceback, and in a run the first Ctrl-C, a stop request,
    # would come back from the workers as an abort
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    keep_freed_memory()  # the next volume reuses this one's pages (1.6 x faster per volume; jascl.data.heap)
    _STORE = SampleStore(protocol, sources, cache)


def _prepare_one(ref: str, build: bool, index_sig: str | None) -> tuple[str, bool, Any, str | None, float]:
    """Build the entry of ``ref`` (if ``build``) and read its label's classes (if ``index_sig``).

    Returns:
        (ref, built, (signature, native ids present) or None, problem line or None, peak RSS in MiB).
    """
    assert _STORE is not None, "the pool's initializer sets the store"
    store = _STORE
    presence = None
    built = False
    try:
        sample = None
        if build and open_entry(store.entry_path(ref)) is None:
            _, sample = store.build(ref)
            built = True
        if index_sig is not None:
            name, rid = ref.split("/", 1)
            source, record = store.sources[name], store.sources[name].records[rid]
            # a layout's read_label returns its read()'s label (read_native_label); decode_label may not
            same = not hasattr(source.layout, "decode_label")
            if sample is not None and same and sample.label is not None:
                label = sample.label  # what read_native_label would decode again
            else:
                label = read_native_label(source.layout, record)
            presence = (index_sig, present_values(label))
        problem = None
    except (DataError, ConfigError) as exc:
        problem = str(exc)
    except MemoryError:
        problem = f"{ref}: out of memory while preprocessing it; run again with fewer --workers"
    return ref, built, presence, problem, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


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
            _run_pool(protocol, sources, cache, todo, workers, report, progress)
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
    _run_pool(
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


def _run_pool(
    protocol: Protocol,
    sources: dict[str, DatasetSource],
    cache: Path,
    todo: list[tuple[str, bool, str | None]],
    workers: int,
    report: PrepareReport,
    progress: bool | None,
    stop: Callable[[], bool] | None = None,
) -> None:
    """Build and index ``todo`` in ``workers`` processes, filling ``report``.

    ``stop`` is asked about twice a second (a run passes its stop request: Ctrl-C, SIGTERM): when it says yes,
    the workers are ended and ``report.stopped`` is set. A ``KeyboardInterrupt`` (Ctrl-C where nothing handles
    it) ends them the same way and is raised again. Either way the entries complete so far and the label index
    read so far are kept; the samples in progress leave temporary folders, which the next ``prepare`` removes.
    """
    from tqdm import tqdm

    cpus = usable_cores()
    threads = max(1, cpus // workers)
    found: dict[str, dict[str, tuple[str, list[int]]]] = {}

    def flush() -> None:
        for name, values in found.items():
            if values:
                sources[name].add_index(cache, values)
        found.clear()

    bar = tqdm(total=len(todo), unit="sample", desc="prepare", disable=None if progress is None else not progress)
    pending = list(reversed(todo))
    running: dict[Any, str] = {}
    finished = False  # whether a worker has returned a sample
    ended = False  # whether _end_workers ended the pool
    others = set(multiprocessing.active_children())  # processes that are not the pool's workers
    pool = ProcessPoolExecutor(
        workers, mp_context=worker_context(), initializer=_start_worker, initargs=(protocol, sources, cache, threads)
    )
    try:
        while pending or running:
            while pending and len(running) < 2 * workers:  # a short queue: a dead worker takes little with it
                ref, build, sig = pending.pop()
                running[pool.submit(_prepare_one, ref, build, sig)] = ref
            done, _ = wait(running, timeout=None if stop is None else 0.5, return_when=FIRST_COMPLETED)
            for future in done:
                ref, built, presence, problem, rss = future.result()  # raises while the ref is running
                running.pop(future)
                finished = True
                report.built += built
                report.worker_peak_rss_mib = max(report.worker_peak_rss_mib, rss)
                if problem is not None:
                    report.problems.append(problem)
                if presence is not None:
                    found.setdefault(ref.split("/", 1)[0], {})[ref.split("/", 1)[1]] = presence
                    report.indexed += 1
                bar.update(1)
            if sum(len(v) for v in found.values()) >= 200:
                flush()
            if stop is not None and stop() and (pending or running):
                report.stopped = ended = True
                _end_workers(pool, others)
                return
    except BrokenProcessPool:
        raise DataError(died_message(sorted(running.values()), report.complete + report.built, finished)) from None
    except KeyboardInterrupt:
        ended = True
        _end_workers(pool, others)
        raise
    finally:
        if not ended:
            pool.shutdown(wait=True)
        flush()
        bar.close()


def _end_workers(pool: ProcessPoolExecutor, others: set) -> None:
    """Stop ``pool`` now: drop the samples not started and terminate its workers (every child process of this one
    but ``others``), whose samples in progress are abandoned (they ignore Ctrl-C, so nothing else ends them)."""
    pool.shutdown(wait=False, cancel_futures=True)
    workers = [p for p in multiprocessing.active_children() if p not in others]
    for process in workers:
        process.terminate()
    for process in workers:
        process.join(10)


def died_message(preparing: Sequence[str], complete: int, finished: bool) -> str:
    """The error line when the pool broke: a worker died while ``preparing`` these samples, ``complete`` entries
    are in the store, ``finished``: whether any worker had returned a sample before.

    A pool that breaks before any worker returns has a second usual cause besides memory: a Python script that
    calls jascl (``prepare_protocol``, or a run that fills the store) at its top level. The fork server the
    workers come from (:func:`worker_context`) imports the script as its main module, which calls jascl again and
    tries to start a pool of its own; Python stops it there (its message, printed above ours, says "An attempt has
    been made to start a new process before the current process has finished its bootstrapping phase"), and no
    worker starts.
    """
    line = f"a worker process died (killed, or out of memory) while preparing {', '.join(preparing)}"
    if not finished:
        line += (
            ", before any worker finished a sample; from a Python script that calls jascl at its top level, the "
            "workers re-import the script: put the call under 'if __name__ == \"__main__\":'"
        )
    return (
        f"{line}; the {complete} complete entries are kept: run the same command again to resume "
        "(with fewer --workers if memory ran out)"
    )


def worker_context() -> multiprocessing.context.BaseContext:
    """Where workers come from: a fork server that has imported what they need (started once per process).

    Not plain fork: a worker forked from a process whose OpenMP threads have run (torch's intra-op pool,
    e.g. after the caller preprocessed something) can hang in its first parallel region. The fork server
    has imported torch and MONAI but run nothing, so each worker starts in well under a second, where a
    spawned one would import them again (seconds). Spawn where there is no fork server (Windows).
    """
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["jascl.data.prepare", "jascl.data.medical", "jascl.data.natural", "torch", "monai"])
    return context


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
    store = store_folder(cache)
    stale = [p for folder in (store.glob("*") if store.is_dir() else []) for p in stale_temporary_dirs(folder)]
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    if stale:
        echo(f"[prepare] removed {len(stale)} unfinished entr(y/ies) of interrupted runs")
    old = cache / "real" / "samples"
    if old.is_dir():
        files = list(old.rglob("*.npz"))
        if files:
            size = sum(f.stat().st_size for f in files) / 2**20
            echo(
                f"[prepare] note: {old} holds {len(files)} preprocessed sample(s) ({size:.0f} MiB) in the cache "
                "format of earlier versions, which this version no longer reads; delete that folder to free the space"
            )
