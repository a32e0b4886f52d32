"""End-to-end acceptance on the built-in protocols (slow: minutes on a 2-core CPU)."""

import math

import pytest

from jascl.engine.config import resolve_config
from jascl.experiments.runner import run_benchmark
from jascl.protocols import get_protocol


@pytest.mark.slow
def test_synthetic_2d_vanilla_forgets_jascl_retains(tmp_path):
    protocol = get_protocol("synthetic-2d")
    config = resolve_config(protocol.training, protocol.path)
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
    # the installed versions and thread count (63.7 vs 91.3 on one install, 63.2 vs 92.5 with torch 2.14.1), so
    # the margin is set well inside the measured gap of about 28 points, not at its edge.
    assert j["total_drop"] <= v["total_drop"] - 15
    assert j["sessions"][-1]["all"] > v["sessions"][-1]["all"]


@pytest.mark.slow
def test_synthetic_3d_runs_end_to_end_with_the_3d_unet(tmp_path):
    protocol = get_protocol("synthetic-3d")
    config = resolve_config(protocol.training, protocol.path, overrides=["epochs_base=5", "epochs_incremental=5"])
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
