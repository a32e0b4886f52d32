"""Two CPU processes (torchrun + gloo via ``jascl run --devices 2``) on the toy protocol.

What "two processes train as one" means, checked where it is sharp:
- every global batch is split between the ranks, disjoint and complete (the sample ids each rank consumed);
- the parameters after the first steps equal a one-process run's up to float32 reduction order
  (:func:`rounding_tolerance`), which a shared or un-averaged gradient misses by orders of magnitude.
The end-to-end run also shows what it shows well: the run completes, only rank 0 writes into the run
folder, and the metrics (confusion matrices, pseudo-label counters) are reduced over both ranks.
A Dice after several epochs is not compared tightly: argmax flips on a barely trained model amplify
rounding differences into Dice differences of 0.01 that depend on the installed versions.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from conftest import TINY_DIFFUSION, toy_protocol_dict
from jascl.cli import main
from jascl.data.sampling import SeededBatchSampler, derive_seed
from jascl.engine.config import resolve_config
from jascl.methods import METHODS
from jascl.networks.base import create_segmenter
from jascl.protocols import parse_protocol

ROOT = Path(__file__).resolve().parents[1]

#: imported by every Python process started with its folder on PYTHONPATH: on ranks other than 0 it
#: records every attempt to create, write, rename or delete a path inside JASCL_AUDIT_DIR
SITECUSTOMIZE = """
import atexit, json, os, sys
if os.environ.get("JASCL_AUDIT_DIR") and os.environ.get("RANK", "0") != "0":
    watched = os.path.realpath(os.environ["JASCL_AUDIT_DIR"])
    writes = []
    writing = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

    def inside(path):
        try:
            return os.path.realpath(os.fsdecode(path)).startswith(watched)
        except TypeError:
            return False  # a file descriptor

    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            if (mode and any(c in mode for c in "wax+")) or (not mode and flags & writing):
                if inside(path):
                    writes.append([event, os.fsdecode(path)])
        elif event in ("os.rename", "os.replace", "os.mkdir", "os.remove", "os.rmdir", "os.truncate"):
            if any(inside(a) for a in args[:2] if isinstance(a, (str, bytes, os.PathLike))):
                writes.append([event, str(args[0])])

    sys.addaudithook(hook)
    report = os.path.join(os.environ["JASCL_AUDIT_REPORT"], f"rank{os.environ['RANK']}.json")
    atexit.register(lambda: open(report, "w").write(json.dumps(writes)))
if os.environ.get("JASCL_TRACE_DIR"):  # every batch of sample keys a SeededBatchSampler hands out, per rank
    import jascl.data.sampling as sampling

    handed = []
    original = sampling.SeededBatchSampler.__iter__

    def traced(self):
        for batch in original(self):
            handed.append([self.seed, [list(k) for k in batch]])
            yield batch

    sampling.SeededBatchSampler.__iter__ = traced
    # one file per process (launchers too, whose lists stay empty), named by rank where torchrun set one
    trace = os.path.join(os.environ["JASCL_TRACE_DIR"], f"rank{os.environ.get('RANK', '0')}-{os.getpid()}.json")
    atexit.register(lambda: handed and open(trace, "w").write(json.dumps(handed)))
