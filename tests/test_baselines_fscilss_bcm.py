"""FSCIL-SS and BCM (few-shot baselines acting in incremental sessions only).

Pure rules on hand-computed tiny tensors (BCM: the official IBM/BCM mapping, under-sampling, folds, refiner and
prediction rule); each plugin on the toy two-session protocol (session 0 trained once for the module, session 1
with the method), FSCIL-SS with and without an unlabelled pool.
"""

import json
import math
from pathlib import Path

import pytest
import torch

from conftest import toy_protocol_dict
from jascl.data.synthetic import load_or_generate
from jascl.engine.config import resolve_config
from jascl.engine.loop import ContinualTrainer
from jascl.engine.prototypes import PrototypeStore
from jascl.errors import ConfigError
from jascl.methods import Method, Plugin
from jascl.methods.baselines.fewshot._bcm_refiner import (
    Refiner,
    fit_logistic,
    fit_refiner,
    mine_base_classes,
    predict_proba,
    refine,
    stratified_folds,
    under_sample,
)
from jascl.methods.baselines.fewshot.fscil_ss import (
    predictive_uncertainty,
    ss_distillation,
    uncertainty_guided_selection,
)
from jascl.methods.registry import create_method
from jascl.protocols import parse_protocol

# ----------------------------------------------------------------------------- FSCIL-SS: pure rules


def test_predictive_uncertainty_is_the_entropy_of_the_mean_prediction():
    # pixel a: passes (0.8, 0.2), (0.6, 0.4) -> mean (0.7, 0.3), pred 0, H = -(0.7 ln 0.7 + 0.3 ln 0.3)
    # pixel b: passes (0.1, 0.9) twice -> mean (0.1, 0.9), pred 1, H = -(0.1 ln 0.1 + 0.9 ln 0.9)
    samples = torch.tensor([[[0.8, 0.1], [0.2, 0.9]], [[0.6, 0.1], [0.4, 0.9]]]).view(2, 1, 2, 1, 2)
    pred, entropy = predictive_uncertainty(samples)
    assert pred.tolist() == [[[0, 1]]]
    h_a = -(0.7 * math.log(0.7) + 0.3 * math.log(0.3))  # 0.610864
    h_b = -(0.1 * math.log(0.1) + 0.9 * math.log(0.9))  # 0.325083
    assert entropy.view(-1).tolist() == pytest.approx([h_a, h_b], abs=1e-6)
    # a certain pixel has zero entropy (no NaN from log 0)
    _, h = predictive_uncertainty(torch.tensor([1.0, 0.0]).view(1, 1, 2, 1, 1))
    assert h.item() == 0.0


def test_uncertainty_guided_selection_keeps_the_least_uncertain_fraction_per_class():
    pred = torch.tensor([[[0, 0, 0], [1, 1, 2]]])
    unc = torch.tensor([[[0.5, 0.1, 0.3], [0.9, 0.2, 0.0]]])
    # row 0: 3 pixels, ceil(0.5 * 3) = 2 kept -> uncertainties 0.1 and 0.3; row 1: ceil(0.5 * 2) = 1 -> 0.2;
    # row 2 is not selectable although it is the most certain pixel
    out = uncertainty_guided_selection(pred, unc, rows=[0, 1], fraction=0.5)
    assert out.tolist() == [[[255, 0, 0], [255, 1, 255]]]
    assert (uncertainty_guided_selection(pred, unc, [0, 1], 0.0) == 255).all()
    assert uncertainty_guided_selection(pred, unc, [0, 1, 2], 1.0).tolist() == pred.tolist()
    # ties: the earlier pixel first; one pixel of a class is kept for any fraction > 0 (ceil)
    tie = uncertainty_guided_selection(torch.zeros(1, 3, dtype=torch.long), torch.full((1, 3), 0.4), [0], 0.3)
    assert tie.tolist() == [[0, 255, 255]]
    # 3D volumes: (N, D, H, W)
    vol = uncertainty_guided_selection(
        torch.tensor([[[[1, 1], [1, 1]]]]), torch.tensor([[[[0.4, 0.3], [0.2, 0.1]]]]), [1], 0.5
    )
    assert vol.tolist() == [[[[255, 255], [1, 1]]]]


