"""Regularisation and sharpness baselines: EWC, online EWC, UCL, dropout + weight decay, Adagrad, SAM, C-Flat, STAR.

Pure functions are checked against hand-computed values (quadratics, 2-parameter
toys, analytic softmax gradients); every method then runs on the toy two-session
protocol, where its loss term must be absent in session 0 and non-zero in session 1.
"""

import logging
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import toy_protocol_dict
from jascl.data.sampling import derive_seed
from jascl.data.synthetic import load_or_generate
from jascl.engine.config import resolve_config
from jascl.engine.loop import ContinualTrainer
from jascl.engine.plugin import Method
from jascl.engine.prototypes import PrototypeStore
from jascl.errors import ConfigError
from jascl.methods import Plugin
from jascl.methods.baselines.regularization._shared import leading_rows, pad_rows
from jascl.methods.baselines.regularization.adagrad import AdagradPlugin
from jascl.methods.baselines.regularization.dropout_wd import DropoutWeightDecayPlugin
from jascl.methods.baselines.regularization.ewc import (
    EWCPlugin,
    OnlineEWCPlugin,
    ewc_penalty,
    fisher_diagonal,
    online_fisher_update,
)
from jascl.methods.baselines.regularization.ucl import NodeGaussian, ucl_layer_terms, ucl_std_init
from jascl.methods.baselines.sharpness._shared import ascent_step, frozen_bn_statistics
from jascl.methods.baselines.sharpness.c_flat import c_flat_gradient
from jascl.methods.baselines.sharpness.sam import SAMPlugin, sam_gradient
from jascl.methods.baselines.sharpness.star import (
    STARPlugin,
    perturbed_weights,
    star_kl,
    star_layer_step,
    worst_case_perturbation,
)
from jascl.methods.registry import create_method
from jascl.networks.classifier import PixelClassifier
from jascl.protocols import parse_protocol

NAMES = ["ewc", "online-ewc", "ucl", "dropout-wd", "adagrad", "sam", "c-flat", "star"]
LOSS_KEY = {"ewc": "ewc", "online-ewc": "online-ewc", "ucl": "ucl", "dropout-wd": "wd", "star": "star"}


# ---------------------------------------------------------------------------- EWC / online EWC


def test_ewc_penalty_on_a_two_parameter_toy():
    theta = torch.tensor([1.0, -2.0], requires_grad=True)
    anchor, fisher = torch.tensor([0.5, 0.0]), torch.tensor([2.0, 0.25])
    penalty = ewc_penalty({"w": theta}, {"w": anchor}, {"w": fisher})
    # 2 * 0.5^2 + 0.25 * (-2)^2 = 0.5 + 1.0
    assert penalty.item() == pytest.approx(1.5)
    (0.5 * 4.0 * penalty).backward()  # lambda = 4: gradient lambda * F * (theta - theta*)
    assert torch.allclose(theta.grad, torch.tensor([4.0 * 2.0 * 0.5, 4.0 * 0.25 * -2.0]))


def test_ewc_penalty_covers_only_the_rows_of_its_session():
    grown = torch.tensor([[1.0], [3.0], [100.0]])  # third row: a class added after the anchor
    penalty = ewc_penalty({"c": grown}, {"c": torch.tensor([[0.0], [1.0]])}, {"c": torch.tensor([[1.0], [2.0]])})
    assert penalty.item() == pytest.approx(1.0 + 2.0 * 4.0)
    with pytest.raises(ValueError):
        leading_rows(torch.zeros(2, 3), torch.zeros(2, 4))
    assert torch.equal(pad_rows(torch.ones(2, 1), torch.Size([3, 1]), 7.0), torch.tensor([[1.0], [1.0], [7.0]]))


def _fake_state(model, index=1, **kw):
    return SimpleNamespace(model=model, session=SimpleNamespace(index=index), losses={}, metrics={}, **kw)


