"""FACT (Zhou et al., CVPR 2022): the virtual-class loss, the mixing rule, the forecasting loss and the bimodal
prediction on hand-made tensors, then the method end to end on the toy two-session protocol."""

import copy
import math

import pytest
import torch
from safetensors.torch import load_file

from jascl.engine.config import resolve_config
from jascl.engine.loop import ContinualTrainer
from jascl.engine.prototypes import PrototypeStore, align_labels
from jascl.errors import ConfigError
from jascl.methods import Method, Plugin
from jascl.methods.baselines.fewshot.fact import (
    FACTHead,
    FACTOptions,
    FACTPlugin,
    VirtualRowsClassifier,
    bimodal_probabilities,
    forecast_instances,
    forecast_loss,
    virtual_class_loss,
    virtual_estimate,
)
from jascl.methods.registry import create_method
from jascl.networks.classifier import PixelClassifier
from jascl.protocols.schema import IGNORE_INDEX

# ----------------------------------------------------------------------------- virtual-class loss


def test_virtual_class_loss_masks_the_ground_truth_and_targets_the_most_likely_virtual_class():
    # K = 2 real rows, V = 2 virtual rows; label 0
    # logits (9, 0, 1, 0): the ground truth (9) is masked -> (-1e9, 0, 1, 0); y_hat = 2 + argmax(1, 0) = 2
    # CE = log(e^0 + e^1 + e^0) - 1 = log(2 + e) - 1
    logits = torch.tensor([[9.0, 0.0, 1.0, 0.0]])
    assert virtual_class_loss(logits, torch.tensor([0]), 2).item() == pytest.approx(math.log(2 + math.e) - 1, rel=1e-6)
    # the pseudo label is the best *virtual* row even when a real row is higher:
    # logits (0, 5, 1, 3), label 0 -> masked (-1e9, 5, 1, 3), y_hat = 2 + argmax(1, 3) = 3
    # CE = log(e^5 + e^1 + e^3) - 3
    logits = torch.tensor([[0.0, 5.0, 1.0, 3.0]])
    expected = math.log(math.exp(5) + math.exp(1) + math.exp(3)) - 3
    assert virtual_class_loss(logits, torch.tensor([0]), 2).item() == pytest.approx(expected, rel=1e-6)


def test_virtual_class_loss_is_a_pixel_mean_leaves_ignored_pixels_out_and_accepts_3d():
    # two labelled pixels of a (1, 4, 1, 1, 3) volume, the third ignored
    # pixel a: (9, 0, 1, 0), label 0 -> log(2 + e) - 1 (as above)
    # pixel b: (0, 2, 0, 0), label 1 -> masked (0, -1e9, 0, 0), y_hat = 2 (first of the tied virtual rows)
    #          CE = log(e^0 + e^0 + e^0) - 0 = log 3
    a = [9.0, 0.0, 1.0, 0.0]
    b = [0.0, 2.0, 0.0, 0.0]
    c = [100.0, -100.0, 50.0, 0.0]
    logits = torch.tensor([a, b, c]).t().reshape(1, 4, 1, 1, 3)
    target = torch.tensor([0, 1, IGNORE_INDEX]).reshape(1, 1, 1, 3)
    expected = (math.log(2 + math.e) - 1 + math.log(3)) / 2
    assert virtual_class_loss(logits, target, 2).item() == pytest.approx(expected, rel=1e-6)
    # no labelled pixel: 0, still attached to the logits
    empty = virtual_class_loss(logits.requires_grad_(), torch.full((1, 1, 1, 3), IGNORE_INDEX), 2)
    assert empty.item() == 0.0 and empty.requires_grad


def test_virtual_class_loss_gradient_pulls_the_chosen_virtual_row_and_not_the_masked_one():
    logits = torch.tensor([[9.0, 0.0, 1.0, 0.0]], requires_grad=True)
    virtual_class_loss(logits, torch.tensor([0]), 2).backward()
    grad = logits.grad[0]
    # d CE / d logit = softmax - onehot(y_hat): the masked ground truth gets 0, y_hat (row 2) a negative gradient
    assert grad[0].item() == 0.0
    assert grad[2].item() == pytest.approx(math.e / (2 + math.e) - 1, rel=1e-5)
    assert grad[1].item() == pytest.approx(1 / (2 + math.e), rel=1e-5)


# ----------------------------------------------------------------------------- mixing rule and forecasting loss