def test_ss_distillation_hand_values_over_labelled_and_pool_pixels():
    # labelled pixel: student old rows (0, ln 3) -> p = (1/4, 3/4); teacher (0, 0) -> q = (1/2, 1/2)
    # loss = -(0.5 ln 0.25 + 0.5 ln 0.75) = 0.836988; the new row (100) is not part of the old softmax
    student = torch.tensor([0.0, math.log(3.0), 100.0]).view(1, 3, 1, 1)
    teacher = torch.zeros(1, 2, 1, 1)
    one = -(0.5 * math.log(0.25) + 0.5 * math.log(0.75))
    assert ss_distillation([student], [teacher], 1.0).item() == pytest.approx(one, abs=1e-6)
    # a pool pixel where student == teacher == (0, 0): -ln 0.5; the two sources' pixels share one mean
    pool_s, pool_t = torch.zeros(1, 3, 1, 1), torch.zeros(1, 2, 1, 1)
    both = ss_distillation([student, pool_s], [teacher, pool_t], 1.0).item()
    assert both == pytest.approx((one + math.log(2.0)) / 2, abs=1e-6)
    # T = 2: p = softmax(0, ln 3 / 2) = (1, sqrt 3) / (1 + sqrt 3)
    p0, p1 = 1 / (1 + math.sqrt(3)), math.sqrt(3) / (1 + math.sqrt(3))
    two = -(0.5 * math.log(p0) + 0.5 * math.log(p1))  # 0.730390
    assert ss_distillation([student], [teacher], 2.0).item() == pytest.approx(two, abs=1e-6)
    # 3D logits (B, K, D, H, W)
    assert ss_distillation([student.view(1, 3, 1, 1, 1)], [teacher.view(1, 2, 1, 1, 1)], 1.0).item() == pytest.approx(
        one, abs=1e-6
    )


# ----------------------------------------------------------------------------- BCM: pure rules


def test_bcm_mapping_takes_the_base_rows_predicted_most_on_each_novel_class():
    # novel class 7: base rows 0 (x3), 2 (x2); novel class 9: base rows 1 (x2), 2 (x2) -> tie, smaller row first
    base_pred = torch.tensor([0, 0, 0, 2, 2, 1, 1, 2, 2, 1])
    labels = torch.tensor([7, 7, 7, 7, 7, 9, 9, 9, 9, 0])
    assert mine_base_classes(base_pred, labels, [7, 9], top_k=1) == {0: [7], 1: [9]}
    assert mine_base_classes(base_pred, labels, [7, 9], top_k=2) == {0: [7], 1: [9], 2: [7, 9]}
    assert mine_base_classes(base_pred, labels, [5], top_k=1) == {}  # a class without pixels maps nowhere


def test_under_sampling_keeps_the_rarest_nonzero_count_of_every_class():
    y = torch.tensor([0, 0, 0, 0, 0, 1, 1, 1, 2, 2])
    keep = under_sample(y, torch.Generator().manual_seed(0))
    assert torch.bincount(y[keep]).tolist() == [2, 2, 2]
    assert keep.tolist() == sorted(keep.tolist())
    assert under_sample(torch.zeros(4, dtype=torch.long), torch.Generator()).tolist() == [0, 1, 2, 3]


def test_stratified_folds_cut_each_class_in_consecutive_chunks():
    y = torch.tensor([0, 1, 0, 1, 0, 1, 0])  # class 0 at 0, 2, 4, 6; class 1 at 1, 3, 5
    assert [f.tolist() for f in stratified_folds(y, 2)] == [[0, 1, 2, 3], [4, 5, 6]]


def test_logistic_regression_minimises_scikit_learns_objective():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 3, generator=g, dtype=torch.float64)
    y = (x[:, 0] + 0.3 * torch.randn(40, generator=g, dtype=torch.float64) > 0).long()
    w = fit_logistic(x, y, 2, c=1.0).requires_grad_(True)
    objective = 0.5 * (w[:, :-1] ** 2).sum() + torch.nn.functional.cross_entropy(
        x @ w[:, :-1].T + w[:, -1], y, reduction="sum"
    )
    (grad,) = torch.autograd.grad(objective, [w])
    assert grad.abs().max() < 1e-4  # a stationary point of the (convex) objective: its minimum
    assert ((predict_proba(w.detach(), x).argmax(1) == y).float().mean()) > 0.85


