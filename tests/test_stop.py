"""A stop signal (SIGTERM, SIGUSR1) ends a run cleanly: handlers only record it, the trainer checkpoints at a safe
step and raises Stopped (exit code 128 + signal); with several processes every rank stops at the same step.
(One-process runs stopped by a real signal and resumed: tests/test_crash_resume.py.)"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import toy_protocol_dict
from jascl.cli import main
from jascl.engine.checkpoint import load_progress
from jascl.engine.stop import REQUEST, StopRequest

ROOT = Path(__file__).resolve().parents[1]


def test_handlers_record_the_first_signal_and_are_removed_after_the_block():
    before = signal.getsignal(signal.SIGTERM)
    request = StopRequest()
    with request.installed():
        assert not request.requested
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)  # recorded, the process lives on
        assert request.requested and request.name == "SIGUSR1"
        stopped = request.stopped("after epoch 2")
        assert str(stopped) == "stopped on SIGUSR1 after epoch 2" and stopped.exit_code == 128 + 10
    assert not request.requested
    assert signal.getsignal(signal.SIGTERM) is before


def test_the_first_ctrl_c_says_what_happens_and_the_second_aborts(capsys):
    request = StopRequest()
    request.handle(signal.SIGINT)
    assert request.name == "SIGINT"
    assert capsys.readouterr().err == (
        "\nCtrl-C: stopping cleanly (after the current step, with a checkpoint; while the store is being filled, at "
        "once, keeping its entries); press Ctrl-C again to abort now\n"
    )
    with pytest.raises(KeyboardInterrupt):
        request.handle(signal.SIGINT)
    request.clear()
    request.handle(signal.SIGTERM)  # no line for a cluster's signal; a Ctrl-C after it aborts
    assert capsys.readouterr().err == ""
    with pytest.raises(KeyboardInterrupt):
        request.handle(signal.SIGINT)


def test_a_rank_stopped_for_another_reports_sigterm():
    stopped = StopRequest().stopped("inside epoch 1, after step 3")
    assert str(stopped) == "stopped (another process received a stop signal) inside epoch 1, after step 3"
    assert stopped.exit_code == 143


def _vote(rank: int, store: str, signal_at: dict, slow_at: dict, answers) -> None:
    """One rank of a 2-process gloo group (forked): the stop vote after each of 8 steps, until it says stop."""
    import time

    import torch.distributed as dist

    from jascl import distributed
    from jascl.engine.stop import StopVote

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        vote, said = StopVote(), []
        for step in range(8):
            if slow_at.get(rank) == step:
                time.sleep(0.3)  # this rank comes late to the step's vote
            if signal_at.get(rank) == step:
                REQUEST.request(signal.SIGTERM)
            said.append(vote.after_step())
            if said[-1]:
                break
        answers.put((rank, said))
    finally:
        distributed.shutdown()


@pytest.mark.parametrize(
    "signal_at, slow_at, stop_after",
    [
        ({1: 2}, {}, 3),  # one rank asked in step 2: both stop after step 3
        ({1: 2}, {0: 3}, 3),  # the same with rank 0 late for step 3's vote
        ({0: 4, 1: 1}, {1: 1}, 2),  # two requests: the first counts
        ({}, {}, None),  # no request: no stop
    ],
)
def test_the_stop_vote_stops_every_rank_after_the_same_step(tmp_path, signal_at, slow_at, stop_after):
    import multiprocessing

    context = multiprocessing.get_context("fork")  # (this process's imports, no new interpreter)
    answers = context.Queue()
    ranks = [
        context.Process(target=_vote, args=(r, str(tmp_path / "store"), signal_at, slow_at, answers)) for r in (0, 1)
    ]
    for p in ranks:
        p.start()
    said = dict(answers.get(timeout=60) for _ in ranks)
    for p in ranks:
        p.join(timeout=60)
        assert p.exitcode == 0
    expected = [False] * 8 if stop_after is None else [False] * stop_after + [True]
    assert said == {0: expected, 1: expected}


def test_alone_the_stop_vote_is_the_request_at_once():
    from jascl.engine.stop import StopVote

    vote = StopVote()
    try:
        assert not vote.after_step()
        REQUEST.request(signal.SIGUSR1)
        assert vote.after_step()
    finally:
        REQUEST.clear()


def test_no_handlers_outside_jascl_run():
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL and not REQUEST.requested


#: makes rank 1 of a torchrun launch send itself SIGTERM right after its JASCL_SIGNAL_STEP-th optimiser step
SITECUSTOMIZE = """
import os
if os.environ.get("RANK") == "1" and os.environ.get("JASCL_SIGNAL_STEP"):
    import signal
    from jascl.engine.loop import ContinualTrainer
    fire, count = ContinualTrainer.fire, [0]

    def fire_and_maybe_signal(self, event, state):
        fire(self, event, state)
        if event == "after_update":
            count[0] += 1
            if count[0] == int(os.environ["JASCL_SIGNAL_STEP"]):
                os.kill(os.getpid(), signal.SIGTERM)

    ContinualTrainer.fire = fire_and_maybe_signal