def test_forecast_instances_mix_pairs_of_different_classes_only():
    features = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    labels = torch.tensor([0, 1, 1])
    anchors, partners = torch.tensor([0, 1, 2]), torch.tensor([1, 2, 0])
    mixed = forecast_instances(features, labels, anchors, partners, 0.25)
    # pair (0, 1), classes 0 != 1: 0.25 (1, 0) + 0.75 (0, 1) = (0.25, 0.75)
    # pair (1, 2), one class: dropped
    # pair (2, 0), classes 1 != 0: 0.25 (1, 1) + 0.75 (1, 0) = (1, 0.25)
    assert mixed.tolist() == [[0.25, 0.75], [1.0, 0.25]]
    assert forecast_instances(features, torch.zeros(3, dtype=torch.long), anchors, partners, 0.5).shape == (0, 2)


def test_forecast_loss_hand_value_and_empty_batch():
    # K = 2: logits (2, 0, 1, 3); y_v = 2 + argmax(1, 3) = 3; y_r = argmax(2, 0) = 0
    # CE(f, 3) = log(e^2 + e^0 + e^1 + e^3) - 3
    # CE(Mask(f, 3), 0) = log(e^2 + e^0 + e^1) - 2   (the virtual row 3 masked)
    e = math.exp
    expected = (math.log(e(2) + 1 + e(1) + e(3)) - 3) + (math.log(e(2) + 1 + e(1)) - 2)
    assert forecast_loss(torch.tensor([[2.0, 0.0, 1.0, 3.0]]), 2).item() == pytest.approx(expected, rel=1e-6)
    empty = torch.zeros(0, 4, requires_grad=True)
    value = forecast_loss(empty, 2)
    assert value.item() == 0.0 and value.requires_grad


# ----------------------------------------------------------------------------- bimodal prediction


def test_virtual_estimate_hand_values_and_top_k():
    x = torch.tensor([[3.0, 4.0]])  # n(x) = (0.6, 0.8)
    virtual = torch.tensor([[1.0, 0.0], [0.0, 2.0]])  # n(P) = identity
    rows = torch.tensor([[1.0, 0.0], [1.0, 1.0]])  # n(W) = (1, 0), (1, 1)/sqrt(2)
    r = 1 / math.sqrt(2)
    # similarities (0.6, 0.8); relation n(P) n(W)^T = [[1, r], [0, r]]
    # all kept: (0.6, 0.8) @ relation = (0.6, 0.6 r + 0.8 r)
    assert virtual_estimate(x, rows, virtual, topk=2)[0].tolist() == pytest.approx([0.6, 1.4 * r], rel=1e-6)
    # top-1 keeps only 0.8: (0, 0.8) @ relation = (0, 0.8 r)
    assert virtual_estimate(x, rows, virtual, topk=1)[0].tolist() == pytest.approx([0.0, 0.8 * r], abs=1e-7)
    # dense 3D input gives the same per voxel
    dense = x.view(1, 2, 1, 1, 1).expand(1, 2, 2, 1, 3)
    out = virtual_estimate(dense, rows, virtual, topk=1)
    assert out.shape == (1, 2, 2, 1, 3) and torch.allclose(out[0, :, 1, 0, 2], torch.tensor([0.0, 0.8 * r]))


def test_bimodal_probabilities_hand_value():
    # softmax(0, 0) = (1/2, 1/2); softmax(0, log 3) = (1/4, 3/4); eta 0.5 -> (3/8, 5/8)
    p = bimodal_probabilities(torch.zeros(1, 2), torch.tensor([[0.0, math.log(3.0)]]), 0.5)
    assert p[0].tolist() == pytest.approx([0.375, 0.625], rel=1e-6)
    assert bimodal_probabilities(torch.zeros(1, 2), torch.tensor([[0.0, math.log(3.0)]]), 0.0)[0].tolist() == (
        pytest.approx([0.25, 0.75], rel=1e-6)
    )