"""


def test_sampler_shares_global_batches_between_ranks():
    one = SeededBatchSampler(10, 4, seed=5, rank=0, world=1)
    ranks = [SeededBatchSampler(10, 4, seed=5, rank=r, world=2) for r in range(2)]
    for _ in range(2):  # two passes: a new permutation each, the same for every rank
        batches = list(one)
        split = [list(r) for r in ranks]
        assert [sorted(a + b) for a, b in zip(*split)] == [sorted(b) for b in batches]
        assert [len(b) for b in split[0]] == [2, 2, 1] and [len(b) for b in split[1]] == [2, 2, 1]
    assert batches[0][0][0] == 1  # keys carry the pass number
    assert list(SeededBatchSampler(3, 2, seed=1, shuffle=False)) == [[(0, 0), (0, 1)], [(0, 2)]]


#: float32 unit roundoff (2**-23 spacing at 1.0)
EPS = torch.finfo(torch.float32).eps


def rounding_tolerance(after: torch.Tensor, before: torch.Tensor, terms: int, steps: int) -> float:
    """How far one tensor of two runs that differ only in the order of float32 sums may drift apart.

    A parameter after ``steps`` optimiser steps is ``before`` plus an update made of gradients, each a sum
    over ``terms`` per-pixel contributions (the global batch's pixels); splitting that sum between ranks
    reorders it, which changes it by at most about ``terms * EPS`` relative (the bound for recursive
    summation, Higham's gamma_n). Adding the update to the parameter rounds once per step, to the
    parameter's own spacing. Hence ``terms * EPS * max|update| + steps * EPS * max|parameter|``.
    """
    update = (after.double() - before.double()).abs().max().item()
    return terms * EPS * update + steps * EPS * after.abs().max().item()


def _models_match(one: Path, two: Path, before: tuple[dict, dict], terms: int, steps: int) -> None:
    """The models ``one`` and ``two`` saved by the two runs, which started from ``before`` (each run's own)."""
    a, b = load_file(one), load_file(two)
    assert a.keys() == b.keys() == before[0].keys() == before[1].keys()
    for key, value in a.items():
        if not value.is_floating_point():
            assert torch.equal(value, b[key]), key
            continue
        start = before[0][key]
        parts = [(slice(None), start)]
        if start.shape != value.shape:  # a grown classifier: old rows go on, new rows start from nothing
            parts = [(slice(0, len(start)), start), (slice(len(start), None), torch.zeros_like(value[len(start) :]))]
        # the runs' starting points differ already (by rounding, in their earlier sessions)
        apart = (before[1][key].double() - start.double()).abs().max().item()
        for rows, prior in parts:
            tol = apart + rounding_tolerance(value[rows], prior, terms, steps)
            diff = (b[key][rows].double() - value[rows].double()).abs().max().item()
            assert diff <= tol, f"{one.parent.name}/{key}: the runs differ by {diff:.3g}, rounding allows {tol:.3g}"


def _batches(traces: Path, rank: int) -> dict[int, list[list[tuple[int, int]]]]:
    """Sampler seed -> the batches of (pass, index) keys it handed out to ``rank``, in order."""
    (trace,) = traces.glob(f"rank{rank}-*.json")  # the one process of that rank that drew batches
    out: dict[int, list] = {}
    for seed, keys in json.loads(trace.read_text()):
        out.setdefault(seed, []).append([tuple(k) for k in keys])
    return out


@pytest.mark.slow
def test_two_processes_train_as_one_and_only_rank0_writes(tmp_path, monkeypatch, capfd):
    spec = toy_protocol_dict(2)
    spec["sessions"][1]["unlabelled"] = 4
    # one epoch per session: the first steps, where the two runs are still equal up to rounding
    spec["training"].update(
        epochs_base=1, epochs_incremental=1, batch_size=4, threads=1, pas={"start_epoch": 0, "every": 1}
    )
    protocol = tmp_path / "toy.yaml"
    protocol.write_text(yaml.safe_dump(spec))
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    reports = tmp_path / "reports"
    for name in ("reports", "trace-one", "trace-two"):
        (tmp_path / name).mkdir()
    # both launchers (the one-process run, and jascl run --devices 2 that starts torchrun and waits) run in this
    # process, with the command's own entry point; torchrun and the two ranks are processes of their own, started
    # with this environment
    for name, value in {
        "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(ROOT / "src")]),
        "OMP_NUM_THREADS": "1",
        "JASCL_AUDIT_DIR": str(tmp_path / "two"),
        "JASCL_AUDIT_REPORT": str(reports),
    }.items():
        monkeypatch.setenv(name, value)
    args = [
        "run",
        "--protocol",
        str(protocol),
        "--methods",
        "vanilla,jascl",
        "--device",
        "cpu",
        "--cache-dir",
        str(tmp_path / "cache"),
        "--no-progress",
    ]
    handed = []  # the one-process run's batches, traced as SITECUSTOMIZE traces each rank's
    threads = torch.get_num_threads()
    with monkeypatch.context() as patch:
        original = SeededBatchSampler.__iter__

        def traced(self):
            for batch in original(self):
                handed.append([self.seed, [list(k) for k in batch]])
                yield batch

        patch.setattr(SeededBatchSampler, "__iter__", traced)
        try:
            code = main([*args, "--out", str(tmp_path / "one")])
        finally:
            torch.set_num_threads(threads)  # the run set its own (threads=1)
    assert code == 0, capfd.readouterr().err
    (tmp_path / "trace-one" / "rank0-0.json").write_text(json.dumps(handed))
    # checkpoints inside epochs too: every rank checks the loss there (a collective), rank 0 alone writes
    monkeypatch.setenv("JASCL_TRACE_DIR", str(tmp_path / "trace-two"))
    capfd.readouterr()
    code = main([*args, "--devices", "2", "--set", "checkpoint_steps=1", "--out", str(tmp_path / "two")])
    two = capfd.readouterr()
    assert code == 0, two.err[-3000:]
    assert "2 processes" in " ".join(two.out.split())  # rich wraps lines
    assert json.loads((reports / "rank1.json").read_text()) == []  # rank 1 never wrote into the run folder

    # the sample ids: each global batch of the one-process run, split between the ranks without overlap
    alone = _batches(tmp_path / "trace-one", 0)
    ranks = [_batches(tmp_path / "trace-two", r) for r in (0, 1)]
    assert len(alone) >= 3  # the base and incremental labelled loaders, and the mean teacher's unlabelled pool
    for seed, batches in alone.items():
        shares = [r[seed] for r in ranks]
        assert len(shares[0]) == len(shares[1]) == len(batches), seed  # every rank steps with every batch
        for batch, first, second in zip(batches, *shares):
            assert not set(first) & set(second) and sorted(first + second) == sorted(batch), (seed, batch)
            assert abs(len(first) - len(second)) <= 1

    # the parameters after the first steps: equal up to the order of float32 sums
    pixels = spec["training"]["batch_size"] * spec["synthetic"]["size"] ** 2
    p = parse_protocol(spec, source="toy.yaml")
    cfg = resolve_config(p.training, "toy.yaml")
    torch.manual_seed(p.seed)  # the session-0 model before training, as the trainer builds it
    initial = create_segmenter(
        cfg.backbone,
        p.spatial_dims,
        p.in_channels,
        3,
        cosine=cfg.classifier == "cosine",
        temperature=cfg.temperature,
        **cfg.backbone_args,
    ).state_dict()
    base_seed = derive_seed(p.seed, "labelled", 0)
    _models_match(
        tmp_path / "one/base/model.safetensors",
        tmp_path / "two/base/model.safetensors",
        (initial, initial),
        pixels,
        len(alone[base_seed]),
    )
    base = tuple(load_file(tmp_path / f"{run}/base/model.safetensors") for run in ("one", "two"))
    steps = sum(len(b) for seed, b in alone.items() if seed != base_seed)  # an upper bound on either method's
    for method in ("vanilla", "jascl"):
        _models_match(
            tmp_path / f"one/{method}/s1-inc/model.safetensors",
            tmp_path / f"two/{method}/s1-inc/model.safetensors",
            base,
            pixels,
            steps,
        )

    # the metrics: with models equal up to rounding, so are the reduced confusion matrices and counters
    a = json.loads((tmp_path / "one" / "results.json").read_text())
    b = json.loads((tmp_path / "two" / "results.json").read_text())
    for method in ("vanilla", "jascl"):
        for sa, sb in zip(a["methods"][method]["sessions"], b["methods"][method]["sessions"], strict=True):
            # (one test pixel whose argmax flips moves a class's Dice by well under 0.01 here; a rank scoring
            # only its own half of the test split would not)
            assert sb["per_class"] == pytest.approx(sa["per_class"], abs=0.01, nan_ok=True), (method, sa["session"])
    kept_a = a["methods"]["jascl"]["sessions"][1]["pseudo_labels"]["confidence_only_per_class"]
    kept_b = b["methods"]["jascl"]["sessions"][1]["pseudo_labels"]["confidence_only_per_class"]
    assert kept_a.keys() == kept_b.keys()
    for c in kept_a:  # pixel counts summed over both ranks (one rank's alone would be about half)
        assert kept_b[c]["kept"] == pytest.approx(kept_a[c]["kept"], rel=0.01, abs=1), c
    assert json.loads((tmp_path / "one" / "manifest.json").read_text()) == json.loads(
        (tmp_path / "two" / "manifest.json").read_text()
    )


def test_the_write_audit_catches_a_write_from_rank_1(tmp_path):
    """The audit the test above relies on does record a rank-1 write (else its empty report would prove nothing)."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    watched = tmp_path / "run"
    watched.mkdir()
    env = {
        **os.environ,
        "PYTHONPATH": str(tmp_path / "site"),
        "RANK": "1",
        "JASCL_AUDIT_DIR": str(watched),
        "JASCL_AUDIT_REPORT": str(tmp_path),
    }
    code = (
        f"import os; open({str(watched / 'a.txt')!r}, 'w').close(); os.replace({str(watched / 'a.txt')!r}, "
        f"{str(watched / 'b.txt')!r}); open({str(tmp_path / 'outside.txt')!r}, 'w').close()"
    )
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    writes = json.loads((tmp_path / "rank1.json").read_text())
    assert [w[0] for w in writes] == ["open", "os.rename"] or [w[0] for w in writes] == ["open", "os.replace"]


def test_sync_batchnorm_converts_in_place_only_with_several_gpu_processes(monkeypatch):
    """SyncBatchNorm replaces BatchNorm (names and values kept) when several GPU processes run; else nothing."""
    from torch import nn

    from jascl import distributed

    def model():
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Conv2d(1, 4, 3),
            nn.BatchNorm2d(4),
            nn.Sequential(nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4)),
            nn.InstanceNorm2d(4, affine=True),
        )

    m = model()
    assert distributed.sync_batchnorm(m, torch.device("cuda")) == 0  # one process: untouched
    assert isinstance(m[1], nn.BatchNorm2d) and not isinstance(m[1], nn.SyncBatchNorm)
    monkeypatch.setattr(distributed, "active", lambda: True)
    assert distributed.sync_batchnorm(m, torch.device("cpu")) == 0  # gloo on CPUs: PyTorch has no SyncBatchNorm
    before = {k: v.clone() for k, v in m.state_dict().items()}
    top = m
    assert distributed.sync_batchnorm(m, torch.device("cuda")) == 2
    assert m is top and isinstance(m[1], nn.SyncBatchNorm) and isinstance(m[2][1], nn.SyncBatchNorm)
    assert isinstance(m[3], nn.InstanceNorm2d)  # only BatchNorm layers
    after = m.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert distributed.sync_batchnorm(m, torch.device("cuda")) == 0  # already converted
    x = torch.randn(2, 1, 8, 8)
    reference = model().eval()
    assert torch.equal(m.eval()(x), reference(x))  # evaluation (no synchronisation) is unchanged


@pytest.mark.slow
def test_a_method_that_leaves_parameters_without_gradient_trains_with_two_processes(tmp_path, monkeypatch, capfd):
    """C-FSCIL's meta-learning epochs leave the pixel classifier without a gradient; the trainer must ask
    DistributedDataParallel to find such parameters (``Plugin.unused_parameters``), else the second
    process stops at the first meta-learning step ("Expected to have finished reduction ...")."""
    from jascl.methods.registry import create_method

    assert create_method("c-fscil", resolve_config()).unused_parameters
    assert not create_method("vanilla", resolve_config()).unused_parameters
    spec = toy_protocol_dict(2)
    # two base epochs: one of pretraining (every parameter used), then one of meta-learning (classifier unused)
    spec["training"].update(epochs_base=2, epochs_incremental=1, batch_size=4, threads=1)
    protocol = tmp_path / "toy.yaml"
    protocol.write_text(yaml.safe_dump(spec))
    # the launcher (jascl run --devices 2: it starts torchrun and waits) runs in this process; torchrun and the two
    # ranks are processes of their own, started with this environment
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "src"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    code = main(
        [
            *("run", "--protocol", str(protocol), "--methods", "c-fscil"),
            *("--device", "cpu", "--devices", "2", "--no-progress"),
            *("--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "run")),
        ]
    )
    assert code == 0, capfd.readouterr().err[-3000:]
    log = (tmp_path / "run" / "log.txt").read_text()
    assert "cfscil_meta" in log  # the meta-learning epoch ran
    sessions = json.loads((tmp_path / "run" / "results.json").read_text())["methods"]["c-fscil"]["sessions"]
    assert len(sessions) == 2


#: the methods of issue 17, each with extra forwards, heads, memories or generators outside DDP's own forward
ISSUE17 = ("nncsl", "halo", "ucb", "cat", "variational-dropout", "clip-ct", "clip-driven", "gen-replay", "jascl+gaps")


@pytest.mark.slow
def test_the_newer_methods_keep_every_process_identical_under_ddp(tmp_path, monkeypatch, capfd):
    """DDP safety: trained with two processes, each method ends every session with the same parameters on both
    ranks (a plugin's extra module or loss that escaped the gradient averaging would make them drift apart), and
    the run completes (no collective left waiting on one rank)."""
    spec = toy_protocol_dict(2)
    spec["sessions"][1]["unlabelled"] = 4
    spec["training"].update(epochs_base=1, epochs_incremental=1, batch_size=2, threads=1)
    protocol = tmp_path / "toy.yaml"
    protocol.write_text(yaml.safe_dump(spec))
    digests = tmp_path / "digests"
    digests.mkdir()
    # the launcher runs in this process (as above); what --import registers here is undone afterwards
    for name, value in {
        "PYTHONPATH": str(ROOT / "src"),
        "OMP_NUM_THREADS": "1",
        "JASCL_DIGEST_DIR": str(digests),
    }.items():
        monkeypatch.setenv(name, value)
    registered = "digest" in METHODS
    try:
        code = main(
            [
                *("run", "--protocol", str(protocol), "--import", str(ROOT / "tests" / "ddp_digest.py")),
                *("--methods", ",".join(f"{m}+digest" for m in ISSUE17)),
                *("--set", "pas.start_epoch=0", "--set", "pas.every=1"),
                *(a for o in TINY_DIFFUSION for a in ("--set", o)),
                *("--device", "cpu", "--devices", "2", "--no-progress"),
                *("--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "run")),
            ]
        )
    finally:
        if not registered and "digest" in METHODS:
            METHODS.unregister("digest")
        sys.modules.pop("ddp_digest", None)
    assert code == 0, capfd.readouterr().err[-3000:]
    for method in ISSUE17:
        rank0 = (digests / f"{method}.s1.rank0").read_text()
        assert rank0 == (digests / f"{method}.s1.rank1").read_text(), f"{method}: the two processes drifted apart"


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity mask on this platform")
def test_usable_cores_follow_the_affinity_mask_not_the_machine():
    """What torchrun's ranks, local launcher jobs and prepare workers divide: a container's or ``taskset``'s cores,
    not ``os.cpu_count()`` (the machine's)."""
    from jascl.distributed import usable_cores

    mask = os.sched_getaffinity(0)
    if len(mask) < 2:
        pytest.skip("one core: the mask and the machine agree")
    try:
        os.sched_setaffinity(0, {min(mask)})  # this thread only, restored below
        assert usable_cores() == 1
    finally:
        os.sched_setaffinity(0, mask)
    assert usable_cores() == len(mask)
