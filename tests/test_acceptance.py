"""End-to-end acceptance on the built-in protocols (slow: minutes on a 2-core CPU)."""

import math

import pytest

from jascl.engine.config import resolve_config
from jascl.experiments.runner import run_benchmark
from jascl.protocols import get_protocol


@pytest.mark.slow
def test_synthetic_2d_vanilla_forgets_jascl_retains(tmp_path):
    protocol = get_protocol("synthetic-2d")
    # the protocol as built in, with 8 base and 10 incremental epochs instead of 30 and 40, so the suite stays
    # within CI's 15 minutes (the base model is undertrained, Dice about 0.35, and the claim is relative); the
    # full-length run is the README's main job, whose numbers are in the README
    config = resolve_config(protocol.training, protocol.path, overrides=["epochs_base=8", "epochs_incremental=10"])
    results = run_benchmark(
        protocol,
        config,
        ["vanilla", "jascl"],
        tmp_path / "run",
        cache_dir=tmp_path / "cache",
        progress=False,
        echo=lambda m: None,
    )
    v, j = results["methods"]["vanilla"], results["methods"]["jascl"]
    # vanilla fine-tuning forgets: base classes at the last session <= half of their base-session Dice
    assert v["sessions"][-1]["base"] <= 0.5 * v["sessions"][0]["base"]
    # JASCL's Total Drop is clearly lower and its last all-class mean is higher. One seed's exact figures move with
    # the installed versions and thread count (at these epochs, one thread, torch 2.14.1, synthetic-2d as sized on
    # 2026-11-27 for a 2-core CPU: JASCL 45.8 vs vanilla 78.6, last all-class mean 0.177 vs 0.109; at full length
    # 56.6 vs 95.8; with the settings before: 51.4 vs 82.5, and 64.3 vs 92.5), so the margin is set well inside the
    # measured gaps (33 and 39 points; 31 and 28 before), not at their edge.
    assert j["total_drop"] <= v["total_drop"] - 15
    assert j["sessions"][-1]["all"] > v["sessions"][-1]["all"]


@pytest.mark.slow
def test_synthetic_3d_runs_end_to_end_with_the_3d_unet(tmp_path):
    protocol = get_protocol("synthetic-3d")
    # one epoch per session, and the 3D U-Net with 4-8 channels per level instead of the protocol's 8-64: what this
    # checks (every session of both methods trains and scores all seven classes with the 3D U-Net, and no score is
    # NaN) needs no more; the scores themselves are not compared. The widths change no code path, only the time
    # (2 cores, 2026-12-07, alone: 25 s at the protocol's widths, 11 s at these)
    narrow = 'backbone_args={"features": [4, 4, 8, 8, 8, 4]}'
    config = resolve_config(
        protocol.training, protocol.path, overrides=["epochs_base=1", "epochs_incremental=1", narrow]
    )
    results = run_benchmark(
        protocol,
        config,
        ["vanilla", "jascl"],
        tmp_path / "run",
        cache_dir=tmp_path / "cache",
        progress=False,
        echo=lambda m: None,
    )
    for name in ("vanilla", "jascl"):
        sessions = results["methods"][name]["sessions"]
        assert [s["session"] for s in sessions] == [0, 1, 2]
        assert set(sessions[-1]["per_class"]) == {"0", "1", "2", "3", "4", "5", "6"}
        assert not math.isnan(sessions[-1]["all"])
