"""``unit_channels``: F.normalize along a dimension, by hand and against torch."""

import torch
import torch.nn.functional as F

from jascl.networks.ops import unit_channels


def test_unit_channels_by_hand():
    # two pixels of a (1, 2, 1, 2) map: (3, 4) has length 5; (0, 0) is divided by the epsilon, i.e. stays 0
    x = torch.tensor([[[[3.0, 0.0]], [[4.0, 0.0]]]])
    y = unit_channels(x)
    assert torch.allclose(y[0, :, 0, 0], torch.tensor([0.6, 0.8])) and torch.equal(y[0, :, 0, 1], torch.zeros(2))
    # a tiny vector is divided by eps, as F.normalize does, not blown up to unit length
    tiny = torch.tensor([[1e-14, 0.0]])
    assert torch.allclose(unit_channels(tiny, dim=1), tiny / 1e-12)


def test_unit_channels_equals_f_normalize_forward_and_backward():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 4, 6, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 5, 4, 6, generator=g, dtype=torch.float64)
    ours, theirs = unit_channels(x), F.normalize(x, dim=1)
    assert torch.allclose(ours, theirs, atol=1e-12)
    (ga,) = torch.autograd.grad((ours * w).sum(), x)
    (gb,) = torch.autograd.grad((theirs * w).sum(), x)
    assert torch.allclose(ga, gb, atol=1e-12)
    # half precision: the squares are summed in float32, so large features do not overflow to inf
    big = torch.full((1, 4, 2), 300.0, dtype=torch.float16)
    assert torch.allclose(unit_channels(big).float(), torch.full((1, 4, 2), 0.5), atol=1e-3)
    # ... and an all-zero vector (a ReLU backbone's pixel) stays zero instead of 0 * (1 / eps) = NaN
    for dtype in (torch.float16, torch.bfloat16):
        zero = unit_channels(torch.zeros(2, 3, 4, dtype=dtype))
        assert zero.dtype == dtype and torch.equal(zero, torch.zeros(2, 3, 4, dtype=dtype))