def test_refiner_separates_its_novel_class_and_the_rule_overrides_only_its_base_row():
    g = torch.Generator().manual_seed(1)
    x = torch.cat([torch.randn(30, 2, generator=g) - 2, torch.randn(30, 2, generator=g) + 2])
    y = torch.cat([torch.zeros(30, dtype=torch.long), torch.full((30,), 5)])  # class 5 is the novel class
    refiner = fit_refiner(x, y, base_row=0, novel=[5], generator=torch.Generator().manual_seed(0))
    assert refiner.novel == [5] and refiner.weights.shape == (2, 3)
    base_pred = torch.tensor([0, 0, 1])  # the third pixel is predicted as base row 1: the refiner of row 0 skips it
    feats = torch.tensor([[2.0, 2.0], [-2.0, -2.0], [2.0, 2.0]])
    rows = Refiner(0, [7], refiner.weights)  # novel class 5 as classifier row 7
    assert refine(base_pred, feats, [rows]).tolist() == [7, 0, 1]
    # two refiners of one row: the more probable novel prediction wins
    sure = Refiner(0, [8], torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 50.0]], dtype=torch.float64))
    assert refine(base_pred, feats, [rows, sure]).tolist() == [8, 8, 1]


def test_options_are_checked():
    protocol = parse_protocol(toy_protocol_dict(2), source="toy-2d.yaml")
    with pytest.raises(ConfigError, match="method_args.fscil-ss"):
        create_method(
            "fscil-ss", resolve_config(protocol.training, "x.yaml", overrides=["method_args.fscil-ss.dropout=1"])
        )
    with pytest.raises(ConfigError, match="method_args.bcm"):
        create_method("bcm", resolve_config(protocol.training, "x.yaml", overrides=["method_args.bcm.top_k=0"]))
    with pytest.raises(ConfigError, match="method_args.bcm"):
        create_method("bcm", resolve_config(protocol.training, "x.yaml", overrides=["method_args.bcm.folds=1"]))


# ----------------------------------------------------------------------------- end to end


