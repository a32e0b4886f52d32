"""FeCAM: a frozen backbone and per-class Mahalanobis-distance classification.

Goswami, Liu, Twardowski, van de Weijer, "FeCAM: Exploiting the Heterogeneity
of Class Distributions in Exemplar-Free Continual Learning", NeurIPS 2023
(official code github.com/dipamgoswami/FeCAM, ``models/base.py`` and
``utils/maha_utils.py``; the few-shot experiments plug the same classifier
into other backbones).

What it does:

* Session 0 trains normally (so the shared base model is reused) and predicts
  with the cosine classifier, which is what the official code does in the first
  task (nearest class mean on normalised features and classifier weights).
* After the base session the backbone is frozen and nothing is trained: the
  incremental sessions are training-free (here: the optimiser has learning
  rate 0, so the checkpoint equals the grown base model).
* At the end of every session, for each class labelled in it, FeCAM keeps the
  class mean mu_c of the features and the covariance S_c of the Tukey-
  transformed features (Tukey's ladder of powers, x -> x^beta, beta = 0.5).
  S_c is shrunk (paper eq. 6, alpha1 = alpha2 = 1; the official code applies
  the shrinkage twice) and normalised to a correlation matrix.
* In incremental sessions a feature x is classified by the smallest squared
  Mahalanobis distance (paper eq. 4 with the official normalisation)::

      D_c(x) = (n(T(x)) - n(T(mu_c)))^T pinv(S~_c) (n(T(x)) - n(T(mu_c)))

  with T the Tukey transform and n the L2 normalisation.

Prediction is implemented by temporarily replacing ``state.model.classifier``
with a :class:`FeCAMHead` (features -> logits ``-D_c``) between
``before_eval`` and ``after_eval``; checkpoints keep the standard layout and
the statistics are saved as plugin state (and recomputed on ``session_restored``).

Deviations needed for segmentation under joint nonstationarity:

* Features are per pixel; statistics are streamed over every labelled pixel
  of the session's training data (training labels).
* A class taught again in a new domain, and the background of every session
  (``background: every_session``), get one Gaussian per (session, class);
  a class's distance is the smallest over its Gaussians. ``background: base``
  keeps only the base session's background statistics.
* The backbones here end in LeakyReLU/PReLU, so features can be negative; the
  Tukey transform is applied sign-preservingly, sign(x)|x|^beta (identical to
  x^beta on the non-negative ReLU features of the paper). beta = 0 (the log
  transform) is therefore not offered.
* A class with fewer than two labelled pixels gets an identity covariance.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from jascl.engine.plugin import Method, Plugin
from jascl.engine.prototypes import align_labels
from jascl.methods.baselines.fewshot._shared import eval_features
from jascl.methods.common import labelled_loader
from jascl.methods.options import check_options, option
from jascl.methods.registry import METHODS

if TYPE_CHECKING:
    from jascl.engine.config import RunConfig
    from jascl.engine.state import LoopState

#: logit of a seen class without statistics (finite, so softmax stays defined)
NO_CLASS_LOGIT = -1e30


def tukey_transform(x: torch.Tensor, beta: float = 0.5) -> torch.Tensor:
    """Tukey's ladder of powers, sign-preserving: sign(x) |x|^beta (= x^beta for x >= 0). Any shape."""
    return torch.sign(x) * x.abs().pow(beta)


def shrink_covariance(cov: torch.Tensor, alpha1: float = 1.0, alpha2: float = 1.0) -> torch.Tensor:
    """Covariance shrinkage (paper eq. 6, official ``shrink_cov``).

    S + alpha1 V1 I + alpha2 V2 (1 - I), with V1 the mean of the diagonal and V2
    the mean of the non-zero off-diagonal entries of S (0 if there are none).

    Args:
        cov: (C, C) covariance.
    """
    c = cov.shape[0]
    eye = torch.eye(c, dtype=cov.dtype, device=cov.device)
    v1 = torch.diagonal(cov).mean()
    off = cov * (1 - eye)
    nonzero = off != 0
    v2 = off[nonzero].mean() if nonzero.any() else cov.new_zeros(())
    return cov + alpha1 * v1 * eye + alpha2 * v2 * (1 - eye)