def test_ewc_plugin_adds_half_lambda_times_penalty_only_after_session_zero():
    model = nn.Module()
    model.w = nn.Parameter(torch.tensor([1.0, -2.0]))
    plugin = EWCPlugin(weight=4.0)
    plugin.sessions = [
        ({"w": torch.tensor([2.0, 0.25])}, {"w": torch.tensor([0.5, 0.0])}),
        ({"w": torch.tensor([1.0, 1.0])}, {"w": torch.tensor([1.0, -1.0])}),
    ]
    state = _fake_state(model, index=2)
    plugin.after_forward(state)
    assert state.losses["ewc"].item() == pytest.approx(0.5 * 4.0 * (1.5 + 1.0))  # one penalty per earlier session
    state0 = _fake_state(model, index=0)
    plugin.after_forward(state0)
    assert "ewc" not in state0.losses


def test_fisher_diagonal_equals_mean_of_squared_per_sample_gradients():
    torch.manual_seed(0)
    model = nn.Conv2d(2, 3, 1)  # per-pixel softmax regression: the gradient is known in closed form
    images = [torch.randn(1, 2, 3, 3) for _ in range(3)]
    targets = [torch.randint(0, 3, (1, 3, 3)) for _ in range(3)]
    targets[1][0, 0, :] = 255  # ignored pixels drop out of the per-image mean
    targets.append(torch.full((1, 3, 3), 255))  # an image without labels is not a sample
    images.append(torch.randn(1, 2, 3, 3))
    fisher = fisher_diagonal(model, zip(images, targets), dict(model.named_parameters()))

    expected_w, expected_b = torch.zeros(3, 2), torch.zeros(3)
    with torch.no_grad():
        for x, y in zip(images[:3], targets[:3]):
            feats = x[0].reshape(2, -1).t()  # (P, 2)
            probs = model(x)[0].reshape(3, -1).t().softmax(1)  # (P, 3)
            keep = y.reshape(-1) != 255
            onehot = F.one_hot(y.reshape(-1)[keep], 3).float()
            residual = (onehot - probs[keep]) / keep.sum()  # d log-likelihood / d logits, per pixel
            expected_w += (residual.t() @ feats[keep]) ** 2
            expected_b += residual.sum(0) ** 2
    assert torch.allclose(fisher["weight"].view(3, 2), expected_w / 3, atol=1e-6)
    assert torch.allclose(fisher["bias"], expected_b / 3, atol=1e-6)


def test_sampled_fisher_of_a_certain_model_equals_the_fisher_at_its_predictions():
    model = nn.Conv2d(1, 2, 1)
    with torch.no_grad():
        model.weight.zero_()
        model.bias.copy_(torch.tensor([0.0, 40.0]))  # always class 1, probability ~1
    x = torch.randn(1, 1, 2, 2)
    sampled = fisher_diagonal(
        model,
        [(x, torch.zeros(1, 2, 2, dtype=torch.long))],
        dict(model.named_parameters()),
        labels="sampled",
        generator=torch.Generator().manual_seed(0),
    )
    at_prediction = fisher_diagonal(model, [(x, torch.ones(1, 2, 2, dtype=torch.long))], dict(model.named_parameters()))
    assert torch.allclose(sampled["bias"], at_prediction["bias"])


def test_online_fisher_accumulates_gamma_f_plus_f_new():
    acc = online_fisher_update(None, {"w": torch.tensor([1.0, 2.0])}, gamma=0.5)
    assert torch.equal(acc["w"], torch.tensor([1.0, 2.0]))
    acc = online_fisher_update(acc, {"w": torch.tensor([3.0, 4.0]), "v": torch.tensor([1.0])}, gamma=0.5)
    assert torch.equal(acc["w"], torch.tensor([3.5, 5.0])) and torch.equal(acc["v"], torch.tensor([1.0]))
    grown = online_fisher_update({"c": torch.tensor([[2.0], [4.0]])}, {"c": torch.tensor([[1.0], [1.0], [1.0]])}, 0.25)
    assert torch.equal(grown["c"], torch.tensor([[1.5], [2.0], [1.0]]))


