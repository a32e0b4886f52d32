"""A run on datasets preprocesses the samples it reads in parallel before it trains, when the store lacks them
(``prepare_workers``, :func:`jascl.data.prepare.fill_store`; issue 33): the same entries the first access would
write, nothing below the threshold or with ``prepare_workers=0``, and a sample that cannot be prepared stops the
run with its one line after the others were written. Ctrl-C and a run's stop request end the workers at once and
keep what they wrote."""

import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fixtures import medical as fxm  # noqa: E402
from jascl.data import prepare, workers  # noqa: E402
from jascl.data.layouts import LAYOUTS  # noqa: E402
from jascl.data.layouts.msd import MSDLayout  # noqa: E402
from jascl.data.real import open_sources, resolve_roots  # noqa: E402
from jascl.data.real.storage import SampleStore  # noqa: E402
from jascl.data.real.store import open_entry  # noqa: E402
from jascl.data.sessions import load_sessions  # noqa: E402
from jascl.engine.config import resolve_config  # noqa: E402
from jascl.errors import ConfigError, DataError  # noqa: E402
from jascl.protocols import parse_protocol  # noqa: E402

SPEC = fxm.store_protocol_dict("fill")


@pytest.fixture
def copy(tmp_path):
    root = fxm.write_msd(tmp_path / "ct", cases=4, shape=(20, 18, 16), labels=(1, 2), test_cases=1)
    return parse_protocol(SPEC, "fill.yaml"), {"ct": root}


def _read_refs(data) -> list[str]:
    """Every sample id the sessions read (train, test, unlabelled)."""
    refs = set()
    for d in data:
        for split in (d.train, d.test, d.unlabelled):
            refs |= set(split.ids) if split is not None else set()
    return sorted(refs)


def _entries(cache: Path) -> list[Path]:
    return sorted((cache / "real" / "store").glob("*/*/entry.json"))


def test_a_run_preprocesses_what_it_reads_in_parallel_and_the_entries_equal_first_access(
    copy, tmp_path, monkeypatch, capsys
):
    protocol, roots = copy
    monkeypatch.setattr(prepare, "FILL_MIN_ENTRIES", 2)
    monkeypatch.setattr(prepare, "FILL_MIN_BYTES", 0)
    said: list[str] = []
    data = load_sessions(protocol, tmp_path / "filled", said.append, roots, prepare_workers=2, progress=False)
    assert "prepare" not in capsys.readouterr().err  # the run's --no-progress reaches the fill's bar
    refs = _read_refs(data)
    assert refs == [f"ct/case_00{i}" for i in range(4)]  # trained on or tested; the imagesTs case is in no split
    assert f"[data] preprocessing {len(refs)} sample(s) this run reads, with 2 worker processes" in said[-2]
    assert said[-1].startswith(f"[data] {len(refs)} sample(s) preprocessed in ")
    assert len(_entries(tmp_path / "filled")) == len(refs)

    # the same entries, to the bit, as a run that builds each on first access
    lazy = load_sessions(protocol, tmp_path / "lazy", lambda *a: None, roots, prepare_workers=0)
    assert _entries(tmp_path / "lazy") == []
    for d_filled, d_lazy in zip(data, lazy):
        for i in range(len(d_lazy.test)):
            assert np.array_equal(d_filled.test.images[i], d_lazy.test.images[i])
            assert np.array_equal(d_filled.test.labels[i], d_lazy.test.labels[i])
    assert len(_entries(tmp_path / "lazy")) == len({r for d in lazy for r in d.test.ids})

    load_sessions(protocol, tmp_path / "barred", lambda *a: None, roots, prepare_workers=2, progress=True)
    assert "prepare: 100%" in capsys.readouterr().err and len(_entries(tmp_path / "barred")) == len(refs)