def _config(protocol, *overrides):
    return resolve_config(
        protocol.training,
        "toy.yaml",
        overrides=["pas.start_epoch=0", "pas.every=1", "method_args.fscil-ss.mc_passes=2", *overrides],
    )


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The toy protocols with and without a pool in session 1, their data, and the shared session-0 model."""
    spec = toy_protocol_dict(2)
    spec["sessions"][1]["unlabelled"] = 4
    pool = parse_protocol(spec, source="toy-pool.yaml")
    plain = parse_protocol(toy_protocol_dict(2), source="toy-2d.yaml")
    root = tmp_path_factory.mktemp("fscilss_bcm")
    data = {"pool": load_or_generate(pool, root / "cache"), "plain": load_or_generate(plain, root / "cache")}
    trainer = ContinualTrainer(pool, _config(pool), Method("base"), data["pool"], progress=False)
    trainer.run_session(0, trainer.new_model(3), PrototypeStore(), root / "s0")
    return {"pool": pool, "plain": plain}, data, root / "s0"


def _session1(protocol, config, method, data, base_dir: Path, out: Path):
    trainer = ContinualTrainer(protocol, config, method, data, progress=False)
    model, store, _ = trainer.load_session(base_dir, 0)
    trainer.restore_session(0, base_dir, model, store)
    trainer.run_session(1, model, store, out)
    return trainer, model, store


class Check(Plugin):
    """Runs ``check(state)`` before every backward pass and keeps what it returns."""

    name = "check"

    def __init__(self, check):
        self.check, self.seen = check, []

    def before_backward(self, state):
        self.seen.append(self.check(state))


def test_fscil_ss_with_a_pool_selects_taught_rows_and_distils(base, tmp_path):
    protocols, data, base_dir = base
    protocol = protocols["pool"]
    config = _config(protocol)
    method = create_method("fscil-ss", config)
    plugin = method.plugins[0]
    kept = []

    class Peek(Plugin):
        name = "peek"

        def after_training(self, state):
            kept.append(plugin.pseudo.clone())

    terms = Check(lambda state: {k: float(v.detach()) for k, v in state.losses.items()})
    method.plugins += [Peek(), terms]
    _session1(protocol, config, method, data["pool"], base_dir, tmp_path / "s1")
    assert len(terms.seen) == 2  # one step per epoch, each an unlabelled phase
    assert all(t["fscilss_kd"] > 0 and t["fscilss_pl"] > 0 for t in terms.seen)
    pseudo = kept[0]
    values = set(pseudo.unique().tolist())
    assert values <= {0, 1, 3, 255} and values - {255}  # background + taught classes 1, 3 (rows 0, 1, 3); not 2
    record = json.loads((tmp_path / "s1" / "metrics.json").read_text())
    stats = record["pseudo_labels"]
    assert stats["method"] == "fscil-ss" and stats["rounds"] == 2
    assert stats["coverage"] == pytest.approx(float((pseudo != 255).float().mean()))
    assert plugin.teacher is None and plugin.pseudo is None  # released after the session


def test_fscil_ss_without_a_pool_is_distillation_only_and_the_term_is_the_pure_function(base, tmp_path):
    protocols, data, base_dir = base
    protocol = protocols["plain"]
    config = _config(protocol)
    method = create_method("fscil-ss", config)
    plugin = method.plugins[0]

    def recompute(state):
        with torch.no_grad():
            teacher = plugin.teacher(state.batch["image"].to(state.device))[:, : plugin.n_old]
        expected = ss_distillation([state.output.logits.detach()], [teacher], plugin.options.temperature)
        return set(state.losses), float(state.losses["fscilss_kd"].detach()), float(expected), plugin.pseudo

    check = Check(recompute)
    method.plugins.append(check)
    _session1(protocol, config, method, data["plain"], base_dir, tmp_path / "s1")
    assert check.seen
    for keys, got, expected, pseudo in check.seen:
        assert "fscilss_pl" not in keys and "fscilss_kd" in keys and pseudo is None
        assert got == pytest.approx(expected, rel=1e-5) and got > 0
    record = json.loads((tmp_path / "s1" / "metrics.json").read_text())
    assert "pseudo_labels" not in record


def test_bcm_keeps_the_base_model_and_refines_its_prediction_with_the_mapped_refiners(base, tmp_path):
    """BCM's defining parts: the base model is not trained again, the novel class is mapped to the base row the
    model predicts most on its pixels, and evaluation predicts the novel class only through that row's refiner."""
    protocols, data, base_dir = base
    protocol = protocols["plain"]
    config = _config(protocol)
    method = create_method("bcm", config)
    (plugin,) = method.plugins
    trainer, model, _ = _session1(protocol, config, method, data["plain"], base_dir, tmp_path / "s1")
    base_model, _, _ = trainer.load_session(base_dir, 0)
    after, before = model.state_dict(), base_model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items() if k in after and after[k].shape == v.shape)
    assert plugin.base_classes == [0, 1, 2]
    record = json.loads((tmp_path / "s1" / "metrics.json").read_text())
    ((session, refiner),) = plugin.refiners
    assert session == 1 and refiner.novel == [3]
    assert record["bcm_mapping"] == {"3": [refiner.base_row]}
    # the head: base rows' argmax, overridden by the refiner where it predicts class 3
    state = type("S", (), {"seen": [0, 1, 2, 3], "session": protocol.sessions[1], "model": model})()
    state.session = type("Sess", (), {"index": 1})()
    head = plugin.head(state)
    features = torch.randn(1, model.classifier.in_channels, 4, 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = head(features)
        base_pred = model.classifier(features)[:, :3].argmax(1)
        x = features.movedim(1, -1).reshape(-1, features.shape[1])
        expected = refine(base_pred.reshape(-1), x, [Refiner(refiner.base_row, [3], refiner.weights)])
    assert logits.shape == (1, 4, 4, 4) and torch.equal(logits.argmax(1).reshape(-1), expected)
    assert set(logits.unique().tolist()) <= {0.0, -30.0}


def test_the_pixel_sample_keeps_the_k_smallest_keys_in_the_order_offered_in_bounded_memory():
    from jascl.methods.baselines.fewshot._shared import PixelSample

    rows = torch.arange(10.0).unsqueeze(1)  # 10 pixels, one feature each: their own index
    sample = PixelSample(3, torch.Generator().manual_seed(5))
    for chunk in (rows[:4], rows[4:5], rows[5:]):
        sample.offer(chunk, chunk[:, 0].long())
        assert len(sample.keys) <= 3  # never more kept than k
    keys = torch.cat([torch.rand(n, generator=g, dtype=torch.float64) for g in [torch.Generator().manual_seed(5)]
                      for n in (4, 1, 5)])  # fmt: skip
    x, y = sample.result()
    expected = keys.topk(3, largest=False).indices.sort().values  # the 3 smallest keys, in the order offered
    assert torch.equal(y, expected) and torch.equal(x[:, 0], expected.double().float())
    few = PixelSample(20, torch.Generator().manual_seed(5))
    few.offer(rows, rows[:, 0])
    assert torch.equal(few.result()[0], rows)  # at most k rows: all of them, as offered
    # uniform: over draws, every one of 10 pixels is kept with probability 3/10 (2000 draws: 600 +- 3 sd of 20.5)
    counts = torch.zeros(10)
    for seed in range(2000):
        s = PixelSample(3, torch.Generator().manual_seed(seed))
        s.offer(rows[:6], torch.arange(6))
        s.offer(rows[6:], torch.arange(6, 10))
        counts[s.result()[1]] += 1
    assert counts.sum() == 6000 and bool(((counts - 600).abs() < 62).all()), counts