def correlation_matrix(cov: torch.Tensor) -> torch.Tensor:
    """S_ij / (sigma_i sigma_j) (official ``normalize_cov``). (C, C) -> (C, C)."""
    sd = torch.sqrt(torch.diagonal(cov))
    return cov / (sd[:, None] * sd[None, :])


def fecam_precision(
    cov: torch.Tensor, alpha1: float = 1.0, alpha2: float = 1.0, shrink_passes: int = 2, normalise: bool = True
) -> torch.Tensor:
    """The matrix used in the distance: pinv of the shrunk (``shrink_passes`` times), normalised covariance. (C, C)."""
    for _ in range(shrink_passes):
        cov = shrink_covariance(cov, alpha1, alpha2)
    if normalise:
        cov = correlation_matrix(cov)
    return torch.linalg.pinv(cov)


def mahalanobis_sq(x: torch.Tensor, mean: torch.Tensor, precision: torch.Tensor) -> torch.Tensor:
    """Squared Mahalanobis distance (x - m)^T P (x - m).

    Args:
        x: (N, C) vectors.
        mean: (C,) class mean.
        precision: (C, C) inverse (shrunk, normalised) covariance P.

    Returns:
        (N,) distances.
    """
    d = x - mean
    return ((d @ precision) * d).sum(dim=1)


#: pixels :meth:`GaussianAccumulator.update` takes at once: a class's float64 copy of its pixels' features and their
#: Tukey transform are bounded by it (256 MiB each at 32 channels), not by the volume (a background of 17 million
#: voxels of a paper-scale CT: 4.3 GB each)
CHUNK_PIXELS = 1 << 20


