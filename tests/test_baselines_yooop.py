"""YoooP / YoooP+ (replay family): hand-computed values of the pure functions, then both methods end to end on the
toy two-session protocol."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from jascl.engine.config import resolve_config
from jascl.errors import ConfigError
from jascl.experiments.runner import run_benchmark
from jascl.methods import Plugin
from jascl.methods.baselines.replay._yooop_prototypes import (
    attention_weights,
    attentional_mean_shift,
    cosine_histogram,
    feature_distillation,
    fit_prototypes,
    optimize_prototypes,
    pixels,
    prototype_loss,
    sample_angular_features,
)
from jascl.methods.baselines.replay.yooop import YoooPPlugin
from jascl.methods.registry import create_method
from jascl.methods.replay import prototype_replay_loss
from jascl.networks.classifier import PixelClassifier

E = math.e


# ----------------------------------------------------------------------------- attention and mean-shift


def test_attention_weights_hand_values():
    z = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    # cosines to p = (1, 0): 1 and 0; softmax at temperature 1: e / (e + 1), 1 / (e + 1)
    w = attention_weights(z, torch.tensor([2.0, 0.0]), temperature=1.0)
    assert torch.allclose(w, torch.tensor([E / (E + 1), 1 / (E + 1)]))
    # temperature 0.5 doubles the cosines: e^2 / (e^2 + 1)
    w = attention_weights(z, torch.tensor([1.0, 0.0]), temperature=0.5)
    assert w[0].item() == pytest.approx(E**2 / (E**2 + 1))


def test_attentional_mean_shift_one_step_hand_value_and_moves_to_the_dense_region():
    z = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    # one step from (1, 0): sum = (e/(e+1), 1/(e+1)) ∝ (e, 1); normalised (e, 1) / sqrt(e^2 + 1)
    p = attentional_mean_shift(z, torch.tensor([1.0, 0.0]), temperature=1.0, steps=1)
    assert torch.allclose(p, torch.tensor([E, 1.0]) / math.sqrt(E**2 + 1))
    # zero steps from None: the normalised mean (1, 1) / sqrt 2
    assert torch.allclose(attentional_mean_shift(z, None, 1.0, 0), torch.tensor([1.0, 1.0]) / math.sqrt(2))
    # three pixels at 10 degrees around (1, 0) and one outlier at 90 degrees: the mean-shift ends closer to the
    # dense direction than the plain mean does
    a = math.radians(10)
    dense = torch.tensor([[math.cos(a), math.sin(a)], [math.cos(a), -math.sin(a)], [1.0, 0.0], [0.0, 1.0]])
    mean = F.normalize(dense.mean(0), dim=0)
    shifted = attentional_mean_shift(dense, None, temperature=0.1, steps=5)
    assert shifted[0] > mean[0] and shifted[1] < mean[1]
    assert shifted.norm().item() == pytest.approx(1.0)


def test_attentional_mean_shift_of_one_pixel_is_that_pixel():
    z = F.normalize(torch.tensor([[3.0, -4.0, 12.0]]), dim=1)
    assert torch.allclose(attentional_mean_shift(z, torch.tensor([1.0, 0.0, 0.0]), 0.1, 3), z[0])


# ----------------------------------------------------------------------------- prototype loss


def test_prototype_loss_hand_value():
    z = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
    labels = torch.tensor([1, 2, 2])
    protos = torch.tensor([[5.0, 0.0]])  # normalised to (1, 0)
    # s = (1, 0, 0); L = logsumexp(1, 0, 0) - logsumexp(1) = log(e + 2) - 1
    loss = prototype_loss(z, labels, protos, [1], temperature=1.0)
    assert loss.item() == pytest.approx(math.log(E + 2) - 1)
    # two prototypes: class 2's p = (0, 1): s = (0, 1, 1); L = log(1 + 2e) - log(2e); the mean of both
    both = prototype_loss(z, labels, torch.tensor([[1.0, 0.0], [0.0, 1.0]]), [1, 2], temperature=1.0)
    expected = ((math.log(E + 2) - 1) + (math.log(1 + 2 * E) - math.log(2 * E))) / 2
    assert both.item() == pytest.approx(expected)


def test_prototype_loss_skips_classes_without_pixels_and_is_zero_with_a_graph_when_none_has():
    z = torch.tensor([[1.0, 0.0], [0.0, 1.0]], requires_grad=True)
    labels = torch.tensor([1, 0])
    protos = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    only = prototype_loss(z, labels, protos[:1], [1], 1.0)
    # class 7 has no pixel: left out of the mean
    assert prototype_loss(z, labels, protos, [1, 7], 1.0).item() == pytest.approx(only.item())
    none = prototype_loss(z, labels, protos, [5, 7], 1.0)
    assert none.item() == 0.0 and none.requires_grad
    # an absent class leaves the gradient finite (no NaN from its empty -inf column)
    prototype_loss(z, labels, protos, [1, 7], 1.0).backward()
    assert torch.isfinite(z.grad).all() and z.grad.abs().sum() > 0


def test_prototype_loss_pulls_own_pixels_and_pushes_the_others():
    z = F.normalize(torch.tensor([[1.0, 0.2], [0.3, 1.0]]), dim=1).requires_grad_(True)
    p = torch.tensor([[1.0, 0.0]])
    prototype_loss(z, torch.tensor([1, 0]), p, [1], 0.5).backward()
    g = z.grad
    # gradient descent raises the own pixel's similarity to p and lowers the other pixel's
    assert (-g[0] @ p[0]).item() > 0 and (-g[1] @ p[0]).item() < 0


def test_optimize_prototypes_lowers_the_loss_and_keeps_unit_rows():
    gen = torch.Generator().manual_seed(0)
    a = F.normalize(torch.tensor([1.0, 0.0, 0.0]) + 0.3 * torch.randn(50, 3, generator=gen), dim=1)
    b = F.normalize(torch.tensor([0.6, 0.8, 0.0]) + 0.3 * torch.randn(50, 3, generator=gen), dim=1)
    z, labels = torch.cat([a, b]), torch.tensor([1] * 50 + [2] * 50)
    start = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 1.0]])  # a poor start, orthogonal-ish to both
    before = prototype_loss(z, labels, start, [1, 2], 0.1).item()
    p = optimize_prototypes(z, labels, start, [1, 2], 0.1, steps=50, lr=0.05)
    assert prototype_loss(z, labels, p, [1, 2], 0.1).item() < before - 0.1
    assert torch.allclose(p.norm(dim=1), torch.ones(2))
    assert torch.equal(optimize_prototypes(z, labels, start, [1, 2], 0.1, steps=0, lr=0.05), start)


# ----------------------------------------------------------------------------- YoooP+ angular distribution


def test_cosine_histogram_hand_values():
    p = torch.tensor([1.0, 0.0])
    # cosines 1, 0, 0, -0.5 -> 4 bins over [-1, 1]: [-1, -.5) [-.5, 0) [0, .5) [.5, 1]
    z = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, -1.0], [-0.5, math.sqrt(0.75)]])
    assert torch.allclose(cosine_histogram(z, p, 4), torch.tensor([0.0, 0.25, 0.5, 0.25], dtype=torch.float64))


def test_sampled_cosines_follow_the_stored_distribution():
    d, bins, n = 16, 10, 20000
    p = F.normalize(torch.arange(1.0, d + 1), dim=0)
    hist = torch.zeros(bins, dtype=torch.float64)
    hist[7], hist[9] = 0.25, 0.75  # cosines in [0.4, 0.6) a quarter of the time, [0.8, 1] the rest
    out = sample_angular_features(p, hist, n, torch.Generator().manual_seed(3))
    assert out.shape == (n, d) and torch.allclose(out.norm(dim=1), torch.ones(n), atol=1e-5)
    cos = out @ p
    in7 = ((cos >= 0.4 - 1e-5) & (cos < 0.6 + 1e-5)).float().mean().item()
    in9 = (cos >= 0.8 - 1e-5).float().mean().item()
    assert in7 + in9 == pytest.approx(1.0)  # nothing outside the two bins
    # binomial(20000, 0.25): std 0.003; 0.02 is > 6 std
    assert in7 == pytest.approx(0.25, abs=0.02)
    # the histogram of the samples is the stored one, and uniform inside a bin (mean of bin 9 ~ 0.9)
    assert torch.allclose(cosine_histogram(out, p, bins), hist, atol=0.02)
    assert cos[cos >= 0.8 - 1e-5].mean().item() == pytest.approx(0.9, abs=0.01)
    # seeded: the same generator state gives the same samples
    again = sample_angular_features(p, hist, n, torch.Generator().manual_seed(3))
    assert torch.equal(out, again)


def test_sampled_directions_are_spread_not_a_single_point():
    p = torch.tensor([0.0, 0.0, 1.0])
    hist = torch.zeros(4, dtype=torch.float64)
    hist[3] = 1.0  # cosine in [0.5, 1]
    out = sample_angular_features(p, hist, 2000, torch.Generator().manual_seed(0))
    # the orthogonal parts point everywhere around p: their mean is near 0
    assert out[:, :2].mean(0).norm().item() < 0.05


# ----------------------------------------------------------------------------- replay and distillation


def test_replay_loss_hand_value_through_a_linear_classifier():
    clf = PixelClassifier(2, 3, cosine=False)
    with torch.no_grad():
        clf.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]))
        clf.bias.zero_()
    # feature (2, 0) -> logits (2, 0, 0); CE to row 0 = log(e^2 + 2) - 2; to row 1 = log(e^2 + 2)
    feats = torch.tensor([[2.0, 0.0], [2.0, 0.0]])
    loss = prototype_replay_loss(clf, feats, torch.tensor([0, 1]), reduction="mean")
    assert loss.item() == pytest.approx(((math.log(E**2 + 2) - 2) + math.log(E**2 + 2)) / 2, rel=1e-5)


def test_feature_distillation_hand_value_2d_and_3d():
    s = torch.zeros(1, 2, 1, 2)
    t = torch.zeros(1, 2, 1, 2)
    s[0, :, 0, 0] = torch.tensor([3.0, 0.0])
    t[0, :, 0, 0] = torch.tensor([0.0, 4.0])
    # pixel distances 5 and 0 -> mean 2.5
    assert feature_distillation(s, t).item() == pytest.approx(2.5)
    assert feature_distillation(s.unsqueeze(-1), t.unsqueeze(-1)).item() == pytest.approx(2.5)  # 3D


def test_pixels_flattens_2d_and_3d_in_label_order():
    f = torch.arange(2 * 3 * 2 * 2 * 2.0).reshape(2, 3, 2, 2, 2)  # (B, D, 2, 2, 2)
    rows = pixels(f)
    assert rows.shape == (16, 3)
    assert torch.equal(rows[5], f[0, :, 1, 0, 1])  # pixel (b=0, 1, 0, 1) = flat index 4 + 0 + 1


def test_fit_prototypes_stores_unit_prototypes_norms_and_histograms_of_taught_classes_only():
    gen = torch.Generator().manual_seed(1)
    gathered = {
        0: 2.0 * F.normalize(torch.randn(30, 4, generator=gen), dim=1),
        1: 3.0 * F.normalize(torch.tensor([1.0, 0, 0, 0]) + 0.2 * torch.randn(30, 4, generator=gen), dim=1),
    }
    fitted = fit_prototypes(gathered, [1, 9], 0.1, mean_shift_steps=3, optimize_steps=5, lr=0.05, bins=20)
    assert set(fitted) == {1}  # class 9 has no pixel; background is never an anchor
    c = fitted[1]
    assert c.norm == pytest.approx(3.0)
    assert c.prototype.norm().item() == pytest.approx(1.0) and c.prototype[0] > 0.9
    assert c.histogram.sum().item() == pytest.approx(1.0) and c.histogram[:10].sum() == 0  # all cosines > 0


@pytest.mark.parametrize(
    "override,match",
    [
        ("method_args.yooop.temperature=0", r"method_args.yooop.temperature: must be > 0 \(got 0.0\)"),
        ("method_args.yooop.momentum=2", r"method_args.yooop.momentum: must be >= 0 and <= 1 \(got 2.0\)"),
        ("method_args.yooop-plus.synthetic_per_class=0", "method_args.yooop-plus.synthetic_per_class: must be >= 1"),
        ("method_args.yooop.freeze=partial", "method_args.yooop.freeze: must be one of config, none"),
    ],
)
def test_bad_options_are_one_line_config_errors(override, match):
    name = override.split(".")[1]
    with pytest.raises(ConfigError, match=match):
        create_method(name, resolve_config(overrides=[override]))


# ----------------------------------------------------------------------------- end to end


class ReplayProbe(Plugin):
    """Per session, the largest |loss term|; in session 1 the replay term recomputed from the plugin's store."""

    name = "probe"

    def __init__(self, plugin_name):
        self.plugin_name = plugin_name
        self.terms: dict[int, dict[str, float]] = {}
        self.replay_checks: list[tuple[float, float]] = []

    def after_forward(self, state):
        plugin = next(p for p in self.method.plugins if p.name == self.plugin_name)
        if state.session.index == 1 and plugin.o.synthetic_per_class == 0:
            feats = torch.stack([plugin.store[c].prototype * plugin.store[c].norm for c in plugin._replay_ids])
            rows = torch.tensor([state.seen.index(c) for c in plugin._replay_ids])
            expected = plugin.o.replay_weight * prototype_replay_loss(
                state.model.classifier, feats, rows, reduction="mean"
            )
            self.replay_checks.append((float(state.losses["yooop_replay"].detach()), float(expected.detach())))

    def before_backward(self, state):
        terms = self.terms.setdefault(state.session.index, {})
        for key, value in state.losses.items():
            terms[key] = max(terms.get(key, 0.0), abs(float(value.detach())))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from conftest import toy_protocol_dict
    from jascl.protocols import parse_protocol

    protocol = parse_protocol(toy_protocol_dict(2), source="toy-2d.yaml")
    # fewer fitting steps than the defaults keep the test short; the behaviour checked is the same
    fast = {"optimize_steps": 10, "mean_shift_steps": 2}
    config = dataclasses.replace(
        resolve_config(protocol.training, "toy-2d.yaml"), method_args={"yooop": fast, "yooop-plus": fast}
    )
    root = tmp_path_factory.mktemp("yooop")
    out = {}
    for name, plugin_name in (("yooop", "yooop"), ("yooop-plus", "yooop-plus")):
        probe = ReplayProbe(plugin_name)
        method = create_method(name, config)
        probe.method = method
        results = run_benchmark(
            protocol,
            config,
            [method],
            root / "run",
            cache_dir=root / "cache",
            progress=False,
            echo=lambda *a: None,
            extra_plugins=[probe],
        )
        out[name] = (results, probe)
    return protocol, config, root, out


