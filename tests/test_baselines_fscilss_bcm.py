"""FSCIL-SS and BCM (few-shot baselines acting in incremental sessions only).

Pure rules on hand-computed tiny tensors; each plugin on the toy two-session protocol (session 0 trained
once for the module, session 1 with the method), FSCIL-SS with and without an unlabelled pool.
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
from jascl.methods.baselines.fewshot.bcm import (
    mine_relevant_base_classes,
    relevant_anchor_loss,
    relevant_logit_constraint,
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


def test_mining_takes_the_most_similar_base_prototypes_with_softmax_weights():
    novel = torch.tensor([[1.0, 0.0]])
    base = torch.tensor([[2.0, 0.0], [0.0, 1.0], [1.0, 1.0]])  # cosines with novel: 1, 0, 1/sqrt 2
    index, weight = mine_relevant_base_classes(novel, base, top_k=2, temperature=0.1)
    assert index.tolist() == [[0, 2]]
    w0 = 1 / (1 + math.exp(-(1 - 1 / math.sqrt(2)) / 0.1))  # softmax(10, 7.071)[0] = 0.949282
    assert weight[0].tolist() == pytest.approx([w0, 1 - w0], abs=1e-5)
    # top_k above the number of base classes is clipped; every row sums to 1
    index, weight = mine_relevant_base_classes(novel, base, top_k=5, temperature=0.1)
    assert index.tolist() == [[0, 2, 1]] and weight.sum().item() == pytest.approx(1.0)
    # ties keep the lower index first and share the weight equally
    index, weight = mine_relevant_base_classes(torch.tensor([[1.0, 1.0]]), base[:2], top_k=2, temperature=0.5)
    assert index.tolist() == [[0, 1]] and weight[0].tolist() == pytest.approx([0.5, 0.5])


def test_relevant_logit_constraint_acts_on_novel_pixels_and_relevant_rows_only():
    # 1 x 3 pixels; rows 0..3; novel row 3 at pixel 0 only (pixel 2 ignored)
    target = torch.tensor([[[3, 0, 255]]])
    teacher = torch.zeros(1, 3, 1, 3)
    teacher[0, 1, 0, 0] = 1.0
    student = torch.zeros(1, 4, 1, 3)
    student[0, 1, 0, 0], student[0, 2, 0, 0] = 2.0, 1.0  # diffs at pixel 0: row 1 -> 1, row 2 -> 1
    student[0, 0, 0, 0] = 5.0  # row 0 is not relevant: no effect
    student[0, 1, 0, 1] = 9.0  # pixel 1 is background: no effect
    relevant, weight = torch.tensor([[1, 2]]), torch.tensor([[0.75, 0.25]])
    # 0.75 * (2 - 1)^2 + 0.25 * (1 - 0)^2 = 1.0 over one pixel
    value = relevant_logit_constraint(student, teacher, target, [3], relevant, weight)
    assert value.item() == pytest.approx(1.0)
    # two novel pixels share one mean: pixel 1 labelled 3 too with zero change -> 1.0 / 2
    student_p1 = student.clone()
    student_p1[0, 1, 0, 1] = 0.0
    both = relevant_logit_constraint(student_p1, teacher, torch.tensor([[[3, 3, 255]]]), [3], relevant, weight)
    assert both.item() == pytest.approx(0.5)
    # no novel pixel: 0, still attached to the student's graph
    s = student.clone().requires_grad_(True)
    none = relevant_logit_constraint(s, teacher, torch.tensor([[[0, 0, 255]]]), [3], relevant, weight)
    assert none.item() == 0.0 and none.requires_grad
    # 3D (B, K, D, H, W)
    vol = relevant_logit_constraint(
        student.view(1, 4, 1, 1, 3), teacher.view(1, 3, 1, 1, 3), target.view(1, 1, 1, 3), [3], relevant, weight
    )
    assert vol.item() == pytest.approx(1.0)


def test_relevant_anchor_loss_hand_value():
    rows = torch.tensor([[0.0, 0.0], [1.0, 1.0], [2.0, 0.0], [5.0, 5.0]])
    anchors = torch.tensor([[0.0, 0.0], [0.0, 1.0], [2.0, 2.0]])
    # 0.75 * |(1,1)-(0,1)|^2 + 0.25 * |(2,0)-(2,2)|^2 = 0.75 + 1.0; row 3 (novel) is never anchored
    assert relevant_anchor_loss(rows, anchors, torch.tensor([[1, 2]]), torch.tensor([[0.75, 0.25]])).item() == (
        pytest.approx(1.75)
    )
    # a base row relevant to two novel classes counts once per class
    two = relevant_anchor_loss(rows, anchors, torch.tensor([[1], [1]]), torch.tensor([[1.0], [0.5]]))
    assert two.item() == pytest.approx(1.5)


def test_options_are_checked():
    protocol = parse_protocol(toy_protocol_dict(2), source="toy-2d.yaml")
    with pytest.raises(ConfigError, match="method_args.fscil-ss"):
        create_method(
            "fscil-ss", resolve_config(protocol.training, "x.yaml", overrides=["method_args.fscil-ss.dropout=1"])
        )
    with pytest.raises(ConfigError, match="method_args.bcm"):
        create_method("bcm", resolve_config(protocol.training, "x.yaml", overrides=["method_args.bcm.top_k=0"]))


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


def test_bcm_mines_by_prototype_similarity_and_its_terms_are_the_pure_functions(base, tmp_path):
    protocols, data, base_dir = base
    protocol = protocols["plain"]
    config = _config(protocol)
    method = create_method("bcm", config)
    plugin = method.plugins[0]
    mined = {}

    class Mine(Plugin):
        name = "mine"

        def before_session(self, state):
            if state.session.index == 1:  # the same session-start model the plugin mined with
                novel = state.compute_prototypes([3])[3].cpu()
                base_protos = torch.stack([state.prototypes.entries[(0, c)] for c in (1, 2)])
                mined["expected"] = mine_relevant_base_classes(novel[None], base_protos, 3, 0.1)
                mined["anchor"] = plugin.teacher.classifier.weight.detach().clone()

    def recompute(state):
        with torch.no_grad():
            teacher = plugin.teacher(state.batch["image"].to(state.device))[:, : plugin.num_old]
        logit = relevant_logit_constraint(
            state.output.logits.detach(), teacher, state.target, [3], plugin.relevant_rows, plugin.relevance
        )
        anchor = relevant_anchor_loss(
            state.model.classifier.weight.detach(), mined["anchor"], plugin.relevant_rows, plugin.relevance
        )
        return {k: float(v.detach()) for k, v in state.losses.items()}, float(logit), float(anchor)

    check = Check(recompute)
    method.plugins += [Mine(), check]
    _, model, _ = _session1(protocol, config, method, data["plain"], base_dir, tmp_path / "s1")

    # rows: seen = [0, 1, 2, 3] -> class c is row c; top_k 3 is clipped to the 2 base classes
    index, weight = mined["expected"]
    assert plugin.relevant_rows is None  # released after the session
    record = json.loads((tmp_path / "s1" / "metrics.json").read_text())
    relevance = record["bcm_relevance"]["3"]
    assert [c for c, _ in relevance] == [[1, 2][int(i)] for i in index[0]]
    assert [w for _, w in relevance] == pytest.approx(weight[0].tolist(), abs=1e-6)
    assert sum(w for _, w in relevance) == pytest.approx(1.0)
    # each step's terms are the pure functions on the step's tensors; both act by the second step
    for terms, logit, anchor in check.seen:
        assert terms["bcm_logit"] == pytest.approx(logit, rel=1e-5, abs=1e-12)
        assert terms["bcm_anchor"] == pytest.approx(anchor, rel=1e-5, abs=1e-12)
    assert check.seen[0][0]["bcm_anchor"] == 0.0  # rows start at their anchors
    assert check.seen[-1][0]["bcm_anchor"] > 0 and check.seen[-1][0]["bcm_logit"] > 0
