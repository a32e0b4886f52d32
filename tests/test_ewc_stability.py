"""EWC's penalty under SGD: the stability bound of a quadratic, the importances capped to it, and the plugins that
apply the cap (on the med-ss fixtures, lambda = 500 on an unnormalised Fisher diverged at the protocol's rate)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from jascl.methods.baselines.regularization.ewc import (
    STABILITY_MARGIN,
    EWCPlugin,
    OnlineEWCPlugin,
    capped_importances,
    ewc_penalty,
    sgd_stable_curvature,
)


def test_the_bound_of_plain_heavy_ball_and_nesterov_sgd():
    assert sgd_stable_curvature(0.01) == pytest.approx(200.0)  # 2 / lr
    assert sgd_stable_curvature(0.01, 0.9) == pytest.approx(380.0)  # 2 (1 + 0.9) / lr
    assert sgd_stable_curvature(0.01, 0.9, nesterov=True) == pytest.approx(3.8 / 2.8 / 0.01)  # 135.71
    assert sgd_stable_curvature(0.01, 0.0, nesterov=True) == pytest.approx(200.0)  # no momentum: plain SGD
    assert sgd_stable_curvature(0.0, 0.9) == float("inf")


def _quadratic_after(curvature: float, momentum: float, nesterov: bool, steps: int = 100) -> float:
    x = nn.Parameter(torch.tensor(1.0))
    optimizer = torch.optim.SGD([x], lr=0.01, momentum=momentum, nesterov=nesterov)
    for _ in range(steps):
        optimizer.zero_grad()
        (0.5 * curvature * x**2).backward()
        optimizer.step()
    return abs(float(x.detach()))


@pytest.mark.parametrize("momentum,nesterov", [(0.0, False), (0.9, False), (0.9, True)])
def test_the_bound_is_where_torch_sgd_starts_to_diverge(momentum, nesterov):
    bound = sgd_stable_curvature(0.01, momentum, nesterov)
    assert _quadratic_after(0.95 * bound, momentum, nesterov) < 0.1
    assert _quadratic_after(1.05 * bound, momentum, nesterov) > 10.0


def test_capped_importances_scale_each_element_by_cap_over_its_sum():
    sessions = [{"w": torch.tensor([4.0, 1.0])}, {"w": torch.tensor([4.0, 0.5])}]
    capped = capped_importances(sessions, cap=2.0)  # sums 8 and 1.5: factors 1/4 and 1
    assert torch.equal(capped[0]["w"], torch.tensor([1.0, 1.0]))
    assert torch.equal(capped[1]["w"], torch.tensor([1.0, 0.5]))
    # a classifier that grew: the first row sums 3 + 1 = 4 (factor 1/2), the new row is 5 alone (factor 2/5)
    grown = capped_importances([{"c": torch.tensor([[3.0]])}, {"c": torch.tensor([[1.0], [5.0]])}], cap=2.0)
    assert torch.equal(grown[0]["c"], torch.tensor([[1.5]]))
    assert torch.allclose(grown[1]["c"], torch.tensor([[0.5], [2.0]]))
    assert torch.equal(sessions[0]["w"], torch.tensor([4.0, 1.0]))  # the inputs are left as they were


def _state(model, optimizer, index=1):
    return SimpleNamespace(model=model, optimizer=optimizer, session=SimpleNamespace(index=index), losses={})


def test_ewc_caps_its_fisher_under_sgd_and_not_under_adam():
    model = nn.Module()
    model.w = nn.Parameter(torch.tensor([1.0]))
    plugin = EWCPlugin(weight=500.0)
    plugin.sessions = [({"w": torch.tensor([20.0])}, {"w": torch.tensor([0.0])})]
    sgd = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True)
    state = _state(model, sgd)
    plugin.after_forward(state)
    cap = STABILITY_MARGIN * (3.8 / 2.8 / 0.01) / 500.0  # 0.1357
    assert state.losses["ewc"].item() == pytest.approx(0.5 * 500.0 * cap * 1.0**2)
    adam = _state(model, torch.optim.Adam(model.parameters(), lr=0.01))
    plugin.after_forward(adam)
    assert adam.losses["ewc"].item() == pytest.approx(0.5 * 500.0 * 20.0)
    assert torch.equal(plugin.sessions[0][0]["w"], torch.tensor([20.0]))  # the stored Fisher is untouched


def test_online_ewc_caps_its_running_fisher_under_sgd():
    model = nn.Module()
    model.w = nn.Parameter(torch.tensor([3.0, 3.0]))
    plugin = OnlineEWCPlugin(weight=100.0)
    plugin.fisher, plugin.anchors = {"w": torch.tensor([50.0, 0.1])}, {"w": torch.tensor([1.0, 1.0])}
    state = _state(model, torch.optim.SGD(model.parameters(), lr=0.1))  # bound 20, cap 0.5 * 20 / 100 = 0.1
    plugin.after_forward(state)
    assert state.losses["online-ewc"].item() == pytest.approx(0.5 * 100.0 * (0.1 * 4.0 + 0.1 * 4.0))


def test_the_capped_penalty_holds_the_parameter_where_the_raw_one_diverges():
    """lambda = 500, lr 0.01, Nesterov 0.9 and a Fisher of 20 (med-ss's classifier): lr lambda F = 100 against a
    bound of 1.36. Trained on the penalty alone, the raw penalty explodes; the plugin's brings the parameter back."""

    def train(penalty_of, steps: int = 60) -> torch.Tensor:
        model = nn.Module()
        model.w = nn.Parameter(torch.tensor([1.0, 1.0]))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True)
        for _ in range(steps):
            optimizer.zero_grad()
            penalty_of(model, optimizer).backward()
            optimizer.step()
        return model.w.detach().abs()

    fisher, anchor = {"w": torch.tensor([20.0, 0.01])}, {"w": torch.zeros(2)}
    raw = train(lambda model, _: 0.5 * 500.0 * ewc_penalty(dict(model.named_parameters()), anchor, fisher))
    assert not torch.isfinite(raw[0]) or raw[0] > 1e6  # (60 steps of a factor about 190 overflow float32)

    plugin = EWCPlugin(weight=500.0)
    plugin.sessions = [(fisher, anchor)]

    def capped(model, optimizer):
        state = _state(model, optimizer)
        plugin.after_forward(state)
        return state.losses["ewc"]

    held = train(capped)
    assert held[0] < 1e-3  # the capped element is back at its anchor
    # the other element (lr lambda F = 0.05, uncapped) moves as with the raw penalty
    assert held[1] == pytest.approx(float(raw[1]), rel=1e-5) and held[1] < 0.5