def test_online_ewc_plugin_keeps_one_running_fisher_and_the_latest_anchor(monkeypatch):
    plugin = OnlineEWCPlugin(weight=2.0, gamma=0.5)
    stats = iter(
        [
            ({"w": torch.tensor([4.0])}, {"w": torch.tensor([1.0])}),
            ({"w": torch.tensor([1.0])}, {"w": torch.tensor([3.0])}),
        ]
    )
    monkeypatch.setattr(plugin, "session_fisher", lambda state: next(stats))
    plugin.consolidate(_fake_state(None, index=0))
    plugin.consolidate(_fake_state(None, index=1))
    assert torch.equal(plugin.fisher["w"], torch.tensor([0.5 * 4.0 + 1.0]))
    assert torch.equal(plugin.anchors["w"], torch.tensor([3.0]))
    model = nn.Module()
    model.w = nn.Parameter(torch.tensor([5.0]))
    state = _fake_state(model, index=2)
    plugin.after_forward(state)
    assert state.losses["online-ewc"].item() == pytest.approx(0.5 * 2.0 * 3.0 * (5.0 - 3.0) ** 2)


def test_ewc_state_round_trips_and_a_restored_session_is_not_consolidated_twice(monkeypatch):
    plugin = EWCPlugin()
    plugin.sessions = [({"classifier.weight": torch.ones(2, 3)}, {"classifier.weight": torch.zeros(2, 3)})]
    plugin.consolidated = 0
    other = EWCPlugin()
    other.load_extra_state(plugin.extra_state())
    assert other.consolidated == 0 and torch.equal(other.sessions[0][0]["classifier.weight"], torch.ones(2, 3))
    monkeypatch.setattr(other, "session_fisher", lambda state: pytest.fail("recomputed a loaded session"))
    other.session_restored(_fake_state(None, index=0))
    assert len(other.sessions) == 1


# ---------------------------------------------------------------------------- UCL


def test_ucl_std_init_follows_the_official_fans():
    assert ucl_std_init(torch.Size([3, 8]), 0.5) == pytest.approx(math.sqrt(0.5 * 2 / 8))  # linear: fan_in
    assert ucl_std_init(torch.Size([4, 2, 3, 3]), 0.125) == pytest.approx(math.sqrt(0.125 * 2 / 36))  # conv: fan_out


def test_ucl_layer_terms_hand_computed():
    mu = torch.tensor([[1.0], [2.0], [9.0]])  # third row is new: out of l2/l1, prior sigma_init
    mu_old = torch.tensor([[0.5], [1.0]])
    sigma, sigma_old = torch.tensor([0.2, 0.1, 0.1]), torch.tensor([0.1, 0.2])
    l2, l1, sig = ucl_layer_terms(mu, mu_old, sigma, sigma_old, std_init=0.1)
    # strengths s = 0.1 / sigma_old = (1, 0.5): l2 = 1 * 0.25 + 0.25 * 1
    assert l2.item() == pytest.approx(0.5)
    # 0.1^2 * (0.5^2/0.1^2 * 0.5 + 1^2/0.2^2 * 1)
    assert l1.item() == pytest.approx(0.01 * (12.5 + 25.0))
    ratios = [4.0, 0.25, 1.0]
    expected = sum(r - math.log(r) for r in ratios) + sum(s * s - math.log(s * s) for s in [0.2, 0.1, 0.1])
    assert sig.item() == pytest.approx(expected, rel=1e-6)


def test_ucl_node_gaussian_samples_node_wise_noise_in_training_only():
    torch.manual_seed(0)
    noise = NodeGaussian(torch.tensor([0.1, 0.5]), node_dim=0, ndim=2)
    mu = torch.zeros(2, 20000)
    noise.eval()
    assert torch.equal(noise(mu), mu)
    noise.train()
    std = noise(mu).std(dim=1)
    assert std[0].item() == pytest.approx(0.1, rel=0.03) and std[1].item() == pytest.approx(0.5, rel=0.03)
    assert torch.allclose(noise.sigma(), torch.tensor([0.1, 0.5]))


# ---------------------------------------------------------------------------- dropout + weight decay, Adagrad


