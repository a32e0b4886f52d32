"""The run folder (issue 35): one run at a time (an exclusive lock naming its holder), a stale lock of a killed run
does not block ``--resume``, environment errors (read-only ``--out``, ``--device cuda`` without a GPU) are one line
before any work, a failed start leaves no folder, and progress a person can see: epoch lines and a step bar in a
terminal (a pseudo-terminal here), clean lines elsewhere."""

import errno
import fcntl
import json
import os
import re
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
import torch
import yaml

from conftest import toy_protocol_dict
from jascl.cli import main
from jascl.errors import DataError

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}


def toy(tmp_path: Path, **training) -> Path:
    spec = toy_protocol_dict(2)
    spec["training"].update(threads=1, **training)
    path = tmp_path / "toy.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def run_args(protocol: Path, out: Path, cache: Path, *extra: str) -> list[str]:
    return [
        "run",
        "--protocol",
        str(protocol),
        "--methods",
        "vanilla",
        "--out",
        str(out),
        "--cache-dir",
        str(cache),
        *extra,
    ]


def in_process(args: list[str]) -> int:
    threads = torch.get_num_threads()
    try:
        return main(args)
    finally:
        torch.set_num_threads(threads)  # the run set its own (threads=1)


def one_line(code: int, err: str) -> str:
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("jascl: error: ") and "Traceback" not in err, err
    return lines[0]


def wait_stopped(pid: int, timeout: float = 300) -> None:
    """Until process ``pid`` is stopped (state T in /proc): it sent itself SIGSTOP after a training step."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state in ("T", "t"):
            return
        if state == "Z":
            raise AssertionError("the run ended before it stopped")
        time.sleep(0.2)
    raise AssertionError("the run did not reach its stop point")


def in_pty(args: list[str], columns: int = 100) -> tuple[int, str]:
    """``python -m jascl ARGS`` with stdin, stdout and stderr on a pseudo-terminal of ``columns`` columns."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    process = subprocess.Popen([sys.executable, "-m", "jascl", *args], stdin=slave, stdout=slave, stderr=slave, env=ENV)
    os.close(slave)
    out = bytearray()
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the terminal's other end closed
            break
        if not data:
            break
        out.extend(data)
    os.close(master)
    return process.wait(), out.decode(errors="replace")


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and uses a pseudo-terminal")
def test_a_second_run_and_a_report_are_refused_a_killed_runs_lock_is_not_and_resume_shows_where(tmp_path, capsys):
    """A real run stops itself (SIGSTOP) after its 2nd step, holding the folder: a second ``jascl run`` into it and a
    ``jascl report`` writing into it each get one line naming its pid. Killed (SIGKILL) it leaves its lock file
    behind; ``--resume`` in a terminal continues, says where, and prints epoch lines and a step bar."""
    protocol = toy(tmp_path, epochs_base=2, checkpoint_steps=1)
    out, cache = tmp_path / "run", tmp_path / "cache"
    holder = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "kill_run.py"), "signal:2:SIGSTOP", *run_args(protocol, out, cache)]
        + ["--no-progress"],
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_stopped(holder.pid)
        before = sorted(p.relative_to(out) for p in out.rglob("*"))
        capsys.readouterr()
        line = one_line(in_process(run_args(protocol, out, cache, "--no-progress")), capsys.readouterr().err)
        assert line == (
            f"jascl: error: {out}: in use by jascl run (pid {holder.pid}); wait for it to finish (or stop it: it "
            "checkpoints and can be resumed), or use another --out"
        )
        line = one_line(in_process(["report", str(out), "--samples", "0"]), capsys.readouterr().err)
        assert f"in use by jascl run (pid {holder.pid})" in line
        assert sorted(p.relative_to(out) for p in out.rglob("*")) == before  # neither wrote a file
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert (out / ".lock").read_text() == f"jascl run (pid {holder.pid})\n"  # stale: its process is gone
    code, text = in_pty(["run", "--resume", str(out)])
    assert code == 0, text
    plain = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", text)  # colours and cursor moves of the bars
    lines = [line.strip() for line in plain.replace("\r", "\n").splitlines()]
    # checkpointed after step 1 (inside epoch 1 of 2, 2 steps an epoch): the resumed session says so
    assert "[base] session 0 (base): resuming inside epoch 1 of 2 from its checkpoint" in lines
    epochs = [line for line in lines if line.startswith("[base] session 0 (base) epoch")]
    assert [e.split(":")[0] for e in epochs] == [
        "[base] session 0 (base) epoch 1/2",
        "[base] session 0 (base) epoch 2/2",
    ]
    assert ", ETA " in epochs[0] and ", ETA " not in epochs[1]  # the last epoch has nothing left to estimate
    assert any(line.startswith("[vanilla] session 1 (inc) epoch 2/2: loss ") for line in lines)
    assert any("step/s" in line and line.startswith("epoch ") for line in lines)  # the step bar, drawn in place
    assert (out / "results.json").is_file() and (out / ".lock").read_text() == ""  # released, naming no one


