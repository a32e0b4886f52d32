"""The new-class geometry diagnostic: prototype cosines and where a new class's test pixels go."""

import math
import runpy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from jascl.engine.prototypes import PrototypeStore
from jascl.errors import ConfigError
from jascl.experiments.runner import run_benchmark
from jascl.results.geometry import NewClassGeometry, new_class_geometry, prediction_shares, prototype_cosines

ROOT = Path(__file__).resolve().parents[1]


def test_prototype_cosines_by_hand():
    new = {4: torch.tensor([1.0, 0.0]), 5: torch.tensor([3.0, 4.0])}
    stored = {(0, 1): torch.tensor([1.0, 1.0]), (0, 0): torch.tensor([0.0, 2.0])}
    cos = prototype_cosines(new, stored)
    # keys in (session, class) order; cos([1,0],[1,1]) = 1/sqrt(2); cos([3,4],[0,2]) = 4/5; cos([3,4],[1,1]) = 7/(5 sqrt 2)
    assert list(cos[4]) == ["s0.c0", "s0.c1"]
    assert cos[4]["s0.c0"] == pytest.approx(0.0) and cos[4]["s0.c1"] == pytest.approx(2**-0.5)
    assert cos[5]["s0.c0"] == pytest.approx(0.8) and cos[5]["s0.c1"] == pytest.approx(7 / (5 * 2**0.5))


def test_prediction_shares_by_hand():
    # seen [0, 1, 4]; rows = ground truth: class 4's 8 pixels went 4 to background, 2 to class 1, 2 to itself
    confusion = torch.tensor([[10, 0, 0], [1, 3, 0], [4, 2, 2]])
    shares = prediction_shares(confusion, [0, 1, 4], [4, 1])
    assert shares[4] == {0: 0.5, 1: 0.25, 4: 0.25}
    assert shares[1] == {0: 0.25, 1: 0.75, 4: 0.0}
    absent = prediction_shares(torch.zeros(3, 3, dtype=torch.long), [0, 1, 4], [4])
    assert all(math.isnan(v) for v in absent[4].values())


def test_shares_of_a_tiny_prediction_by_hand():
    # the path new_class_geometry takes: global-id label maps -> ConfusionAccumulator -> shares. seen [0, 1, 4];
    # class 4's 4 voxels are predicted 4, 1, 1, 0; the ignore voxel (255) predicted 4 counts nowhere
    from jascl.evaluation.metrics import ConfusionAccumulator

    target = torch.tensor([[[0, 0, 1, 4], [4, 4, 4, 255]]])
    pred = torch.tensor([[[0, 1, 1, 4], [1, 1, 0, 4]]])
    acc = ConfusionAccumulator([0, 1, 4])
    acc.update(pred, target)
    shares = prediction_shares(acc.matrix(), [0, 1, 4], [4])
    assert shares == {4: {0: 0.25, 1: 0.5, 4: 0.25}}


def test_markdown_tables():
    g = NewClassGeometry(1, [0, 1, 2], {2: {"s0.c1": 0.951, "s0.c0": 0.1}}, {2: {0: 0.25, 1: 0.5, 2: 0.25}})
    text = g.to_markdown()
    assert "| new class | s0.c0 | s0.c1 |" in text and "| 2 | 0.100 | 0.951 |" in text
    assert "| new class | 0 | 1 | 2 |" in text and "| 2 | 0.250 | 0.500 | 0.250 |" in text


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    from conftest import toy_protocol_dict
    from jascl.engine.config import resolve_config
    from jascl.protocols.parse import parse_protocol

    protocol = parse_protocol(toy_protocol_dict(2), source="toy-2d.yaml")
    config = resolve_config(protocol.training, "toy-2d.yaml", overrides=["device=cpu"])
    out = tmp_path_factory.mktemp("geometry") / "run"
    cache = out.parent / "cache"
    run_benchmark(protocol, config, ["vanilla"], out, cache_dir=cache, progress=False, echo=lambda m: None)
    return out, cache


def test_geometry_of_a_run_matches_the_loop(toy_run):
    run, cache = toy_run
    g = new_class_geometry(run, "vanilla", 1, cache_dir=cache)
    assert g.seen == [0, 1, 2, 3] and list(g.cosines) == [3] and list(g.shares) == [3]
    # with the backbone frozen (all_but_classifier) the session's features are the base's, so the new class's
    # prototype is the one the loop stored after session 1: same cosines to the base's stored prototypes
    s1 = PrototypeStore.load(run / "vanilla" / "s1-inc" / "prototypes.safetensors").entries
    for (s, c), q in s1.items():
        if s == 0:
            assert g.cosines[3][f"s0.c{c}"] == pytest.approx(float(F.cosine_similarity(s1[(1, 3)], q, dim=0)), abs=1e-5)
    assert sum(g.shares[3].values()) == pytest.approx(1.0) and min(g.shares[3].values()) >= 0


def test_geometry_refuses_what_it_cannot_measure(toy_run):
    run, cache = toy_run
    with pytest.raises(ConfigError, match="choose an incremental session"):
        new_class_geometry(run, "vanilla", 0, cache_dir=cache)
    with pytest.raises(ConfigError, match="no finished session"):
        new_class_geometry(run, "jascl", 1, cache_dir=cache)


def _tool(*argv: str) -> int:
    """The script as ``python tools/new_class_geometry.py ARGV`` runs it (its ``__main__`` block, here in this
    process: a new interpreter would spend seconds importing torch and MONAI again); its exit status."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", ["new_class_geometry.py", *argv])
        with pytest.raises(SystemExit) as exit_info:
            runpy.run_path(str(ROOT / "tools" / "new_class_geometry.py"), run_name="__main__")
    return exit_info.value.code


def test_tool_prints_the_tables_and_fails_in_one_line(toy_run, capsys):
    run, cache = toy_run
    assert _tool(str(run), "vanilla", "1", "--cache-dir", str(cache)) == 0
    assert "| new class | s0.c0 | s0.c1 | s0.c2 |" in capsys.readouterr().out
    assert _tool(str(run), "vanilla", "5", "--cache-dir", str(cache)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "choose an incremental session" in err
