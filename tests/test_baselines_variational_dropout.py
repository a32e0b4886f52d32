"""Variational dropout (``variational-dropout``): Molchanov et al.'s KL approximation against its closed form,
the drawn weights' variance alpha * theta^2, no noise in evaluation, and rows learned earlier kept fixed."""

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from jascl.methods.baselines.regularization.variational_dropout import (
    K1,
    K2,
    K3,
    VariationalDropoutNoise,
    VariationalDropoutPlugin,
    initial_log_sigma2,
    log_alpha,
    vd_kl,
)
from jascl.networks.classifier import PixelClassifier


def _kl_closed_form(la: float) -> float:
    """Molchanov et al. (2017) eq. 14: KL ~= k1 - k1 * sigmoid(k2 + k3 * log alpha) + 0.5 * log(1 + 1 / alpha)."""
    return K1 - K1 / (1 + math.exp(-(K2 + K3 * la))) + 0.5 * math.log(1 + 1 / math.exp(la))


def test_kl_approximation_matches_the_closed_form():
    values = [-8.0, -2.0, 0.0, 1.5, 8.0]
    got = vd_kl(torch.tensor(values, dtype=torch.float64))
    assert got.item() == pytest.approx(sum(_kl_closed_form(v) for v in values), rel=1e-12)
    # by hand at alpha = 1: sigmoid(1.8732) = 0.866818, 0.63576 * (1 - 0.866818) + 0.5 ln 2 = 0.431245
    assert vd_kl(torch.tensor([0.0])).item() == pytest.approx(0.431245, abs=1e-5)
    # small alpha: ~ -0.5 log alpha + k1 (the sigmoid vanishes); large alpha: the KL vanishes
    assert vd_kl(torch.tensor([-8.0])).item() == pytest.approx(4.0 + K1, abs=2e-3)
    assert vd_kl(torch.tensor([8.0])).item() < 2e-3


def test_log_alpha_is_log_sigma2_minus_log_theta2_clipped():
    theta = torch.tensor([0.5, -2.0, 1.0, 1e-3])
    log_sigma2 = torch.tensor([math.log(0.25), math.log(4.0 * math.exp(-2)), 20.0, -50.0])
    got = log_alpha(theta, log_sigma2)
    assert got[:2].tolist() == pytest.approx([0.0, -2.0], abs=1e-6)
    assert got[2].item() == 8.0 and got[3].item() == -8.0  # clipped to [-8, 8]


def test_drawn_weights_have_mean_theta_and_variance_alpha_theta2():
    theta = torch.tensor([[0.5, -2.0], [1.0, 0.1]], dtype=torch.float64)
    la = torch.tensor([[0.0, -2.0], [1.0, -1.0]], dtype=torch.float64)
    noise = VariationalDropoutNoise(la + torch.log(theta.pow(2) + 1e-8)).double().train()
    torch.manual_seed(0)
    draws = noise(theta.expand(40000, 2, 2))  # 40000 independent draws (log sigma^2 broadcasts)
    alpha = la.exp()
    # standard errors: mean sqrt(a) |theta| / 200, variance a theta^2 * sqrt(2 / n) = 0.7 %
    assert torch.allclose(draws.mean(0), theta, atol=4 * (alpha.sqrt() * theta.abs()).max().item() / 200)
    assert torch.allclose(draws.var(0), alpha * theta.pow(2), rtol=0.03)


def test_no_noise_in_evaluation_mode():
    torch.manual_seed(1)
    clf = PixelClassifier(4, 3, cosine=True)
    features = torch.randn(2, 4, 5, 5)
    clean = clf(features).detach()
    noise = VariationalDropoutNoise(torch.zeros_like(clf.weight))  # log sigma^2 = 0: sigma = 1, strong noise
    torch.nn.utils.parametrize.register_parametrization(clf, "weight", noise)
    clf.eval()
    assert torch.equal(clf(features), clean)
    assert torch.equal(clf.weight, clf.parametrizations["weight"].original)
    clf.train()
    assert not torch.allclose(clf(features), clean)


def test_rows_learned_earlier_start_from_their_value_and_get_no_gradient():
    theta = torch.tensor([[1.0, 2.0], [0.5, 1.0], [3.0, 0.2]])
    carried = torch.tensor([[-1.0, -2.0], [-3.0, -4.0]])
    start, rows = initial_log_sigma2(theta, carried, log_alpha_init=0.0)
    assert rows == 2
    assert torch.equal(start[:2], carried)
    assert torch.allclose(start[2], torch.log(theta[2] ** 2 + 1e-8))  # log alpha 0: sigma^2 = theta^2
    # another shape: nothing carried
    assert initial_log_sigma2(theta, torch.zeros(2, 3), 0.0)[1] == 0

    noise = VariationalDropoutNoise(start, frozen_rows=rows).train()
    vd_kl(noise.log_alpha(theta)).backward()
    grad = noise.log_sigma2.grad
    assert torch.equal(grad[:2], torch.zeros(2, 2))
    assert (grad[2] != 0).all()


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.classifier = PixelClassifier(2, 3, cosine=False)

    def resolve_layer(self, name: str) -> nn.Module:
        return self.classifier


def test_plugin_kl_term_is_the_elbo_per_pixel_and_the_session_keeps_log_sigma2():
    model = _Model()
    with torch.no_grad():
        model.classifier.weight.copy_(torch.tensor([[1.0, -1.0], [0.5, 2.0], [0.25, 1.0]]))
    state = SimpleNamespace(
        session=SimpleNamespace(index=1),
        model=model,
        data=SimpleNamespace(train=list(range(5))),
        batch={"label": torch.zeros(2, 4, 4, dtype=torch.long)},
    )
    plugin = VariationalDropoutPlugin(log_alpha_init=-2.0, kl_weight=3.0)
    plugin.before_session(state)
    # every weight at log alpha -2: KL = 6 * KL(-2), divided by N = 5 images of P = 16 pixels
    expected = 3.0 * 6 * _kl_closed_form(-2.0) / (5 * 16)
    assert plugin.kl_term(state).item() == pytest.approx(expected, rel=1e-5)
    plugin.after_session(SimpleNamespace())
    assert not torch.nn.utils.parametrize.is_parametrized(model.classifier, "weight")
    assert torch.allclose(plugin.carried, -2.0 + torch.log(model.classifier.weight.detach() ** 2 + 1e-8))
    assert set(plugin.extra_state()) == {"log_sigma2"}
    # session 0 (the shared base): the plugin does nothing
    state.session.index = 0
    plugin.before_session(state)
    assert plugin._noise is None
