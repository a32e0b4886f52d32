"""Per-pixel classifiers that can grow as new classes arrive.

Both classifiers hold one weight row per class, shape (K, C), and apply it to
features of any spatial rank: (B, C, *spatial) -> (B, K, *spatial), or to bare
vectors (N, C) -> (N, K) (used to replay stored prototypes through the
classifier). Keeping the weight a plain (K, C) parameter named ``weight`` lets
GAS (``jascl.methods.gas``) perturb it like any other layer's weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from jascl.networks.ops import unit_channels


def _apply_rows(features: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(B, C, *spatial) x (K, C) -> (B, K, *spatial); (N, C) x (K, C) -> (N, K)."""
    if features.dim() == 2:
        return features @ weight.t()
    return torch.einsum("bc...,kc->bk...", features, weight)


class PixelClassifier(nn.Module):
    """A 1x1(x1) convolution classifier, optionally cosine (the authors' choice).

    Cosine mode: logits = temperature * <w_k / |w_k|, f / |f|>, no bias (the
    authors' classifier: L2-normalised weights and features, temperature 10).
    Linear mode: logits = <w_k, f> + b_k, a plain 1x1 convolution.

    Args:
        in_channels: feature channels C.
        num_classes: classes K, background included (row 0 = background).
        cosine: cosine (True) or plain linear (False) classifier.
        temperature: logit scale of the cosine classifier.
    """

    def __init__(self, in_channels: int, num_classes: int, cosine: bool = True, temperature: float = 10.0) -> None:
        super().__init__()
        self.in_channels = in_channels
        self.cosine = cosine
        self.temperature = temperature
        self.weight = nn.Parameter(torch.empty(num_classes, in_channels))
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)
        if cosine:
            self.register_parameter("bias", None)
        else:
            bound = 1 / in_channels**0.5
            self.bias = nn.Parameter(torch.empty(num_classes).uniform_(-bound, bound))

    @property
    def num_classes(self) -> int:
        return self.weight.shape[0]

    def forward(self, features: torch.Tensor, unit: bool = False) -> torch.Tensor:
        """Logits of ``features``; ``unit=True`` says they are already ``F.normalize(features, dim=1)``.

        The cosine classifier then skips normalising them (constant inputs such as
        replayed prototypes are normalised once, not at every step); the linear one ignores it.
        """
        weight = self.weight  # read once: under GAS every read draws fresh noise
        if self.cosine:
            unit_features = features if unit else unit_channels(features)
            return self.temperature * _apply_rows(unit_features, F.normalize(weight, dim=1))
        logits = _apply_rows(features, weight)
        shape = (1, -1) + (1,) * (logits.dim() - 2)
        return logits + self.bias.view(shape)

    @torch.no_grad()
    def grow(self, num_new: int, init: torch.Tensor | None = None) -> None:
        """Append ``num_new`` class rows; old rows (and biases) are kept bit-exactly.

        Args:
            num_new: number of rows to add.
            init: optional (num_new, C) initial rows, e.g. the new classes'
                prototypes (weight imprinting). For the linear classifier they
                are rescaled to the mean norm of the existing rows.
        """
        if num_new <= 0:
            return
        old = self.weight.data
        new = torch.empty(num_new, self.in_channels, dtype=old.dtype, device=old.device)
        if init is not None:
            init = init.to(old)
            if init.shape != new.shape:
                raise ValueError(f"imprinting rows have shape {tuple(init.shape)}, expected {tuple(new.shape)}")
            new.copy_(F.normalize(init, dim=1) * (1.0 if self.cosine else old.norm(dim=1).mean()))
        else:
            nn.init.kaiming_uniform_(new, a=5**0.5)
        self.weight = nn.Parameter(torch.cat([old, new]), requires_grad=self.weight.requires_grad)
        if self.bias is not None:
            extra = self.bias.data.mean().expand(num_new)
            self.bias = nn.Parameter(torch.cat([self.bias.data, extra]), requires_grad=self.bias.requires_grad)

    def extra_repr(self) -> str:
        kind = f"cosine, temperature={self.temperature}" if self.cosine else "linear"
        return f"in_channels={self.in_channels}, num_classes={self.num_classes}, {kind}"
