"""The worker processes that preprocess store entries, for ``jascl data prepare`` (:mod:`jascl.data.prepare`) and
for a run's fill of the store (:func:`jascl.data.prepare.fill_store`).

:func:`run_pool` builds and indexes a list of samples in a process pool whose workers come from a fork server
(:func:`worker_context`), with a short queue, a progress bar and the label index flushed as it grows. Ctrl-C is the
main process's alone: the workers ignore it, and the main process ends them at once (:func:`_end_workers`),
abandoning the samples in progress; their temporary folders are removed once the workers have ended. A worker that
dies (killed, out of memory) breaks the pool: one line names the samples it was preparing (:func:`died_message`).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import resource
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jascl.data.heap import keep_freed_memory
from jascl.data.real import DatasetSource, SampleStore
from jascl.data.real.sources import present_values, read_native_label
from jascl.data.real.store import open_entry, remove_abandoned
from jascl.distributed import usable_cores
from jascl.errors import ConfigError, DataError
from jascl.protocols.schema import Protocol


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


# --- in the workers ------------------------------------------------------------------------------------------

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


# --- in the main process --------------------------------------------------------------------------------------


def run_pool(
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
    read so far are kept. At the end, whatever ended the pool, the temporary entry folders of processes that no
    longer run are removed (:func:`~jascl.data.real.store.remove_abandoned`): the samples abandoned in progress,
    a dead worker's, and those of earlier processes that were killed.
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

    def submit() -> None:
        ref, build, sig = pending.pop()
        running[pool.submit(_prepare_one, ref, build, sig)] = ref

    try:
        with _interrupt_afterwards():  # the first submits start the workers (see _interrupt_afterwards)
            while pending and len(running) < workers:
                submit()
        while pending or running:
            while pending and len(running) < 2 * workers:  # a short queue: a dead worker takes little with it
                submit()
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
        remove_abandoned(cache)


@contextlib.contextmanager
def _interrupt_afterwards() -> Iterator[None]:
    """A Ctrl-C inside the block takes effect at its end, through the handler in force before (main thread only).

    Around the start of the workers: each is forked by the fork server, which answers only once it has imported
    torch and MONAI (seconds, the first time). A Ctrl-C that stopped the main process while it waited there would
    leave the worker the server then forks unknown to :func:`_end_workers`; alone, it would fail to start and print
    a traceback. Deferred, the Ctrl-C ends the pool with its workers, as anywhere else.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []

    def defer(signum: int, frame: object) -> None:
        if not caught:
            sys.stderr.write("\nCtrl-C: the worker processes are starting; they are ended once they have (seconds)\n")
        caught.append(signum)

    previous = signal.signal(signal.SIGINT, defer)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_DFL if previous is None else previous)
        if caught:
            signal.raise_signal(signal.SIGINT)


def _end_workers(pool: ProcessPoolExecutor, others: set) -> None:
    """Stop ``pool`` now: drop the samples not started and terminate its workers (every child process of this one
    but ``others``), whose samples in progress are abandoned (they ignore Ctrl-C, so nothing else ends them)."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None  # a second Ctrl-C (or `timeout`'s
    try:  # signal to the group after the one to the process) does not cut this short
        pool.shutdown(wait=False, cancel_futures=True)
        workers = [p for p in multiprocessing.active_children() if p not in others]
        for process in workers:
            process.terminate()
        for process in workers:
            process.join(10)
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


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

    The fork server is one per process: when this starts it, it ignores Ctrl-C (:mod:`jascl.data.fork_quiet`),
    and so do the processes it forks, for this process's other users of a fork server too (until they set a
    handler of their own, as ``jascl run`` does).
    """
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    modules = ["jascl.data.workers", "jascl.data.medical", "jascl.data.natural", "torch", "monai"]
    context.set_forkserver_preload(["jascl.data.fork_quiet", *modules])  # the server ignores Ctrl-C from its start
    return context