def test_below_the_threshold_or_with_zero_workers_nothing_is_built_ahead(copy, tmp_path):
    protocol, roots = copy
    assert (prepare.FILL_MIN_ENTRIES, prepare.FILL_MIN_BYTES) == (16, 256 * 2**20)
    said: list[str] = []
    load_sessions(protocol, tmp_path / "cache", said.append, roots, prepare_workers=2)  # 5 missing < 16
    assert _entries(tmp_path / "cache") == [] and not [m for m in said if "preprocessing" in m]
    sources = open_sources(protocol, resolve_roots(protocol, roots), tmp_path / "cache", lambda *a: None)
    store = SampleStore(protocol, sources, tmp_path / "cache")
    refs = [f"ct/case_00{i}" for i in range(4)]
    assert prepare.fill_store(store, refs, workers=1, echo=said.append).built == 0  # one worker: first access
    report = prepare.fill_store(store, refs + refs, workers=2, echo=said.append)
    assert (report.samples, report.built) == (4, 0) and _entries(tmp_path / "cache") == []
    # enough samples but too few bytes: the files of the four cases, one byte short of the bar
    files = [f for r in refs for f in sources["ct"].records[r.split("/")[1]].files]
    assert prepare._file_bytes(store, refs) == sum(f.stat().st_size for f in files)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(prepare, "FILL_MIN_ENTRIES", 2)
        mp.setattr(prepare, "FILL_MIN_BYTES", prepare._file_bytes(store, refs) + 1)
        assert prepare.fill_store(store, refs, workers=2, echo=said.append).built == 0
    assert _entries(tmp_path / "cache") == [] and not [m for m in said if "preprocessing" in m]


def test_a_sample_that_cannot_be_prepared_stops_the_run_after_the_others(copy, tmp_path, monkeypatch):
    protocol, roots = copy
    monkeypatch.setattr(prepare, "FILL_MIN_ENTRIES", 2)
    monkeypatch.setattr(prepare, "FILL_MIN_BYTES", 0)
    bad = fxm.rewrite_volume(roots["ct"] / "imagesTr" / "case_002_0000.nii.gz", lambda d: d * np.nan, np.float32)
    sources = open_sources(protocol, resolve_roots(protocol, roots), tmp_path / "cache", lambda *a: None)
    store = SampleStore(protocol, sources, tmp_path / "cache")
    refs = [f"ct/case_00{i}" for i in range(4)]
    with pytest.raises(
        DataError, match=rf"^{bad}: image holds 5760 non-finite value\(s\) \(NaN or \+-inf\) out of 5760; "
    ) as error:
        prepare.fill_store(store, refs, workers=2, echo=lambda *a: None)
    assert "\n" not in str(error.value)
    assert [open_entry(store.entry_path(r)) is not None for r in refs] == [True, True, False, True]


def test_prepare_workers_is_a_run_key_that_does_not_change_results():
    from jascl.experiments.runner import _NEUTRAL_KEYS

    assert resolve_config().prepare_workers == -1
    assert resolve_config(overrides=["prepare_workers=0"]).prepare_workers == 0
    with pytest.raises(ConfigError, match="prepare_workers"):
        resolve_config(overrides=["prepare_workers=-2"])
    assert "prepare_workers" in _NEUTRAL_KEYS


@pytest.mark.parametrize("cases, hint", [(15, False), (16, True)])
def test_the_label_index_line_points_to_prepare_from_16_files(tmp_path, cases, hint):
    root = fxm.write_msd(tmp_path / "ct", cases=cases, shape=(8, 8, 8), labels=(1, 2), test_cases=0)
    said: list[str] = []
    open_sources(parse_protocol(SPEC, "fill.yaml"), {"ct": root}, tmp_path / "cache", said.append)
    (line,) = [m for m in said if "label file(s) to index" in m]
    assert line.startswith(f"[data] ct: reading {cases} label file(s) to index their classes (cached afterwards)")
    assert line.endswith("; 'jascl data prepare' reads them in parallel, ahead of a run") is hint