"""


@pytest.mark.slow
def test_a_signal_to_one_rank_stops_every_rank_after_the_next_step(tmp_path, monkeypatch, capfd):
    """Rank 1 alone gets SIGTERM in a step; both ranks stop after the next one (their stop vote), inside the epoch
    and with no ``checkpoint_steps``, and the resumed run ends as the uninterrupted one."""
    spec = toy_protocol_dict(2)
    spec["training"].update(epochs_base=2, epochs_incremental=2, batch_size=2, threads=1)
    protocol = tmp_path / "toy.yaml"
    protocol.write_text(yaml.safe_dump(spec))
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    # the launcher (jascl run --devices 2: it starts torchrun and waits) runs in this process, with the command's
    # own entry point; torchrun and the two ranks are processes of their own, started with this environment
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "site"), str(ROOT / "src")]))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("JASCL_SIGNAL_STEP", raising=False)
    args = [
        "run",
        "--protocol",
        str(protocol),
        "--methods",
        "vanilla",
        "--device",
        "cpu",
        "--devices",
        "2",
        "--cache-dir",
        str(tmp_path / "cache"),
        "--no-progress",
    ]
    # the uninterrupted run also checkpoints after every step (its results are those of a run without)
    code = main([*args, "--set", "checkpoint_steps=1", "--out", str(tmp_path / "whole")])
    whole = capfd.readouterr()
    assert code == 0, whole.err[-3000:]

    out = tmp_path / "stopped"
    # 8 base images at a global batch of 2: 4 steps per epoch; rank 1 alone gets the signal in step 2, and every
    # rank learns of it from the vote read after step 3 (before the stop vote: at the epoch's end)
    monkeypatch.setenv("JASCL_SIGNAL_STEP", "2")
    code = main([*args, "--out", str(out)])
    stopped = capfd.readouterr()
    assert code != 0
    text = " ".join(stopped.out.split())
    assert (
        "stopped (another process received a stop signal) in base session 0 (base): its training state inside "
        "epoch 0, after step 3 is saved in" in text
    ), stopped.out + stopped.err[-3000:]
    meta, _ = load_progress(out / "base" / "progress.safetensors")
    assert (meta["epoch"], meta["step"]) == (0, 3)
    assert not (out / "results.json").exists()

    monkeypatch.delenv("JASCL_SIGNAL_STEP")
    code = main(["run", "--resume", str(out), "--devices", "2", "--no-progress"])
    assert code == 0, capfd.readouterr().err[-3000:]
    assert (
        json.loads((out / "results.json").read_text())["methods"]
        == json.loads((tmp_path / "whole" / "results.json").read_text())["methods"]
    )


@pytest.mark.slow
def test_jascl_run_devices_passes_sigterm_on_to_its_workers(tmp_path):
    """``kill`` of the ``jascl run --devices 2`` process reaches both ranks through torchrun: they stop cleanly
    (wherever the signal lands: between sessions or after a step; resuming such a stop is tested above)."""
    spec = toy_protocol_dict(2)
    spec["training"].update(epochs_base=2, epochs_incremental=2, batch_size=4, threads=1)
    protocol = tmp_path / "toy.yaml"
    protocol.write_text(yaml.safe_dump(spec))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    out = tmp_path / "stopped"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jascl",
            "run",
            "--protocol",
            str(protocol),
            "--methods",
            "vanilla,jascl",
            "--device",
            "cpu",
            "--devices",
            "2",
            "--set",
            "checkpoint_steps=1",
            "--cache-dir",
            str(tmp_path / "cache"),
            "--no-progress",
            "--out",
            str(out),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "training the shared base model" in line:
            proc.send_signal(signal.SIGTERM)
            break
    rest, _ = proc.communicate(timeout=120)
    text = " ".join("".join(lines + [rest]).split())
    assert proc.returncode != 0, text[-3000:]
    assert "stopped on SIGTERM" in text and f"continue with: jascl run --resume {out}" in text, text[-3000:]
    assert "SIGKILL" not in text  # the workers stopped by themselves, within torchrun's grace period
    assert not (out / "results.json").exists()