def test_dropout_acts_on_classifier_inputs_in_training_mode_only():
    model = nn.Module()
    model.classifier = PixelClassifier(6, 3, cosine=False)
    plugin = DropoutWeightDecayPlugin(p=0.5)
    x = torch.randn(2, 6, 4, 4)
    model.eval()
    plain = model.classifier(x)
    plugin.before_session(_fake_state(model, index=1))
    assert torch.equal(model.classifier(x), plain)  # eval: no dropout
    model.train()
    torch.manual_seed(3)
    dropped = model.classifier(x)
    torch.manual_seed(3)
    mask = F.dropout(torch.ones_like(x), 0.5, training=True)
    assert torch.allclose(dropped, F.conv2d(x * mask, model.classifier.weight[:, :, None, None], model.classifier.bias))
    assert not torch.allclose(dropped, plain)
    plugin.after_session(None)
    assert torch.equal(model.classifier(x), plain)  # hook removed


def test_weight_decay_term_is_half_wd_times_squared_norm():
    p1, p2 = nn.Parameter(torch.tensor([1.0, 2.0])), nn.Parameter(torch.tensor([[3.0]]))
    plugin = DropoutWeightDecayPlugin(weight_decay=0.1)
    cfg = resolve_config()
    state = _fake_state(None, index=1, config=cfg)
    opt = plugin.make_optimizer(state, [p1, p2], 0.01)
    assert isinstance(opt, torch.optim.SGD) and opt.param_groups[0]["weight_decay"] == 0.0
    plugin.after_forward(state)
    assert state.losses["wd"].item() == pytest.approx(0.5 * 0.1 * (1 + 4 + 9))
    # session 0 (not in_base): the loop's own SGD
    assert plugin.make_optimizer(_fake_state(None, index=0, config=cfg), [p1], 0.01) is None


def test_adagrad_is_the_optimiser_and_its_sums_carry_over_grown_rows():
    cfg = resolve_config(overrides=["weight_decay=0"])
    model = nn.Module()
    model.w = nn.Parameter(torch.tensor([[1.0, -1.0], [0.5, 2.0]]))
    plugin = AdagradPlugin()
    state = _fake_state(model, index=1, config=cfg)
    opt = plugin.make_optimizer(state, [model.w], lr=0.1)
    assert isinstance(opt, torch.optim.Adagrad)
    model.w.grad = torch.tensor([[3.0, -0.5], [1.0, 0.0]])
    before = model.w.detach().clone()
    opt.step()
    # first Adagrad step: lr * g / sqrt(g^2) = lr * sign(g)
    assert torch.allclose(model.w - before, -0.1 * torch.sign(torch.tensor([[3.0, -0.5], [1.0, 0.0]])), atol=1e-6)
    plugin.after_session(state)
    assert torch.equal(plugin.sums["w"], torch.tensor([[9.0, 0.25], [1.0, 0.0]]))
    model.w = nn.Parameter(torch.zeros(3, 2))  # the classifier grew by a row
    opt2 = plugin.make_optimizer(_fake_state(model, index=2, config=cfg), [model.w], lr=0.1)
    assert torch.equal(opt2.state[model.w]["sum"], torch.tensor([[9.0, 0.25], [1.0, 0.0], [0.0, 0.0]]))


# ---------------------------------------------------------------------------- SAM, C-Flat, STAR


A = torch.tensor([4.0, 1.0, 0.5])  # quadratic L = 1/2 sum a_i theta_i^2, gradient a * theta


def _quadratic_grad(theta):
    return lambda: [A[:2] * theta[0].detach(), A[2:] * theta[1].detach()]


