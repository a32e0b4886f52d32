"""What the contrastive baselines share: the projection head, pixel sampling, the plugin skeleton.

A contrastive baseline adds ``weight * L_contrastive`` to the loop's segmentation loss in incremental
sessions. The embeddings are the pre-classifier pixel features of sampled pixels, passed through a
small projection head g (SimCLR's two-layer MLP, Chen et al. 2020, sec. 2.1) and L2-normalised. The
head belongs to the plugin, not to the model: checkpoints keep the standard layout, the head is built
anew (seeded) at the start of every incremental session, trained with the model by the same optimiser,
and dropped afterwards, as SimCLR drops g after pre-training.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from jascl import distributed
from jascl.data.sampling import derive_seed
from jascl.engine.optim import make_optimizer
from jascl.engine.plugin import Plugin
from jascl.methods.common import SessionGate

if TYPE_CHECKING:
    from jascl.engine.state import LoopState


class ProjectionMLP(nn.Module):
    """SimCLR's projection head g: Linear(C, H) -> ReLU -> Linear(H, D), on (N, C) pixel vectors."""

    def __init__(self, channels: int, hidden: int, out: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(channels, hidden), nn.ReLU(inplace=True), nn.Linear(hidden, out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def pixel_vectors(features: torch.Tensor) -> torch.Tensor:
    """(B, C, *spatial) -> (B * prod(spatial), C), pixels in row-major (batch, then spatial) order."""
    return features.movedim(1, -1).reshape(-1, features.shape[1])


def sample_per_class(labels: torch.Tensor, per_class: int, generator: torch.Generator) -> torch.Tensor:
    """Indices of up to ``per_class`` pixels of every class present in ``labels``, drawn without replacement.

    Args:
        labels: (N,) class labels of N pixels; negative values and 255 (ignore) are never drawn.
        per_class: the most pixels taken from one class (all of them when it has fewer).
        generator: the random stream of the draw (on ``labels``' device).

    Returns:
        (M,) long indices into ``labels``, grouped by class in increasing class order.
    """
    chosen = []
    for c in torch.unique(labels).tolist():
        if c < 0 or c == 255:
            continue
        idx = torch.nonzero(labels == c).flatten()
        if idx.numel() > per_class:
            idx = idx[torch.randperm(idx.numel(), generator=generator, device=idx.device)[:per_class]]
        chosen.append(idx)
    if not chosen:
        return labels.new_zeros(0, dtype=torch.long)
    return torch.cat(chosen)


def sample_uniform(n: int, count: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """``min(count, n)`` distinct indices of ``range(n)`` drawn uniformly. (M,) long."""
    return torch.randperm(n, generator=generator, device=device)[: min(count, n)]


def step_generator(state: LoopState, *tag: object) -> torch.Generator:
    """A generator on the run's device seeded by (seed, session, epoch, iteration, rank, tag): the same draws
    on a resumed run, different draws on every step and process, and the loop's random stream untouched."""
    g = torch.Generator(device=state.device)
    seed = derive_seed(state.seed, state.session.index, state.epoch, state.iteration, distributed.rank(), *tag)
    g.manual_seed(seed)
    return g


class ContrastivePlugin(SessionGate, Plugin):
    """Skeleton of a contrastive baseline: a fresh projection head per incremental session, trained by the
    run's optimiser together with the model's trainable parameters (gradients averaged over processes).

    Subclasses implement ``after_forward`` with :meth:`project`.
    """

    name = "contrastive"

    def __init__(self, hidden: int, proj_dim: int, freeze: str | None) -> None:
        self.hidden = hidden
        self.proj_dim = proj_dim
        self.freeze_incremental = freeze
        self.head: ProjectionMLP | None = None

    def before_session(self, state: LoopState) -> None:
        if not self.active(state):
            self.head = None
            return
        channels = state.model.backbone.feature_channels
        devices = [state.device.index or 0] if state.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):  # seeded head, the loop's random stream untouched
            torch.manual_seed(derive_seed(state.seed, self.name, state.session.index))
            self.head = ProjectionMLP(channels, self.hidden or channels, self.proj_dim)
        self.head.to(state.device)

    def make_optimizer(self, state: LoopState, params: list, lr: float) -> torch.optim.Optimizer | None:
        if self.head is None:
            return None
        return make_optimizer(state.config, [*params, *self.head.parameters()], lr)

    def after_backward(self, state: LoopState) -> None:
        if self.head is not None:
            distributed.average_gradients(self.head.parameters())

    def after_session(self, state: LoopState) -> None:
        self.head = None  # as SimCLR, the head is not part of the model that is evaluated or kept

    def project(self, vectors: torch.Tensor) -> torch.Tensor:
        """(N, C) pixel features -> (N, D) unit embeddings g(h)/|g(h)|, computed in float32."""
        assert self.head is not None
        return F.normalize(self.head(vectors.float()), dim=1)
