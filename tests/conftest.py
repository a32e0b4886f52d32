"""Shared fixtures: a tiny two-session toy protocol and a tiny run configuration."""

import dataclasses
import multiprocessing
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

_SRC = str(Path(__file__).resolve().parents[1] / "src")
if _SRC not in sys.path:
    sys.path.insert(0, _SRC)

import torch  # noqa: E402

from jascl.engine.config import resolve_config  # noqa: E402
from jascl.experiments.launcher import Launcher  # noqa: E402
from jascl.protocols import parse_protocol  # noqa: E402

# one thread per pytest-xdist worker (the workers share the cores), else two
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests marked ``slow`` first, the rest in their usual order. pytest-xdist hands the tests out in this
    order, one at a time (``--maxschedchunk 1`` in pyproject.toml), so the long tests are spread over the workers
    and the workers end together, on short tests. On 2 cores (2026-11-29, one run each): in file order a worker
    waited 36 s for the other's last long test (suite 516 s); slow tests first in xdist's default blocks put all
    of them on one worker and the other waited 110 s (488 s); both changes: 2 s (425 s)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


#: what a run imports: the forkserver of :func:`processes` imports them once
FORKSERVER_PRELOAD = ["jascl.cli", "jascl.cli.run", "jascl.experiments.runner", "jascl.engine.loop"]
FORKSERVER_PRELOAD += ["jascl.results.report", "jascl.methods.registry", "jascl.methods.presets"]  # vanilla, jascl
FORKSERVER_PRELOAD += ["jascl.experiments.reproduce", "jascl.paper.tables", "kill_run"]


@pytest.fixture(scope="session")
def processes():
    """A multiprocessing context for tests that kill or signal a run's process: each process is a fresh one,
    forked from a forkserver that has imported torch and jascl once and run nothing, so a test does not pay a new
    interpreter's imports (5-13 s, most of a toy run's time). The target must be importable (a module-level
    function of a test module); its exit code is ``Process.exitcode`` (-9: SIGKILLed)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(FORKSERVER_PRELOAD)
    return context


def _cli_process(args: list[str], cwd: str, stdout: str, stderr: str) -> None:
    for fd, path in ((1, stdout), (2, stderr)):
        with open(path, "w") as fh:
            os.dup2(fh.fileno(), fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.chdir(cwd)
    from jascl.cli import main

    sys.exit(main(args))


def run_cli(processes, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``jascl ARGS`` in a fresh process of :func:`processes` started in folder ``cwd`` (as ``python -m jascl ARGS``
    there, without a new interpreter's imports): its exit code and output (files in ``cwd``)."""
    out, err = cwd / ".jascl-stdout", cwd / ".jascl-stderr"
    process = processes.Process(target=_cli_process, args=(args, str(cwd), str(out), str(err)))
    process.start()
    process.join()
    return subprocess.CompletedProcess(args, process.exitcode, out.read_text(), err.read_text())


# Hypothesis (tests/test_fuzz_inputs.py): the same examples on every run and machine, CI included, and no
# example database written into the checkout; HYPOTHESIS_PROFILE=explore draws new examples each run
from hypothesis import settings  # noqa: E402

settings.register_profile("jascl", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", derandomize=False, database=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "jascl"))


#: Gen-Replay's diffusion prior at toy cost (a few DDPM and DDIM steps; test_baselines_gen_replay.py and
#: test_gen_replay_diffusion.py check what it learns): the every-method tests pass these overrides
TINY_DIFFUSION = tuple(f"method_args.gen-replay.{k}" for k in ("diffusion_steps=3", "sample_steps=2", "bank=4"))


def toy_protocol_dict(spatial_dims: int = 2) -> dict:
    size = 32
    return {
        "name": f"toy-{spatial_dims}d",
        "seed": 3,
        "spatial_dims": spatial_dims,
        "metric": "dice",
        "synthetic": {"size": size, "objects_per_image": [1, 2], "object_radius": [0.2, 0.3], "distractors": 1},
        "classes": [
            {"id": 0, "name": "background"},
            {"id": 1, "name": "disc", "shape": "disc"},
            {"id": 2, "name": "square", "shape": "square"},
            {"id": 3, "name": "cross", "shape": "cross"},
        ],
        "domains": {
            "a": {"appearance": {"class_intensity": [0.5, 0.9]}},
            "b": {"appearance": {"invert": True, "noise": 0.02}},
        },
        "sessions": [
            {"name": "base", "domains": ["a"], "new_classes": [1, 2], "shots": "all", "train": 8, "test": 4},
            {"name": "inc", "domains": ["b"], "new_classes": [3], "recurring_classes": [1], "shots": 2, "test": 4},
        ],
        "training": {
            "backbone_args": {"features": [4, 4, 8, 8, 8, 8]},
            "epochs_base": 1,
            "epochs_incremental": 2,
            "batch_size": 4,
            "augment": False,
        },
    }


@pytest.fixture
def toy_protocol():
    return parse_protocol(toy_protocol_dict(2), source="toy-2d.yaml")


@pytest.fixture
def toy_protocol_3d():
    return parse_protocol(toy_protocol_dict(3), source="toy-3d.yaml")


@pytest.fixture
def toy_config(toy_protocol):
    return resolve_config(toy_protocol.training, "toy-2d.yaml")


class _Finished:
    """A submitit job that has already run (in this process): its outcome, and where its log would be."""

    def __init__(self, job_id: int, folder, exc: BaseException | None) -> None:
        self.job_id, self.exc = str(job_id), exc
        self.paths = type("Paths", (), {"stderr": folder / f"{job_id}_log.err"})()

    def done(self) -> bool:
        return True

    def exception(self) -> BaseException | None:
        return self.exc

    def cancel(self, check: bool = False) -> None:
        pass


class _InProcess:
    """submitit's executor as the launcher uses it, running each job at once in this process."""

    def __init__(self, folder) -> None:
        self.folder, self.submitted = folder, 0

    def submit(self, fn, *args):
        self.submitted += 1
        try:
            fn(*pickle.loads(pickle.dumps(args)))  # what submitit sends a job, pickled
        except Exception as exc:  # the job failed; the launcher reads it from the job, as from submitit's
            return _Finished(self.submitted, self.folder, exc)
        return _Finished(self.submitted, self.folder, None)


@dataclasses.dataclass(frozen=True)
class InProcessLauncher(Launcher):
    """A launcher whose jobs run at once, one after another, in the calling process (``poll_s=0``): what a grid
    submits and how its jobs end, without a process per job."""

    def executor(self, folder):
        return _InProcess(folder)