def test_progress_lines_without_a_terminal_and_none_with_no_progress(tmp_path, capsys):
    """Not a terminal (captured output, a log file): epoch lines, no bars (no carriage returns); --no-progress:
    neither. The run header names the thread count."""
    protocol, cache = toy(tmp_path), tmp_path / "cache"
    assert in_process(run_args(protocol, tmp_path / "a", cache)) == 0
    captured = capsys.readouterr()
    assert "\r" not in captured.out + captured.err and "step/s" not in captured.err
    lines = captured.out.splitlines()
    assert "threads 1, output" in " ".join(" ".join(lines[:2]).split())  # (wrapped at 80 columns)
    assert [line.split(":")[0] for line in lines if " epoch " in line] == [
        "[base] session 0 (base) epoch 1/1",
        "[vanilla] session 1 (inc) epoch 1/2",
        "[vanilla] session 1 (inc) epoch 2/2",
    ]
    assert in_process(run_args(protocol, tmp_path / "b", cache, "--no-progress")) == 0
    captured = capsys.readouterr()
    assert " epoch " not in captured.out and "\r" not in captured.out + captured.err


def test_read_only_out_is_one_line_before_any_work(tmp_path, capsys, monkeypatch):
    folder = tmp_path / "ro"
    folder.mkdir()
    if os.geteuid() == 0:  # root writes through permission bits: a read-only file system is simulated

        def read_only(*args, **kwargs):
            raise OSError(errno.EROFS, "Read-only file system")

        monkeypatch.setattr("jascl.experiments.preflight.tempfile.mkstemp", read_only)
        why = "read-only file system"
    else:
        folder.chmod(0o555)
        why = "Permission denied"
    line = one_line(in_process(run_args(toy(tmp_path), folder / "run", tmp_path / "cache")), capsys.readouterr().err)
    assert line == f"jascl: error: --out {folder / 'run'}: cannot write in {folder} ({why}); choose a writable folder"
    assert capsys.readouterr().out == "" and list(folder.iterdir()) == []  # no header: nothing started
    folder.chmod(0o755)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU")
def test_device_cuda_without_a_gpu_is_one_line_before_any_work(tmp_path, capsys):
    out = tmp_path / "run"
    code = in_process(run_args(toy(tmp_path), out, tmp_path / "cache", "--device", "cuda"))
    line = one_line(code, capsys.readouterr().err)
    assert line.startswith("jascl: error: --device cuda: torch sees no CUDA GPU on this machine")
    assert not out.exists() and not (tmp_path / "cache").exists()  # no data generated, no folder


def test_a_run_that_fails_to_start_leaves_no_folder_and_one_that_stops_says_why(tmp_path, capsys, monkeypatch):
    for name in list(os.environ):  # med-disjoint's dataset roots unset
        if name.startswith("JASCL_ROOT_"):
            monkeypatch.delenv(name)
    out = tmp_path / "med"
    line = one_line(
        in_process(["run", "--protocol", "med-disjoint", "--out", str(out), "--no-progress"]), capsys.readouterr().err
    )
    assert "root" in line and not out.exists()  # it left a folder holding only log.txt before

    import jascl.experiments.runner as runner

    def broken(*args, **kwargs):
        raise DataError("case_007.nii.gz: unreadable or corrupt NIfTI (test)")

    monkeypatch.setattr(runner, "ensure_base", broken)
    out = tmp_path / "toy"
    line = one_line(
        in_process(run_args(toy(tmp_path), out, tmp_path / "cache", "--no-progress")), capsys.readouterr().err
    )
    assert line == "jascl: error: case_007.nii.gz: unreadable or corrupt NIfTI (test)"
    assert json.loads((out / "run.json").read_text())["methods"] == ["vanilla"]  # resumable: kept
    assert (
        (out / "log.txt")
        .read_text()
        .splitlines()[-1]
        .endswith("ERROR stopped: case_007.nii.gz: unreadable or corrupt NIfTI (test)")
    )