def test_sam_perturbation_is_rho_times_normalised_gradient_on_a_quadratic():
    theta = [torch.tensor([1.0, 2.0]), torch.tensor([-2.0])]  # two tensors: the norm is global
    g = [A[:2] * theta[0], A[2:] * theta[1]]
    norm = math.sqrt(4.0**2 + 2.0**2 + 1.0**2)
    e = ascent_step(g, rho=0.3)
    assert torch.allclose(e[0], 0.3 * torch.tensor([4.0, 2.0]) / norm)
    assert torch.allclose(e[1], 0.3 * torch.tensor([-1.0]) / norm)
    g_sam, _ = sam_gradient(theta, g, _quadratic_grad(theta), rho=0.3)
    assert torch.allclose(g_sam[0], A[:2] * (theta[0] + e[0])) and torch.allclose(g_sam[1], A[2:] * (theta[1] + e[1]))
    assert torch.equal(theta[0], torch.tensor([1.0, 2.0]))  # parameters restored


def test_sam_plugin_hands_the_optimiser_the_gradient_at_the_perturbed_point():
    model = nn.Module()
    model.theta = nn.Parameter(torch.tensor([1.0, 2.0, -2.0]))
    opt = torch.optim.SGD([model.theta], lr=0.1)
    state = _fake_state(model, index=1, optimizer=opt)
    state.closure = lambda: state.losses.update(seg=0.5 * (A * model.theta**2).sum()) or state.losses["seg"]
    state.closure().backward()
    SAMPlugin(rho=0.05).before_update(state)
    g = A * torch.tensor([1.0, 2.0, -2.0])
    expected = A * (torch.tensor([1.0, 2.0, -2.0]) + 0.05 * g / g.norm())
    assert torch.allclose(model.theta.grad, expected)
    assert torch.equal(model.theta.detach(), torch.tensor([1.0, 2.0, -2.0]))  # restored
    assert state.metrics["sam_sharpness"] > 0  # the loss rose at the worst-case neighbour


def test_c_flat_direction_on_a_quadratic():
    theta = [torch.tensor([1.0, 2.0]), torch.tensor([-2.0])]
    flat = torch.tensor([1.0, 2.0, -2.0])
    rho, lamb = 0.2, 0.3
    g0 = A * flat
    e0 = rho * g0 / g0.norm()
    g1 = A * (flat + e0)
    h = g1 - g0
    e1 = rho * h / h.norm()
    g2 = A * (flat + e1)
    e2 = rho * g2 / g2.norm()
    g3 = A * (flat + e1 + e2)
    expected = g1 + lamb * (g3 - g2)  # = g1 + lamb * A e2 for a quadratic
    out = c_flat_gradient(theta, [A[:2] * theta[0], A[2:] * theta[1]], _quadratic_grad(theta), rho, lamb)
    assert torch.allclose(torch.cat(out), expected, atol=1e-6)
    assert torch.allclose(torch.cat(out), g1 + lamb * A * e2, atol=1e-6)
    assert torch.equal(torch.cat(theta), flat)
    sam_only = c_flat_gradient(theta, [A[:2] * theta[0], A[2:] * theta[1]], _quadratic_grad(theta), rho, 0.0)
    assert torch.allclose(torch.cat(sam_only), g1)


def test_frozen_bn_statistics_leaves_running_stats_alone():
    bn = nn.BatchNorm1d(2).train()
    with frozen_bn_statistics(bn):
        bn(torch.randn(8, 2) + 5)
    assert torch.equal(bn.running_mean, torch.zeros(2)) and bn.momentum == 0.1 and int(bn.num_batches_tracked) == 0
    bn(torch.randn(8, 2) + 5)
    assert bn.running_mean.abs().sum() > 0


def test_star_kl_and_layer_step_by_hand():
    clean = torch.tensor([[0.0, math.log(3.0)], [0.0, 0.0]])  # p = (1/4, 3/4), (1/2, 1/2)
    pert = torch.tensor([[0.0, 0.0], [5.0, 0.0]])  # q = (1/2, 1/2)
    kl0 = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    assert star_kl(clean, pert, torch.tensor([1.0, 0.0])).item() == pytest.approx(kl0, rel=1e-5)
    w, g = torch.tensor([[3.0, 4.0]]), torch.tensor([[0.0, 2.0]])
    assert torch.allclose(star_layer_step([w], [g], 0.1)[0], torch.tensor([[0.0, 0.5]]))  # 0.1 * ||w||=5 * g/||g||


