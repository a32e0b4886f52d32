"""A run SIGKILLed at several points (mid-epoch, during a checkpoint write, between sessions) and
continued with ``jascl run --resume`` ends with exactly the results.json of an uninterrupted run;
``--resume`` refuses folders that are not runs and options the folder fixes."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from conftest import toy_protocol_dict
from jascl.cli import main
from jascl.engine.checkpoint import load_progress

ROOT = Path(__file__).resolve().parents[1]


def _kill_run_process(point_args: list[str], stdout: str, stderr: str) -> None:
    """A killed run's process: ``python tests/kill_run.py POINT jascl-args...``, its output into two files."""
    for fd, path in ((1, stdout), (2, stderr)):
        with open(path, "w") as fh:
            os.dup2(fh.fileno(), fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    sys.argv = [str(ROOT / "tests" / "kill_run.py"), *point_args]
    import kill_run

    sys.exit(kill_run.main())


def _kill_run(processes, point: str, args: list[str], where: Path) -> subprocess.CompletedProcess:
    """Runs tests/kill_run.py ``point`` ``args`` in a process of its own; its exit code (-9: SIGKILLed) and output."""
    out, err = where / "kill_run.stdout", where / "kill_run.stderr"
    process = processes.Process(target=_kill_run_process, args=([point, *args], str(out), str(err)))
    process.start()
    process.join()
    return subprocess.CompletedProcess(point, process.exitcode, out.read_text(), err.read_text())


@pytest.fixture(scope="module")
def setup(tmp_path_factory, processes):
    root = tmp_path_factory.mktemp("crash")
    spec = toy_protocol_dict(2)
    spec["sessions"][1]["unlabelled"] = 4
    spec["training"].update(
        epochs_base=2, epochs_incremental=2, augment=True, threads=1, pas={"start_epoch": 0, "every": 1}
    )
    protocol = root / "toy.yaml"
    protocol.write_text(yaml.safe_dump(spec))
    args = [
        "run",
        "--protocol",
        str(protocol),
        "--methods",
        "vanilla,jascl",
        "--cache-dir",
        str(root / "cache"),
        "--no-progress",
    ]
    reference = root / "reference"  # uninterrupted, in a process of its own as the killed runs
    done = _kill_run(processes, "none", [*args, "--out", str(reference)], root)
    assert done.returncode == 0, done.stderr
    return root, args, (reference / "results.json").read_text()


STEPS = ["--set", "checkpoint_steps=1"]


def _checkpoint_position(out: Path) -> tuple:
    """(epoch, step inside it or None) of the one in-session checkpoint of run folder ``out``."""
    (progress,) = out.rglob("progress.safetensors")
    meta, _ = load_progress(progress)
    return meta["epoch"], meta.get("step")


def _resume_and_compare(out: Path, expected: str) -> None:
    """``jascl run --resume out`` (the command's own entry point) in this process: the run was killed in another
    one, and starting a third would add only its imports (torch, MONAI: most of a toy run's time)."""
    threads = torch.get_num_threads()
    try:
        code = main(["run", "--resume", str(out), "--no-progress"])
    finally:
        torch.set_num_threads(threads)  # the run set its own (threads=1)
    assert code == 0
    assert (out / "results.json").read_text() == expected
    assert not list(out.rglob("progress.safetensors")), "finished sessions keep no progress checkpoint"


# steps: session 0 has 2 steps per epoch (8 images, batch 4) and 2 epochs; vanilla's session 1 follows.
# With checkpoint_steps=1 the first step of each epoch is checkpointed too: killed in step 4 (the last of
# epoch 1), the run resumes inside epoch 1; killed writing the 3rd progress file (that one), after epoch 0.
@pytest.mark.parametrize(
    "point, extra, where",
    [
        ("step:3", [], None),
        ("step:7", [], None),
        ("write:progress.safetensors:2", [], None),
        ("write:model.safetensors:2", [], None),
        ("session:1", [], None),
        ("session:2", [], None),
        ("step:4", STEPS, (1, 1)),
        ("write:progress.safetensors:3", STEPS, (0, None)),
    ],
)
def test_killed_run_resumes_to_identical_results(point, extra, where, setup, processes, tmp_path):
    root, args, expected = setup
    out = tmp_path / "run"
    killed = _kill_run(processes, point, [*args, *extra, "--out", str(out)], tmp_path)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not (out / "results.json").exists()
    if where is not None:
        assert _checkpoint_position(out) == where
    _resume_and_compare(out, expected)


# SIGTERM (and Ctrl-C) in step 3 (the first of base epoch 1): stops right after it, inside epoch 1; SIGUSR1 in
# step 4 (the epoch's last): the epoch's own checkpoint
@pytest.mark.parametrize(
    "point, code, where",
    [("signal:3:SIGTERM", 143, (1, 1)), ("signal:3:SIGINT", 130, (1, 1)), ("signal:4:SIGUSR1", 138, (1, None))],
)
def test_a_stop_signal_checkpoints_after_the_step_and_exits_resumable(point, code, where, setup, processes, tmp_path):
    root, args, expected = setup
    out = tmp_path / "run"
    stopped = _kill_run(processes, point, [*args, "--out", str(out)], tmp_path)
    assert stopped.returncode == code, stopped.stderr
    name = point.rsplit(":", 1)[1]
    text = " ".join(stopped.stdout.split())  # rich wraps lines
    assert f"stopped on {name} in base session 0 (base): its training state " in text
    assert f"continue with: jascl run --resume {out}" in text
    assert _checkpoint_position(out) == where
    _resume_and_compare(out, expected)


def test_a_second_ctrl_c_aborts_at_once_keeping_the_last_checkpoint(setup, processes, tmp_path):
    root, args, expected = setup
    out = tmp_path / "run"
    aborted = _kill_run(processes, "signal:3:SIGINT,SIGINT", [*args, "--out", str(out)], tmp_path)
    assert aborted.returncode == 130, aborted.stderr
    assert "press Ctrl-C again to abort now" in aborted.stderr
    text = " ".join(aborted.stdout.split())
    assert f"aborted; finished sessions and the last checkpoint are saved in {out}" in text
    assert "stopped on SIGINT" not in text  # it did not wait to checkpoint step 3
    assert _checkpoint_position(out) == (0, None)  # the end of epoch 0, written before the first Ctrl-C
    assert not list(out.rglob("*.tmp"))
    _resume_and_compare(out, expected)


def test_resume_refuses_a_folder_that_is_not_a_run(tmp_path, capsys):
    assert main(["run", "--resume", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"jascl: error: {tmp_path}: not a jascl run folder (no run.json)") and "\n" not in err


def test_resume_refuses_options_the_folder_fixes(tmp_path, capsys):
    (tmp_path / "run.json").write_text(json.dumps({"protocol": "synthetic-2d", "seed": 1, "methods": ["vanilla"]}))
    assert main(["run", "--resume", str(tmp_path), "--methods", "jascl", "--seed", "3"]) == 2
    err = capsys.readouterr().err
    assert "the run folder fixes the protocol, methods and settings; drop --seed, --methods" in err


def test_devices_must_be_positive(capsys):
    assert main(["run", "--devices", "0"]) == 2
    assert "--devices 0: must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["run", "--bogus"], "jascl: error: unrecognized arguments: --bogus; see 'jascl --help'"),
        (
            ["run", "--seed", "abc"],
            "jascl run: error: argument --seed: invalid int value: 'abc'; see 'jascl run --help'",
        ),
        (["run", "--set", "epochs_base=-1"], "jascl: error: --set: epochs_base: must be >= 0 (got -1)"),
        (["run", "--set", "checkpoint_steps=-2"], "jascl: error: --set: checkpoint_steps: must be >= 0 steps (got -2)"),
        (
            ["run", "--set", "precision=fp16"],
            "jascl: error: --set: precision: must be one of auto, fp32, bf16 (got 'fp16')",
        ),
        (["run", "--set", "checkpoint_every=x"], "jascl: error: --set: checkpoint_every: must be a number (got 'x')"),
        (
            ["bench", "--epochs", "1"],
            "jascl: error: --epochs 1 --rounds 3: need epochs >= 2 (the first warms up) and rounds >= 1",
        ),
        (
            ["bench", "--protocol", "synthetic-2d"],
            "jascl: error: protocol synthetic-2d session 1 has no unlabelled pool "
            "for the mean-teacher cases; use --protocol bench-2d or leave out "
            "plain-mt,pas",
        ),
    ],
)
def test_bad_command_lines_get_one_line_errors_and_exit_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.strip() == message


def test_devices_refuses_one_fixed_gpu_for_several_processes(capsys):
    assert main(["run", "--devices", "2", "--device", "cuda:0"]) == 2
    assert (
        "--device cuda:0 with --devices 2: each process takes its own GPU; use --device cuda" in capsys.readouterr().err
    )