def test_fact_head_is_the_log_of_the_bimodal_mixture_of_the_cosine_classifier():
    clf = PixelClassifier(2, 2, cosine=True, temperature=10.0)
    with torch.no_grad():
        clf.weight.copy_(torch.tensor([[1.0, 0.0], [1.0, 1.0]]))
    virtual = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    head = FACTHead(clf, virtual, eta=0.1, topk=2)
    r = 1 / math.sqrt(2)
    # classifier: 10 * (0.6, 0.6 r + 0.8 r); estimate (0.6, 1.4 r) (previous test)
    l2 = torch.tensor([6.0, 14.0 * r])
    s = torch.tensor([0.6, 1.4 * r])
    expected = (0.1 * torch.softmax(s, 0) + 0.9 * torch.softmax(l2, 0)).log()
    out = head(torch.tensor([3.0, 4.0]).view(1, 2, 1, 1))
    assert out.shape == (1, 2, 1, 1) and head.num_classes == 2
    assert torch.allclose(out[0, :, 0, 0], expected, atol=1e-6)


def test_virtual_rows_classifier_gives_real_logits_and_full_logits_with_the_virtual_rows():
    torch.manual_seed(0)
    real = PixelClassifier(3, 2, cosine=True, temperature=10.0)
    virtual = torch.tensor([[0.0, 0.0, 2.0]])
    wrapper = VirtualRowsClassifier(real, virtual)
    x = torch.randn(2, 3, 4, 4)
    assert torch.equal(wrapper(x), real(x)) and wrapper.num_classes == 2
    full = wrapper.full_logits(x)
    assert full.shape == (2, 3, 4, 4)
    assert torch.allclose(full[:, :2], real(x), atol=1e-5)
    # the virtual row (0, 0, 1) after normalisation: 10 * x_2 / |x|
    assert torch.allclose(full[:, 2], 10.0 * x[:, 2] / x.norm(dim=1), atol=1e-5)
    assert {n for n, _ in wrapper.named_parameters()} == {"real.weight", "virtual"}


# ----------------------------------------------------------------------------- options


@pytest.mark.parametrize(
    "override,match",
    [
        ("method_args.fact.eta=2", r"method_args.fact.eta: must be >= 0 and <= 1 \(got 2.0\)"),
        ("method_args.fact.alpha=0", r"method_args.fact.alpha: must be > 0"),
        ("method_args.fact.topk=0", r"method_args.fact.topk: must be >= 1"),
        ("classifier=linear", r"fact: needs classifier=cosine \(got 'linear'\)"),
    ],
)
def test_bad_options_are_one_line_config_errors(override, match):
    with pytest.raises(ConfigError, match=match):
        create_method("fact", resolve_config(overrides=[override]))
    with pytest.raises(ConfigError, match="method_args.fact.balance"):
        FACTPlugin(FACTOptions(balance=-1.0))


# ----------------------------------------------------------------------------- end to end


class Probe(Plugin):
    """Largest |value| of every loss term per session."""

    name = "probe"

    def __init__(self):
        self.terms: dict[int, dict[str, float]] = {}

    def before_backward(self, state):
        terms = self.terms.setdefault(state.session.index, {})
        for key, value in state.losses.items():
            terms[key] = max(terms.get(key, 0.0), abs(float(value.detach())))


class Check(Plugin):
    """Base session, after FACT's after_forward: recomputes both terms from the same tensors with the pure functions."""

    name = "check"

    def __init__(self, fact: FACTPlugin):
        self.fact = fact
        self.compared = 0
        self.virtual_at_start = None

    def before_session(self, state):
        if state.session.index == 0:
            self.virtual_at_start = self.fact._wrapper.virtual.detach().clone()

    def before_iteration(self, state):
        self.generator_state = self.fact._generator.get_state()
        self.rng = copy.deepcopy(self.fact._rng)

    def after_forward(self, state):
        if state.session.index != 0:
            return
        wrapper, o = self.fact._wrapper, self.fact.options
        features = state.output.features
        target = align_labels(state.target, features.shape[2:])
        expected_virtual = o.balance * virtual_class_loss(wrapper.full_logits(features), target, 3)
        assert torch.allclose(state.losses["fact_virtual"], expected_virtual)
        generator = torch.Generator().set_state(self.generator_state)
        lam = float(self.rng.beta(o.alpha, o.alpha))
        y = target.reshape(-1)
        pixels = features.movedim(1, -1).reshape(-1, features.shape[1])[y != IGNORE_INDEX]
        y = y[y != IGNORE_INDEX]
        anchors = torch.randperm(len(y), generator=generator)
        partners = torch.randperm(len(y), generator=generator)
        mixed = forecast_instances(pixels, y, anchors, partners, lam)
        assert mixed.shape[0] > 0
        expected_forecast = o.balance * forecast_loss(wrapper.full_logits(mixed), 3)
        assert torch.allclose(state.losses["fact_forecast"], expected_forecast)
        self.compared += 1


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """FACT with the checks, sessions 0 and 1 of the toy protocol, each into its folder."""
    from conftest import toy_protocol_dict
    from jascl.data.synthetic import load_or_generate
    from jascl.protocols import parse_protocol

    protocol = parse_protocol(toy_protocol_dict(2), source="toy-2d.yaml")
    config = resolve_config(protocol.training, "toy-2d.yaml")
    root = tmp_path_factory.mktemp("fact")
    data = load_or_generate(protocol, root / "cache")
    fact = FACTPlugin()
    check, probe = Check(fact), Probe()
    trainer = ContinualTrainer(protocol, config, Method("fact", [fact, check, probe]), data, progress=False)
    model, store = trainer.new_model(3), PrototypeStore()
    records = [trainer.run_session(t, model, store, root / f"s{t}") for t in (0, 1)]
    return trainer, data, root, records, fact, check, probe