@pytest.mark.parametrize(
    "layout, write",
    [
        ("msd", lambda root: fxm.write_msd(root, cases=2, test_cases=1)),
        ("msd", lambda root: fxm.write_msd(root, cases=2, test_cases=0, channels=2, style="msd")),
        ("brats", lambda root: fxm.write_brats(root, subjects=2)),
    ],
    ids=["msd", "msd-4d", "brats"],
)
def test_the_label_index_reads_the_label_without_the_image(tmp_path, monkeypatch, layout, write):
    """``read_label`` returns what ``read`` gives as the label; the index (``read_native_label``) then decodes no
    image: 0.3 s instead of 2.2 s per 512 x 512 x 300 CT (docs/performance.md)."""
    from jascl.data import medical
    from jascl.data.layouts import LAYOUTS
    from jascl.data.real.sources import read_native_label

    reader = LAYOUTS.create(layout, root=write(tmp_path / "d"))
    records = reader.scan()
    labelled = [r for r in records if r.label is not None]
    expected = [reader.read(r).label for r in labelled]
    monkeypatch.setattr(medical, "load_volume", lambda *a: pytest.fail("an image was decoded for the label index"))
    for record, label in zip(labelled, expected):
        got = read_native_label(reader, record)
        assert got.dtype == label.dtype and np.array_equal(got, label)
    for record in (r for r in records if r.label is None):
        with pytest.raises(DataError, match="the layout read no label for this sample"):
            reader.read_label(record)


def test_a_pool_that_broke_after_a_sample_names_memory_and_the_samples_it_was_preparing():
    line = workers.died_message(["ct/case_002", "ct/case_003"], 2, finished=True)
    assert line == (
        "a worker process died (killed, or out of memory) while preparing ct/case_002, ct/case_003; the 2 complete "
        "entries are kept: run the same command again to resume (with fewer --workers if memory ran out)"
    )


def test_a_pool_that_broke_before_any_sample_also_names_an_unguarded_script():
    line = workers.died_message(["ct/case_000"], 0, finished=False)
    assert line.startswith(
        "a worker process died (killed, or out of memory) while preparing ct/case_000, before any worker finished a "
        "sample; from a Python script that calls jascl at its top level, the workers re-import the script: put the "
        """call under 'if __name__ == "__main__":'; the 0 complete entries are kept"""
    )


# --------------------------------------------------------------------------------------------- stopping


class SlowMSD(MSDLayout):
    """The msd layout, except that reading ``case_002`` or ``case_003`` waits (up to a minute) while ``<root>/SLOW``
    exists: the pool is stopped while two workers are inside those samples."""

    name = "msd-slow-test"

    def read(self, record):
        deadline = time.monotonic() + 60
        while record.id in ("case_002", "case_003") and (self.root / "SLOW").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return super().read(record)


if "msd-slow-test" not in LAYOUTS:
    LAYOUTS.register("msd-slow-test")(SlowMSD)


@pytest.fixture
def slow(copy):
    protocol, roots = copy
    spec = {**SPEC, "datasets": {"ct": {**SPEC["datasets"]["ct"], "layout": "msd-slow-test"}}}
    (roots["ct"] / "SLOW").touch()
    yield parse_protocol(spec, "fill.yaml"), roots
    (roots["ct"] / "SLOW").unlink(missing_ok=True)  # lets a worker left behind by a failure finish


def _store(protocol, roots, cache: Path) -> SampleStore:
    return SampleStore(protocol, open_sources(protocol, resolve_roots(protocol, roots), cache, lambda *a: None), cache)


def _workers(others: set) -> list:
    """The child processes of this one but ``others`` (those an earlier test in this process may have left)."""
    return [p for p in multiprocessing.active_children() if p not in others]


def _complete(store, refs) -> list[bool]:
    return [open_entry(store.entry_path(r)) is not None for r in refs]