def test_star_kl_is_per_pixel_on_dense_logits():
    clean = torch.zeros(1, 2, 1, 2)  # p = (1/2, 1/2) at both pixels
    pert = torch.tensor([math.log(3.0), 0.0]).view(1, 2, 1, 1).expand(1, 2, 1, 2)  # q = (3/4, 1/4)
    kl = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)
    assert star_kl(clean, pert, torch.tensor([[[1.0, 1.0]]])).item() == pytest.approx(kl, rel=1e-5)
    assert star_kl(clean, pert, torch.tensor([[[0.0, 0.0]]])).item() == 0.0


class _Dense(nn.Module):
    """A two-layer dense "segmenter" (1x1 convolutions with a bias): what STAR perturbs is its two weights."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(2, 4, 1), nn.Conv2d(4, 3, 1)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def test_star_perturbs_every_weight_by_its_layer_relative_size_and_beats_random_directions():
    torch.manual_seed(0)
    net = _Dense()
    x = torch.randn(3, 2, 4, 4)
    with torch.no_grad():
        clean = net(x)
    mask = torch.ones(3, 4, 4)
    assert set(perturbed_weights(net)) == {"a.weight", "b.weight"}  # biases are left alone
    delta = worst_case_perturbation(net, x, clean, mask, 0.05, 1, 1e-3, torch.Generator().manual_seed(0))
    for name, w in perturbed_weights(net).items():  # gamma * ||w_l|| per layer (plus the 1e-3 random start)
        assert delta[name].norm().item() == pytest.approx(0.05 * w.norm().item(), rel=0.03)
    params = dict(net.named_parameters())
    worst = star_kl(clean, torch.func.functional_call(net, {n: params[n] + d for n, d in delta.items()}, (x,)), mask)
    gen = torch.Generator().manual_seed(1)
    random_kls = []
    for _ in range(8):  # same sizes, random directions
        shifted = {}
        for n, d in delta.items():
            r = torch.randn(d.shape, generator=gen)
            shifted[n] = params[n] + r * (d.norm() / r.norm())
        random_kls.append(star_kl(clean, torch.func.functional_call(net, shifted, (x,)), mask))
    assert worst > max(random_kls)  # the ascent direction beats random ones


def test_star_plugin_appends_memory_samples_and_adds_the_kl_at_the_perturbed_point():
    """STAR's defining parts: a replay buffer of earlier samples (ER: they join the batch) and the KL term on them,
    whose gradient is the gradient at w + dw."""
    from jascl.methods.labelled_memory import LabelledMemory
    from jascl.networks.base import SegmenterOutput

    class Seg(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = _Dense()

        def forward_features(self, x):
            return SegmenterOutput(self.net(x), x)

    torch.manual_seed(0)
    memory = LabelledMemory(4)
    g = torch.Generator().manual_seed(0)
    images = torch.randn(4, 2, 4, 4, generator=g)
    labels = torch.randint(0, 3, (4, 4, 4), generator=g).to(torch.uint8)
    memory.add_session(0, images, list(labels), torch.Generator().manual_seed(0))
    assert len(memory) == 4
    model = Seg()
    with torch.no_grad():  # the memory labels become what the model predicts there, so every pixel counts
        memory.labels = model.forward_features(memory.images).logits.argmax(1).to(torch.uint8)
    plugin = STARPlugin(memory, weight=0.1, gamma=0.05, replay_batch=2)
    state = SimpleNamespace(
        seed=1,
        session=SimpleNamespace(index=1),
        epoch=0,
        iteration=0,
        config=SimpleNamespace(batch_size=2),
        device=torch.device("cpu"),
        model=model,
        losses={},
        class_index=lambda ids: ids,
        batch={"image": torch.zeros(2, 2, 4, 4), "label": torch.zeros(2, 4, 4, dtype=torch.long), "id": ["x", "y"]},
    )
    plugin.before_iteration(state)  # ER: two memory samples join the batch
    assert state.batch["image"].shape == (4, 2, 4, 4) and state.batch["id"][2:] == ["star-memory"] * 2
    assert any(torch.equal(state.batch["image"][2], m) for m in memory.images)
    plugin.after_forward(state)
    loss = state.losses["star"]
    assert loss.item() > 0
    loss.backward()
    assert model.net.a.weight.grad.abs().sum() > 0  # the whole network, not only the classifier
    # the gradient is the KL's gradient at the perturbed point (recomputed here with the same draw)
    drawn = plugin._draw(state, "star")
    x = drawn["image"]
    with torch.no_grad():
        clean = model.forward_features(x).logits
    mask = torch.ones(clean.argmax(1).shape)
    start = torch.Generator().manual_seed(
        derive_seed(state.seed, state.session.index, state.epoch, state.iteration, "star-start")
    )
    delta = worst_case_perturbation(model.net, x, clean, mask, 0.05, 1, 1e-3, start)
    weights = dict(model.net.named_parameters())
    w = weights["b.weight"].detach().clone().requires_grad_(True)
    shifted = {n: (w if n == "b.weight" else weights[n].detach()) + delta[n] for n in delta}
    expected = 0.1 * star_kl(clean, torch.func.functional_call(model.net, shifted, (x,)), mask)
    (grad,) = torch.autograd.grad(expected, [w])
    assert torch.allclose(model.net.b.weight.grad, grad, atol=1e-6)


def test_star_is_registered_with_the_readme_defaults_and_a_memory():
    method = create_method("star", resolve_config())
    store, plugin = method.plugins
    assert store.name == "labelled-memory" and store.memory is plugin.memory and store.memory.size == 20
    assert (plugin.weight, plugin.gamma, plugin.steps, plugin.er) == (0.1, 0.01, 1, True)
    assert method.freeze_policy("all_but_classifier") == "none"


# ---------------------------------------------------------------------------- end to end on the toy protocol


class Probe(Plugin):
    """Per session: the largest magnitude of each loss term (read after every plugin's after_forward),
    the optimiser type, and UCL's weighted terms when the method is UCL."""

    name = "probe"

    def __init__(self, ucl=None):
        self.seen, self.optimizers, self.ucl_terms = {}, {}, []
        self.ucl = ucl

    def before_backward(self, state):
        terms = self.seen.setdefault(state.session.index, {})
        for key, value in state.losses.items():
            terms[key] = max(terms.get(key, 0.0), abs(float(value.detach())))
        self.optimizers[state.session.index] = type(state.optimizer).__name__
        if self.ucl is not None:
            self.ucl_terms.append((state.session.index, dict(self.ucl.last_terms)))


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    protocol = parse_protocol(toy_protocol_dict(2), source="toy-2d.yaml")
    data = load_or_generate(protocol, tmp_path_factory.mktemp("cache"))
    return protocol, data


def _run_two_sessions(toy, name, tmp_path, overrides=()):
    """Sessions 0 and 1 of the toy protocol with ``name`` (+ a probe); returns the model after session 0 too."""
    protocol, data = toy
    config = resolve_config(protocol.training, "toy-2d.yaml", overrides=list(overrides))
    method = create_method(name, config)
    probe = Probe(method.plugins[0] if name == "ucl" else None)
    method = Method(method.name, [*method.plugins, probe])
    trainer = ContinualTrainer(protocol, config, method, data, progress=False)
    model, store = trainer.new_model(len(protocol.seen_classes(0))), PrototypeStore()
    trainer.run_session(0, model, store, tmp_path / "s0")
    after_base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    trainer.run_session(1, model, store, tmp_path / "s1")
    return method, probe, model, after_base


@pytest.mark.parametrize("name", NAMES)
def test_method_end_to_end_with_freeze_none(toy, name, tmp_path, caplog):
    """Term absent in session 0 and non-zero in session 1; freeze=none lets the method train the backbone."""
    caplog.set_level(logging.INFO, logger="jascl")
    method, probe, model, after_base = _run_two_sessions(toy, name, tmp_path, [f"method_args.{name}.freeze=none"])
    own = [r.getMessage() for r in caplog.records if "its own optimiser" in r.getMessage()]
    if name == "adagrad":  # its Adagrad in session 1 is named; UCL's SGD is the configured kind here
        assert own == [
            "adagrad session 1 trains with its own optimiser: Adagrad, not the configured sgd (docs/baselines.md)"
        ]
    else:
        assert own == []
    plugin = [p for p in method.plugins if p.name != "labelled-memory"][0]
    assert (tmp_path / "s1" / "metrics.json").exists()
    key = LOSS_KEY.get(name)
    assert set(plugin.loss_terms) == ({key} if key else set())
    if key is not None:
        if name == "ucl":  # UCL trains its own Bayesian base, pulled towards the initialisation there
            assert probe.seen[0]["ucl"] > 0
        else:
            assert probe.seen[0].get(key, 0.0) == 0.0
        assert probe.seen[1][key] > 0.0
    # the freezing option reached the loop: backbone weights moved in session 1
    assert method.freeze_policy("all_but_classifier") == "none"
    backbone = [k for k in after_base if k.startswith("backbone.") and k.endswith("weight") and after_base[k].dim() > 1]
    assert backbone and any(not torch.equal(model.state_dict()[k], after_base[k]) for k in backbone)
    if name in ("ewc", "online-ewc"):  # the Fisher covers the backbone when it can train
        fisher = plugin.sessions[0][0] if name == "ewc" else plugin.fisher
        assert any(k.startswith("backbone.") and v.abs().sum() > 0 for k, v in fisher.items())
    if name == "adagrad":
        assert probe.optimizers == {0: "SGD", 1: "Adagrad"} and plugin.sums["classifier.weight"].abs().sum() > 0
    if name in ("sam", "c-flat"):  # they change the update, not the loss
        assert probe.seen[1].keys() == {"seg"}
    if name == "sam":
        assert plugin.last_sharpness is not None
    if name == "ucl":
        std = ucl_std_init(torch.Size([4, model.classifier.in_channels]), 0.125)
        assert ucl_terms_ok(probe.ucl_terms)
        assert plugin.sigmas["classifier"].shape == (4,)
        assert not torch.allclose(plugin.sigmas["classifier"][:3], torch.full((3,), std))  # learned in session 0
        assert "classifier.weight" in model.state_dict()  # Bayesian layers removed before checkpoints


def ucl_terms_ok(terms):
    """UCL's L1 term (``saved``) is off in session 0 and acts in session 1."""
    return all(t["l1"] == 0.0 for s, t in terms if s == 0) and any(t["l1"] > 0 for s, t in terms if s == 1)


def test_default_freeze_keeps_the_backbone_fixed_and_the_fisher_on_the_classifier(toy, tmp_path):
    method, probe, model, after_base = _run_two_sessions(toy, "ewc", tmp_path)
    assert all(
        torch.equal(model.state_dict()[k], v)
        for k, v in after_base.items()
        if k.startswith("backbone.") and "running" not in k and "num_batches" not in k
    )
    assert set(method.plugins[0].sessions[0][0]) == {"classifier.weight"} and probe.seen[1]["ewc"] > 0


@pytest.mark.parametrize(
    "override, key",
    [
        ("method_args.ewc.freeze=bogus", "method_args.ewc.freeze"),
        ("method_args.online-ewc.gamma=2", "method_args.online-ewc.gamma"),
        ("method_args.sam.rho=-1", "method_args.sam.rho"),
        ("method_args.ucl.ratio=0", "method_args.ucl.ratio"),
        ("method_args.adagrad.lr=fast", "method_args.adagrad.lr"),
        ("method_args.star.nope=1", "method_args.star.nope"),
    ],
)
def test_bad_options_are_one_line_config_errors(override, key):
    name = key.split(".")[1]
    with pytest.raises(ConfigError, match="^" + key.replace(".", r"\.") + ": ") as info:
        create_method(name, resolve_config(overrides=[override]))
    assert "\n" not in str(info.value)