def test_fact_terms_act_in_the_base_session_only_and_are_the_pure_functions(run):
    trainer, data, root, records, fact, check, probe = run
    assert all(0.0 <= r["all"] <= 1.0 for r in records)
    assert probe.terms[0]["fact_virtual"] > 0.0 and probe.terms[0]["fact_forecast"] > 0.0
    assert check.compared == 2  # 8 images, batch 4, one base epoch: both steps recomputed
    assert set(probe.terms[1]) == {"seg"}  # training-free incremental session: no FACT term
    assert FACTPlugin.base_loss_terms == ("fact_virtual", "fact_forecast") and FACTPlugin.changes_base_session
    assert not torch.equal(fact.virtual, check.virtual_at_start)  # the virtual rows were trained


def test_fact_incremental_session_is_training_free_and_checkpoints_stay_standard(run):
    trainer, data, root, records, fact, check, probe = run
    s0 = load_file(root / "s0" / "model.safetensors")
    s1 = load_file(root / "s1" / "model.safetensors")
    assert all(torch.equal(s0[k], s1[k]) for k in s0 if k != "classifier.weight")  # frozen backbone, lr 0
    assert torch.equal(s1["classifier.weight"][:3], s0["classifier.weight"])  # base rows untouched
    assert not any("virtual" in k for k in s1) and s1["classifier.weight"].shape == (4, 8)
    extra = load_file(root / "s0" / "plugins.safetensors")
    assert set(extra) == {"0.fact.virtual"}
    assert extra["0.fact.virtual"].shape == (1, 8)  # the toy protocol adds one class (3) after session 0
    assert torch.equal(load_file(root / "s1" / "plugins.safetensors")["0.fact.virtual"], extra["0.fact.virtual"])


def test_fact_base_rows_are_the_class_prototypes(run):
    trainer, data, root, records, fact, check, probe = run
    model, _, _ = trainer.load_session(root / "s0", 0)
    protos = trainer.compute_prototypes(model, 0, [0, 1, 2])
    expected = torch.nn.functional.normalize(torch.stack([protos[c] for c in (0, 1, 2)]), dim=1)
    assert torch.allclose(model.classifier.weight, expected, atol=1e-6)


def test_fact_session_1_prediction_is_the_bimodal_head(run):
    """Re-evaluating the saved session-1 model with the head built from the saved virtual rows gives the record."""
    from jascl.engine.checkpoint import load_tensors
    from jascl.evaluation.evaluator import evaluate

    trainer, data, root, records, _, _, _ = run
    config = trainer.config
    plugin = FACTPlugin()
    plugin.load_extra_state(
        {k.split(".", 2)[2]: v for k, v in load_tensors(root / "s1" / "plugins.safetensors").items()}
    )
    model, store, record = trainer.load_session(root / "s1", 1)
    state = trainer.loop_state(1, model, store)
    plugin.before_eval(state)
    assert isinstance(model.classifier, FACTHead)
    result = evaluate(
        model,
        [d.test for d in data[:2]],
        state.seen,
        trainer.device,
        roi=config.patch_size,
        batch_size=config.batch_size,
    )
    plugin.after_eval(state)
    assert isinstance(model.classifier, PixelClassifier)
    assert {str(k): v for k, v in result.dice.items()} == pytest.approx(record["dice"], nan_ok=True)