def test_a_stop_request_ends_the_fill_at_once_and_keeps_what_was_written(slow, tmp_path, monkeypatch):
    protocol, roots = slow
    others = set(multiprocessing.active_children())
    monkeypatch.setattr(prepare, "FILL_MIN_ENTRIES", 2)
    monkeypatch.setattr(prepare, "FILL_MIN_BYTES", 0)
    store = _store(protocol, roots, tmp_path / "cache")
    refs = [f"ct/case_00{i}" for i in range(4)]
    said: list[str] = []
    # one worker per sample: case_000 and case_001 are written, case_002 and case_003 wait; then the stop, at the
    # second question after the two entries are on disk (their results reach the main process just after)
    written: list[bool] = []

    def stop() -> bool:
        written.append(all(_complete(store, refs[:2])))
        return written[-2:] == [True, True]

    # temporary entry folders: one of a process that has ended (killed while it wrote), one of this live process
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    folder = tmp_path / "cache" / "real" / "store" / "ab"
    folder.mkdir(parents=True)
    host = socket.gethostname()
    dead, live = folder / f".ab1.tmp-{host}-{int(ended.stdout)}-x", folder / f".ab2.tmp-{host}-{os.getpid()}-x"
    dead.mkdir()
    live.mkdir()
    report = prepare.fill_store(store, refs, 2, said.append, False, stop=stop)
    assert report.stopped and (report.samples, report.built) == (4, 2)
    assert (dead.exists(), live.exists()) == (False, True)  # the ended process's is removed once the pool has ended
    assert _complete(store, refs) == [True, True, False, False]  # the waiting samples were abandoned, not finished
    assert _workers(others) == []  # the workers were ended
    assert said[-1].startswith("[data] stopped after 2 of 4 sample(s) in ") and said[-1].endswith(
        "; the entries written are kept"
    )
    (roots["ct"] / "SLOW").unlink()
    report = prepare.fill_store(store, refs, 2, said.append, False, stop=lambda: False)
    assert not report.stopped and (report.samples, report.built) == (2, 2) and all(_complete(store, refs))


def test_ctrl_c_ends_prepare_at_once_workers_ignore_it_and_prepare_resumes(slow, tmp_path):
    """A terminal's Ctrl-C reaches the main process and every worker: the workers go on (they ignore it), the main
    process ends them and says what is kept, and the next prepare builds the rest."""
    protocol, roots = slow
    others = set(multiprocessing.active_children())
    cache = tmp_path / "cache"
    entries = _store(protocol, roots, cache)
    refs = [f"ct/case_00{i}" for i in range(4)]
    alive: list[bool] = []

    def ctrl_c() -> None:
        while not all(_complete(entries, refs[:2])):
            time.sleep(0.05)
        time.sleep(0.5)  # their results reach the main process
        children = _workers(others)
        for process in children:
            os.kill(process.pid, signal.SIGINT)
        time.sleep(0.5)
        alive.extend(p.is_alive() for p in children)
        if not said[-1].startswith("[prepare] interrupted"):  # (a worker's KeyboardInterrupt would have ended it)
            alive.append("main")
            os.kill(os.getpid(), signal.SIGINT)

    said: list[str] = []
    thread = threading.Thread(target=ctrl_c, daemon=True)
    # Python's own handler, also where this process was started with SIGINT ignored (a background job of a script)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        thread.start()
        with pytest.raises(KeyboardInterrupt):
            prepare.prepare_protocol(protocol, roots, cache_dir=cache, workers=2, echo=said.append, progress=False)
        thread.join()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert alive == [True, True, "main"]  # the workers ignored their Ctrl-C; the main process's ended prepare
    assert _workers(others) == []
    assert said[-1] == (
        f"[prepare] interrupted: 2 of 5 entries are complete in {cache / 'real' / 'store'}, and kept; run the same "
        "command again to resume"
    )
    assert _complete(entries, refs) == [True, True, False, False]
    (roots["ct"] / "SLOW").unlink()
    report = prepare.prepare_protocol(protocol, roots, cache_dir=cache, workers=2, echo=said.append, progress=False)
    assert (report.complete, report.built, report.problems) == (2, 3, [])