class GaussianAccumulator:
    """Streams, per class, the pixel count, the mean of raw features and the covariance of Tukey-transformed ones."""

    def __init__(self, classes: list[int], beta: float) -> None:
        self.classes = classes
        self.beta = beta
        self.n: dict[int, int] = {}
        self.sum: dict[int, torch.Tensor] = {}
        self.sum_t: dict[int, torch.Tensor] = {}
        self.outer_t: dict[int, torch.Tensor] = {}

    @torch.no_grad()
    def update(self, features: torch.Tensor, labels: torch.Tensor) -> None:
        """features (B, C, *spatial'), labels (B, *spatial) class ids (resized to the features, nearest). A batch of
        more than :data:`CHUNK_PIXELS` pixels goes one sample at a time, in slabs along the first spatial axis of at
        most that many pixels (the same pixels; the sums in another order)."""
        lab = align_labels(labels, features.shape[2:])
        if lab.numel() <= CHUNK_PIXELS:
            self._add(features.movedim(1, -1), lab)
            return
        per_row = max(1, lab[0, 0].numel())  # pixels of one index along the first spatial axis
        step = max(1, CHUNK_PIXELS // per_row)
        for b in range(lab.shape[0]):
            for start in range(0, lab.shape[1], step):
                self._add(features[b, :, start : start + step].movedim(0, -1), lab[b, start : start + step])

    def _add(self, flat: torch.Tensor, lab: torch.Tensor) -> None:
        for c in self.classes:
            mask = lab == c
            if not mask.any():
                continue
            x = flat[mask].double()
            t = tukey_transform(x, self.beta)
            if c not in self.n:
                self.n[c], self.sum[c], self.sum_t[c] = 0, 0.0, 0.0
                self.outer_t[c] = 0.0
            self.n[c] += x.shape[0]
            self.sum[c] = self.sum[c] + x.sum(0).cpu()
            self.sum_t[c] = self.sum_t[c] + t.sum(0).cpu()
            self.outer_t[c] = self.outer_t[c] + (t.t() @ t).cpu()

    def compute(self) -> dict[int, tuple[torch.Tensor, torch.Tensor, int]]:
        """class -> (mean of raw features (C,), unbiased covariance of Tukey features (C, C), pixel count)."""
        out = {}
        for c, n in self.n.items():
            mean = self.sum[c] / n
            if n >= 2:
                m_t = self.sum_t[c] / n
                cov = (self.outer_t[c] - n * torch.outer(m_t, m_t)) / (n - 1)
            else:
                cov = torch.eye(mean.numel(), dtype=torch.float64)
            out[c] = (mean.float(), cov.float(), n)
        return out


class FeCAMHead(nn.Module):
    """Logits -D_c(x) from per-(session, class) Gaussians; replaces the pixel classifier during evaluation.

    Args:
        means: (G, C) class means of raw features.
        precisions: (G, C, C) matrices of :func:`fecam_precision`.
        rows: (G,) classifier row (index into ``state.seen``) of each Gaussian.
        num_classes: K, rows of the output.
        beta: Tukey exponent.

    Forward: (B, C, *spatial) -> (B, K, *spatial), or (N, C) -> (N, K); a row's
    logit is minus its smallest distance; rows without a Gaussian get a very
    negative constant.
    """

    def __init__(
        self, means: torch.Tensor, precisions: torch.Tensor, rows: torch.Tensor, num_classes: int, beta: float
    ) -> None:
        super().__init__()
        self.register_buffer("means", F.normalize(tukey_transform(means, beta), dim=1))
        self.register_buffer("precisions", precisions)
        self.register_buffer("rows", rows.long())
        self._num_classes = num_classes
        self.beta = beta
        self.chunk = 1 << 18  # pixels per distance computation

    @property
    def num_classes(self) -> int:
        return self._num_classes

    def distances(self, x: torch.Tensor) -> torch.Tensor:
        """(N, C) raw features -> (N, G) squared distances to every Gaussian."""
        z = F.normalize(tukey_transform(x.float(), self.beta), dim=1)
        return torch.stack([mahalanobis_sq(z, m, p) for m, p in zip(self.means, self.precisions)], dim=1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        flat = features.movedim(1, -1)
        shape = flat.shape[:-1]
        vectors = flat.reshape(-1, flat.shape[-1])
        chunks = []
        for start in range(0, vectors.shape[0], self.chunk):  # bounded memory for large 3D windows
            dist = self.distances(vectors[start : start + self.chunk])  # (n, G)
            logits = dist.new_full((dist.shape[0], self.num_classes), NO_CLASS_LOGIT)
            index = self.rows.to(dist.device).expand_as(dist)
            chunks.append(logits.scatter_reduce(1, index, -dist, reduce="amax", include_self=True))
        logits = torch.cat(chunks) if chunks else vectors.new_zeros(0, self.num_classes)
        return logits.reshape(*shape, self.num_classes).movedim(-1, 1)


@dataclass
class FeCAMOptions:
    """``method_args.fecam`` options (defaults: official ``exps/FeCAM_cifar100.json`` and ``models/base.py``).

    Attributes:
        beta: Tukey exponent (official 0.5); must be > 0.
        alpha1, alpha2: shrinkage of the diagonal / off-diagonal (official 1, 1).
        shrink_passes: how often the shrinkage is applied (official code: 2).
        normalise: normalise covariances to correlation matrices (official ``norm_cov``: true).
        background: "every_session" (a background Gaussian per session) or "base" (only the base session's).
    """

    beta: float = option(
        0.5, gt=0, doc="Tukey exponent (official 0.5); the log transform (beta 0) needs positive features"
    )
    alpha1: float = 1.0
    alpha2: float = 1.0
    shrink_passes: int = option(2, ge=0)
    normalise: bool = True
    background: str = option("every_session", choices=("every_session", "base"))


class FeCAMPlugin(Plugin):
    """Training-free incremental sessions with Mahalanobis-distance prediction (see module docstring)."""

    name = "fecam"
    freeze_incremental = "all_but_classifier"

    def __init__(self, options: FeCAMOptions | None = None) -> None:
        o = self.options = options or FeCAMOptions()
        check_options(o, "method_args.fecam")
        #: (session, class) -> (raw mean (C,), Tukey covariance (C, C), pixel count)
        self.stats: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, int]] = {}
        self._original: nn.Module | None = None

    def make_optimizer(self, state: LoopState, params: list, lr: float) -> torch.optim.Optimizer | None:
        if state.session.index == 0:
            return None
        return torch.optim.SGD(params, lr=0.0)  # training-free: the loop runs, nothing changes

    def _collect(self, state: LoopState) -> None:
        t = state.session.index
        classes = list(state.session.classes)
        if t == 0 or self.options.background == "every_session":
            classes = [0, *classes]
        acc = GaussianAccumulator(classes, self.options.beta)
        for features, labels in eval_features(state, state.model, labelled_loader(state), pieces=True):
            acc.update(features, labels)
        for c, value in acc.compute().items():
            self.stats[(t, c)] = value

    def after_training(self, state: LoopState) -> None:
        self._collect(state)

    def session_restored(self, state: LoopState) -> None:
        self._collect(state)

    def head(self, state: LoopState) -> FeCAMHead:
        """The FeCAM classifier over ``state.seen`` from the statistics of sessions <= the current one."""
        o = self.options
        row_of = {c: r for r, c in enumerate(state.seen)}
        keys = sorted(k for k in self.stats if k[0] <= state.session.index and k[1] in row_of)
        if not keys:
            raise RuntimeError("FeCAM has no class statistics; was session 0 trained or restored with this method?")
        means = torch.stack([self.stats[k][0] for k in keys])
        precisions = torch.stack(
            [
                fecam_precision(self.stats[k][1].double(), o.alpha1, o.alpha2, o.shrink_passes, o.normalise).float()
                for k in keys
            ]
        )
        rows = torch.tensor([row_of[k[1]] for k in keys])
        return FeCAMHead(means, precisions, rows, len(state.seen), o.beta).to(state.device)

    def before_eval(self, state: LoopState) -> None:
        if state.session.index == 0:
            return  # the official first task predicts with the (cosine) classifier
        self._original = state.model.classifier
        state.model.classifier = self.head(state)

    def after_eval(self, state: LoopState) -> None:
        if self._original is not None:
            state.model.classifier = self._original
            self._original = None

    def extra_state(self) -> dict[str, torch.Tensor]:
        out = {}
        for (s, c), (mean, cov, n) in self.stats.items():
            out[f"s{s}.c{c}.mean"] = mean
            out[f"s{s}.c{c}.cov"] = cov
            out[f"s{s}.c{c}.n"] = torch.tensor([n])
        return out

    def load_extra_state(self, tensors: dict[str, torch.Tensor]) -> None:
        for key in tensors:
            if key.endswith(".mean"):
                s, c, _ = key.split(".")
                prefix = f"{s}.{c}"
                self.stats[(int(s[1:]), int(c[1:]))] = (
                    tensors[f"{prefix}.mean"],
                    tensors[f"{prefix}.cov"],
                    int(tensors[f"{prefix}.n"][0]),
                )


@METHODS.register(
    "fecam",
    options=FeCAMOptions,
    paper="Goswami et al., NeurIPS 2023",
    doc="baseline: frozen backbone, per-class Mahalanobis classifier",
    fidelity="faithful",
)
def fecam(options: FeCAMOptions, config: RunConfig) -> Method:
    return Method("fecam", [FeCAMPlugin(options)], "FeCAM: training-free incremental sessions, Mahalanobis prediction")