@pytest.mark.parametrize("name", ["yooop", "yooop-plus"])
def test_shares_the_base_and_its_terms_act_in_session_1_only(name, runs):
    protocol, config, root, out = runs
    results, probe = out[name]
    sessions = results["methods"][name]["sessions"]
    assert len(sessions) == 2 and all(0.0 <= s["all"] <= 1.0 for s in sessions)
    prefix = name.replace("-", "_")
    keys = {f"{prefix}_proto", f"{prefix}_replay", f"{prefix}_kd"}
    assert keys.isdisjoint(probe.terms.get(0, {}))  # the shared base is not retrained with the method
    assert all(probe.terms[1][k] > 0.0 for k in keys)
    assert not (root / "run" / name / "s0-base").exists()  # no own base session folder


@pytest.mark.parametrize("name", ["yooop", "yooop-plus"])
def test_stores_one_unit_prototype_norm_and_histogram_per_class(name, runs):
    protocol, config, root, out = runs
    extra = load_file(root / "run" / name / "s1-inc" / "plugins.safetensors")
    key = f"0.{name}."
    for c in (1, 2, 3):  # base classes 1, 2 (fitted on the shared base), class 3 taught in session 1
        p = extra[f"{key}c{c}.prototype"]
        assert p.shape == (8,) and p.norm().item() == pytest.approx(1.0, abs=1e-5)  # 8 toy feature channels
        assert extra[f"{key}c{c}.norm"].item() > 0
        assert extra[f"{key}c{c}.histogram"].sum().item() == pytest.approx(1.0)
    assert not any(k.startswith(f"{key}c0.") for k in extra)  # background has no prototype


def test_yooop_replay_term_is_the_cross_entropy_of_the_stored_scaled_prototypes(runs):
    _, _, _, out = runs
    _, probe = out["yooop"]
    assert probe.replay_checks
    for got, expected in probe.replay_checks:
        assert got == pytest.approx(expected, rel=1e-5)


def test_plugin_extra_state_round_trip():
    plugin = YoooPPlugin()
    from jascl.methods.baselines.replay._yooop_prototypes import ClassPrototype

    plugin.store = {4: ClassPrototype(torch.tensor([0.6, 0.8]), 2.5, torch.tensor([0.5, 0.5], dtype=torch.float64))}
    other = YoooPPlugin()
    other.load_extra_state(plugin.extra_state())
    assert set(other.store) == {4} and other.store[4].norm == 2.5
    assert torch.equal(other.store[4].prototype, plugin.store[4].prototype)
    assert torch.equal(other.store[4].histogram, plugin.store[4].histogram)
