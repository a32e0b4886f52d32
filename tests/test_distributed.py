"""Two CPU processes (torchrun + gloo via ``jascl run --devices 2``) on the toy protocol: the run completes,
only rank 0 writes into the run folder, and the results match a one-process run with the same global batch."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from jascl.data.sampling import SeededBatchSampler

from conftest import toy_protocol_dict

ROOT = Path(__file__).resolve().parents[1]

#: imported by every Python process started with its folder on PYTHONPATH: on ranks other than 0 it
#: records every attempt to create, write, rename or delete a path inside JASCL_AUDIT_DIR
SITECUSTOMIZE = '''
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
'''


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


@pytest.mark.slow
def test_two_processes_match_one_and_only_rank0_writes(tmp_path):
    spec = toy_protocol_dict(2)
    spec["sessions"][1]["unlabelled"] = 4
    spec["training"].update(epochs_base=3, epochs_incremental=3, batch_size=4, threads=1,
                            pas={"start_epoch": 0, "every": 1})
    protocol = tmp_path / "toy.yaml"
    protocol.write_text(yaml.safe_dump(spec))
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    reports = tmp_path / "reports"
    reports.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(ROOT / "src")]),
           "OMP_NUM_THREADS": "1", "JASCL_AUDIT_DIR": str(tmp_path / "two"), "JASCL_AUDIT_REPORT": str(reports)}
    args = [sys.executable, "-m", "jascl", "run", "--protocol", str(protocol), "--methods", "vanilla,jascl",
            "--device", "cpu", "--cache-dir", str(tmp_path / "cache"), "--no-progress"]
    one = subprocess.run([*args, "--out", str(tmp_path / "one")], env=env, capture_output=True, text=True)
    assert one.returncode == 0, one.stderr
    # checkpoints inside epochs too: every rank checks the loss there (a collective), rank 0 alone writes
    two = subprocess.run([*args, "--devices", "2", "--set", "checkpoint_steps=1", "--out", str(tmp_path / "two")],
                         env=env, capture_output=True, text=True)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "2 processes" in " ".join(two.stdout.split())  # rich wraps lines

    assert json.loads((reports / "rank1.json").read_text()) == []  # rank 1 never wrote into the run folder
    a = json.loads((tmp_path / "one" / "results.json").read_text())
    b = json.loads((tmp_path / "two" / "results.json").read_text())
    for method in ("vanilla", "jascl"):
        for sa, sb in zip(a["methods"][method]["sessions"], b["methods"][method]["sessions"]):
            assert sb["all"] == pytest.approx(sa["all"], abs=0.005), (method, sa["session"])
            for c, v in sa["per_class"].items():
                assert sb["per_class"][c] == pytest.approx(v, abs=0.02, nan_ok=True), (method, sa["session"], c)
    pl_a = a["methods"]["jascl"]["sessions"][1]["pseudo_labels"]
    pl_b = b["methods"]["jascl"]["sessions"][1]["pseudo_labels"]
    assert pl_b["coverage"] == pytest.approx(pl_a["coverage"], abs=0.05)  # counters reduced over both ranks
    assert (json.loads((tmp_path / "one" / "manifest.json").read_text())
            == json.loads((tmp_path / "two" / "manifest.json").read_text()))


def test_the_write_audit_catches_a_write_from_rank_1(tmp_path):
    """The audit the test above relies on does record a rank-1 write (else its empty report would prove nothing)."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    watched = tmp_path / "run"
    watched.mkdir()
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site"), "RANK": "1", "JASCL_AUDIT_DIR": str(watched),
           "JASCL_AUDIT_REPORT": str(tmp_path)}
    code = f"import os; open({str(watched / 'a.txt')!r}, 'w').close(); os.replace({str(watched / 'a.txt')!r}, " \
           f"{str(watched / 'b.txt')!r}); open({str(tmp_path / 'outside.txt')!r}, 'w').close()"
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    writes = json.loads((tmp_path / "rank1.json").read_text())
    assert [w[0] for w in writes] == ["open", "os.rename"] or [w[0] for w in writes] == ["open", "os.replace"]


def test_sync_batchnorm_converts_in_place_only_with_several_gpu_processes(monkeypatch):
    """SyncBatchNorm replaces BatchNorm (names and values kept) when several GPU processes run; else nothing."""
    import torch
    from torch import nn

    from jascl import distributed

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Sequential(nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4)),
                             nn.InstanceNorm2d(4, affine=True))

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