def test_a_run_asked_to_stop_while_it_fills_the_store_stops_before_its_first_session(
    slow, tmp_path, monkeypatch, capsys
):
    import yaml

    from jascl.cli import main
    from jascl.engine.stop import REQUEST

    protocol, roots = slow
    others = set(multiprocessing.active_children())
    monkeypatch.setattr(prepare, "FILL_MIN_ENTRIES", 2)
    monkeypatch.setattr(prepare, "FILL_MIN_BYTES", 0)
    path = tmp_path / "fill.yaml"
    path.write_text(yaml.safe_dump({**SPEC, "datasets": {"ct": {**SPEC["datasets"]["ct"], "layout": "msd-slow-test"}}}))
    cache, out = tmp_path / "cache", tmp_path / "run"
    entries = _store(protocol, roots, cache)
    refs = [f"ct/case_00{i}" for i in range(4)]

    returned = threading.Event()

    def stop_request() -> None:  # what the run's handler records on Ctrl-C or SIGTERM
        while not all(_complete(entries, refs[:2])) and not returned.is_set():
            time.sleep(0.05)
        time.sleep(0.5)  # their results reach the main process
        REQUEST.request(signal.SIGTERM)

    thread = threading.Thread(target=stop_request, daemon=True)
    thread.start()
    args = ["run", "--protocol", str(path), "--root", f"ct={roots['ct']}", "--cache-dir", str(cache), "--out", str(out)]
    code = main([*args, "--methods", "vanilla", "--set", "prepare_workers=2", "--set", "patch_size=[32,32,32]"])
    returned.set()
    thread.join()
    assert code == 128 + signal.SIGTERM
    assert _complete(entries, refs) == [True, True, False, False] and _workers(others) == []
    said = " ".join(capsys.readouterr().out.split())  # (the console wraps lines)
    assert "[data] stopped after 2 of 4 sample(s) in " in said
    assert "stopped on SIGTERM before base session 0 (base); the sessions before it are saved; continue with" in said


def test_the_workers_fork_server_ignores_ctrl_c_from_its_first_import(monkeypatch):
    """Its first preloaded module sets SIGINT to ignored (so a Ctrl-C while it imports torch and MONAI prints no
    traceback of its own); nothing else imports that module."""
    import subprocess

    context = multiprocessing.get_context("forkserver")
    preloads: list[list[str]] = []
    monkeypatch.setattr(context, "set_forkserver_preload", preloads.append)
    assert workers.worker_context() is context
    assert preloads[0][0] == "jascl.data.fork_quiet" and "torch" in preloads[0] and "monai" in preloads[0]
    ignored = "print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN)"
    # Python's own handler first: a test process started with SIGINT ignored (a background job of a script) passes
    # that on to its children
    code = f"import signal; signal.signal(signal.SIGINT, signal.default_int_handler); {ignored}; "
    code += f"import jascl.data.fork_quiet; {ignored}"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "True"]
    src = Path(workers.__file__).parents[1]
    users = [p.name for p in src.rglob("*.py") if "fork_quiet" in p.read_text() and p.name != "fork_quiet.py"]
    assert users == ["workers.py"]


def test_a_ctrl_c_while_the_workers_start_takes_effect_after_they_have(capsys):
    """Inside the block SIGINT is held (announced once); at its end the handler in force before gets it once."""
    reached = []
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own: KeyboardInterrupt
    try:
        with pytest.raises(KeyboardInterrupt):
            with workers._interrupt_afterwards():
                os.kill(os.getpid(), signal.SIGINT)
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.1)  # (a signal is handled between bytecodes, soon after it arrives)
                reached.append("the block's end")
        assert reached == ["the block's end"] and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert capsys.readouterr().err.count("Ctrl-C: the worker processes are starting") == 1
        got: list[int] = []
        signal.signal(signal.SIGINT, lambda signum, frame: got.append(signum))  # e.g. a run's stop request
        with workers._interrupt_afterwards():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)
            assert got == []
        assert got == [signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, previous)
