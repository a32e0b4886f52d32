"""The CLIP-driven universal model's text-conditioned head, and the ``clip-driven`` backbone that carries it.

Liu, Zhang, Chen, Xiao, Landman, Yuan, Yuille, Tang and Zhou, "CLIP-Driven Universal Model for Organ
Segmentation and Tumor Detection", ICCV 2023 (official code: github.com/ljwztc/CLIP-Driven-Universal-Model).
The model keeps a CLIP text embedding ``w_k`` of "A computerized tomography of a [CLS]" for every class;
a text branch and the image's global feature ``g`` (global average pooling of the encoder's output)
generate, per class, the parameters ``theta_k = controller([relu(W_g g), relu(W_t w_k)])`` of a small
dynamic head -- three 1x1(x1) convolutions (8 -> 8 -> 8 -> 1 channels, ReLU between) applied to the
decoder's features after an 8-channel projection -- that outputs one binary (sigmoid) mask per class.

:class:`TextDrivenClassifier` is that head behind the :class:`~jascl.networks.classifier.PixelClassifier`
interface (``forward(features)``, ``grow``, ``num_classes``, ``weight``), so the loop, prototypes and every
method use it as they use the pixel classifier:

* row 0 (background) has the constant logit 0, every other row ``k`` the dynamic head's output for its
  text embedding: ``sigmoid(l_k) > 0.5`` is ``l_k > 0``, so the arg-max over the rows is the paper's
  per-class thresholding (background where no class is positive; the largest where several are), and a
  softmax over the rows stays as expressive as with a free background row;
* ``weight`` (K, D) holds the rows' text embeddings: row ``k`` starts at CLIP's vector of class ``k`` and
  is trained with the head (a parameter like every classifier row, so freezing policies and GAS act on it);
* growing appends the new classes' text embeddings; the shared head (text and image projections,
  controller, feature projection) is untouched, and a row's output depends only on that head, the image
  and the row's own embedding, so old rows' outputs stay identical;
* bare vectors (N, C) (replayed prototypes) are classified as one-pixel images: their global feature is
  the vector itself.

Deviations from the paper, to fit the loop's classifier interface:

* the global feature is the average of the *decoder's* output features (the classifier sees only them),
  through a linear map and a ReLU, not of the encoder's bottleneck through GroupNorm-ReLU-conv;
* the feature projection is a 1x1 convolution on the backbone's features (which are normalised and
  activated already), without the paper's GroupNorm-ReLU in front;
* the text embeddings are trained with the head (the paper keeps them fixed) -- see above;
* background is a row with logit 0 rather than "no class positive" in a multi-label output: two classes
  cannot both be predicted at one voxel.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from jascl.errors import ConfigError
from jascl.networks.base import BACKBONES, Backbone
from jascl.networks.classifier import PixelClassifier
from jascl.networks.text_embeddings import ROWS_KEY, load_text_embeddings, read_metadata


def head_param_count(channels: int) -> int:
    """Parameters of one dynamic head ``channels -> channels -> channels -> 1`` (weights and biases): 153 for 8."""
    return 2 * channels * channels + channels + 2 * channels + 1


def dynamic_heads(h: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """Apply one dynamic 1x1 head per (sample, class) to per-pixel features.

    Each head is three 1x1 convolutions ``c -> c -> c -> 1`` with ReLUs between them; its
    ``head_param_count(c)`` parameters are laid out as ``[W1 (c*c, out x in), W2 (c*c), w3 (c), b1 (c), b2 (c),
    b3 (1)]`` (weights first, then biases, as the official ``parse_dynamic_params``). The CLIP-driven universal
    model and CLIP-CT (same group, same head) both use it.

    Args:
        h: (B, c, *spatial) head inputs (2D or 3D).
        params: (B, K, head_param_count(c)) parameters of K heads per sample.

    Returns:
        (B, K, *spatial) logits.
    """
    b, c = h.shape[:2]
    k = params.shape[1]
    if params.shape[2] != head_param_count(c):
        raise ValueError(f"{params.shape[2]} head parameters for {c} channels; expected {head_param_count(c)}")
    w1, w2, w3, b1, b2, b3 = torch.split(params, [c * c, c * c, c, c, c, 1], dim=2)
    w1, w2 = w1.reshape(b, k, c, c), w2.reshape(b, k, c, c)
    ones = (1,) * (h.dim() - 2)
    x = F.relu(torch.einsum("bi...,bkoi->bko...", h, w1) + b1.reshape(b, k, c, *ones))
    x = F.relu(torch.einsum("bki...,bkoi->bko...", x, w2) + b2.reshape(b, k, c, *ones))
    return torch.einsum("bki...,bki->bk...", x, w3) + b3.reshape(b, k, *ones)


def onehot_embeddings(all_classes: Sequence[int], classes: Sequence[int]) -> torch.Tensor:
    """(len(classes), len(all_classes)) one-hot class codes (the CLIP-free ablation of the CLIP-driven universal
    model and of CLIP-CT): row i = e_j with j the position of ``classes[i]`` among ``all_classes``."""
    index = {c: j for j, c in enumerate(all_classes)}
    out = torch.zeros(len(classes), len(all_classes))
    for i, c in enumerate(classes):
        out[i, index[c]] = 1.0
    return out


class TextDrivenClassifier(PixelClassifier):
    """The CLIP-driven universal model's head as a growable pixel classifier (module docstring).

    Args:
        in_channels: feature channels C of the backbone.
        text: (K, D) text embeddings of the rows, row 0 = background (its vector is not used).
        table: optional (R, D) text embeddings of every row the classifier may grow to (R >= K), in row
            order; :meth:`grow` without embeddings takes the next rows from it.
        hidden: width of the text and image projections (official code: 256).
        head_channels: channels h of the dynamic head (official code: 8).
        temperature: kept for the interface; unused.
    """

    table: torch.Tensor | None

    def __init__(
        self,
        in_channels: int,
        text: torch.Tensor,
        table: torch.Tensor | None = None,
        hidden: int = 256,
        head_channels: int = 8,
        temperature: float = 10.0,
    ) -> None:
        nn.Module.__init__(self)
        if text.dim() != 2 or text.shape[0] < 1:
            raise ValueError(f"text embeddings must be (K, D) with K >= 1, got {tuple(text.shape)}")
        self.in_channels = in_channels
        self.cosine = False
        self.temperature = temperature
        self.head_channels = head_channels
        self.weight = nn.Parameter(text.detach().to(torch.float32).clone())
        self.register_parameter("bias", None)
        dim = text.shape[1]
        self.text_proj = nn.Linear(dim, hidden)
        self.global_proj = nn.Linear(in_channels, hidden)
        self.controller = nn.Linear(2 * hidden, head_param_count(head_channels))
        self.feature_proj = nn.Linear(in_channels, head_channels)
        self.register_buffer("table", None if table is None else table.detach().to(torch.float32), persistent=False)

    @property
    def text_dim(self) -> int:
        return self.weight.shape[1]

    def class_parameters(self, features: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        """theta (B, K, P) of the dynamic heads of ``text`` (K, D) rows for images of ``features`` (B, C, ...)."""
        pooled = features if features.dim() == 2 else features.flatten(2).mean(dim=2)
        image = F.relu(self.global_proj(pooled))  # (B, hidden)
        # F.linear, not the module: ``text`` is a view of a parameter, which under no_grad still requires grad
        # and has no grad_fn, and module hooks (FlopCounterMode's tracker in jascl model-info) reject such inputs
        words = F.relu(F.linear(text, self.text_proj.weight, self.text_proj.bias))  # (K, hidden)
        batch, classes = image.shape[0], words.shape[0]
        cond = torch.cat([image[:, None].expand(batch, classes, -1), words[None].expand(batch, classes, -1)], dim=2)
        return self.controller(cond)

    def forward(self, features: torch.Tensor, unit: bool = False) -> torch.Tensor:
        """(B, C, *spatial) -> (B, K, *spatial) logits; (N, C) -> (N, K). ``unit`` is ignored (no cosine)."""
        text = self.weight  # read once: under GAS every read draws fresh noise
        theta = self.class_parameters(features, text[1:])
        spatial = features.shape[2:]
        pixels = features[:, :, None] if features.dim() == 2 else features.flatten(2)  # (B, C, S)
        x = torch.einsum("bcs,hc->bhs", pixels, self.feature_proj.weight) + self.feature_proj.bias[:, None]
        out = dynamic_heads(x, theta)  # (B, K-1, S)
        logits = torch.cat([out.new_zeros(out.shape[0], 1, out.shape[2]), out], dim=1)
        return logits[:, :, 0] if features.dim() == 2 else logits.reshape(*logits.shape[:2], *spatial)

    @torch.no_grad()
    def grow(self, num_new: int, init: torch.Tensor | None = None, embeddings: torch.Tensor | None = None) -> None:
        """Append ``num_new`` rows with their classes' text embeddings; old rows and the head are kept bit-exactly.

        Args:
            num_new: rows to add.
            init: ignored (prototype imprinting does not apply: a row is its class's text embedding).
            embeddings: (num_new, D) text embeddings of the new classes; None takes the next rows of ``table``.
        """
        if num_new <= 0:
            return
        old = self.weight.data
        if embeddings is None:
            start = old.shape[0]
            if self.table is None or self.table.shape[0] < start + num_new:
                have = 0 if self.table is None else self.table.shape[0] - 1
                raise ConfigError(
                    f"clip-driven classifier: no text embedding for rows {start}..{start + num_new - 1} "
                    f"(the text embeddings list {have} classes); write them for the whole protocol "
                    "with `jascl text-embeddings --protocol NAME`"
                )
            embeddings = self.table[start : start + num_new]
        if embeddings.shape != (num_new, old.shape[1]):
            raise ConfigError(
                f"clip-driven classifier: new text embeddings have shape {tuple(embeddings.shape)}, "
                f"expected {(num_new, old.shape[1])}"
            )
        self.weight = nn.Parameter(torch.cat([old, embeddings.to(old)]), requires_grad=self.weight.requires_grad)

    def extra_repr(self) -> str:
        return (
            f"in_channels={self.in_channels}, num_classes={self.num_classes}, text_dim={self.text_dim}, "
            f"head_channels={self.head_channels}"
        )


def protocol_rows(path: str | Path) -> list[str]:
    """Class names in classifier-row order (background first) that ``jascl text-embeddings`` wrote into ``path``."""
    rows = read_metadata(path).get(ROWS_KEY)
    if rows is None:
        raise ConfigError(
            f"{path}: the text embeddings file does not list the protocol's classes in row order; write it with "
            "`jascl text-embeddings --protocol NAME` or set backbone_args.classes"
        )
    names = json.loads(rows)
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names) or len(names) < 1:
        raise ConfigError(f"{path}: metadata {ROWS_KEY!r} is not a list of class names")
    return names


def row_embeddings(path: str | Path, rows: Sequence[str]) -> torch.Tensor:
    """(len(rows), D): the text embeddings of ``rows`` (row 0, background, is zeros and need not be in the file)."""
    text = load_text_embeddings(path, list(rows[1:]))
    return torch.cat([text.new_zeros(1, text.shape[1]), text])


class ClipDrivenBackbone(Backbone):
    """A segmentation body (default the U-Net) whose classifier is the text-conditioned head.

    The features are the body's; :meth:`make_classifier` returns a :class:`TextDrivenClassifier`
    over the text embeddings of the protocol's classes (``embeddings``, a file written by
    ``jascl text-embeddings --protocol NAME``, which lists the classes in row order).

    Args:
        spatial_dims: 2 or 3.
        in_channels: input channels.
        embeddings: the text embeddings file (required with ``encoding="clip"``).
        classes: class names in row order, background first (default: the file's list; required
            with ``encoding="onehot"``).
        encoding: "clip" (the embeddings file) or "onehot" (one-hot codes of ``classes``: the paper's
            ablation of the text embeddings, and a way to use the backbone without CLIP).
        body: the registered backbone that computes the features (not ``clip-driven``).
        hidden: width of the head's text and image projections (official code: 256).
        head_channels: channels of the dynamic head (official code: 8).
        **body_args: arguments of the body.
    """

    def __init__(
        self,
        spatial_dims: int = 2,
        in_channels: int = 1,
        embeddings: str | None = None,
        classes: Sequence[str] | None = None,
        encoding: str = "clip",
        body: str = "unet",
        hidden: int = 256,
        head_channels: int = 8,
        **body_args,
    ) -> None:
        super().__init__()
        if encoding not in ("clip", "onehot"):
            raise ConfigError(f"backbone clip-driven: encoding={encoding!r}; use clip or onehot")
        if encoding == "onehot":
            if not classes:
                raise ConfigError(
                    "backbone clip-driven: encoding=onehot needs backbone_args.classes (names, background first)"
                )
        elif not embeddings:
            raise ConfigError(
                "backbone clip-driven: set backbone_args.embeddings to a text embeddings file "
                "(`jascl text-embeddings --weights CLIP_FILE --protocol NAME --out FILE.safetensors`)"
            )
        if body == "clip-driven":
            raise ConfigError("backbone clip-driven: backbone_args.body must be another backbone (e.g. unet)")
        self.body = BACKBONES.get(body)(spatial_dims=spatial_dims, in_channels=in_channels, **body_args)
        self.spatial_dims = spatial_dims
        self.in_channels = in_channels
        self.feature_channels = self.body.feature_channels
        self.size_divisor = self.body.size_divisor
        self.layer_aliases = {k: f"body.{v}" for k, v in self.body.layer_aliases.items()}
        if encoding == "onehot":
            assert classes is not None
            self.rows = list(classes)
            self.table = torch.cat([torch.zeros(1, len(self.rows) - 1), torch.eye(len(self.rows) - 1)])
        else:
            assert embeddings is not None
            self.rows = list(classes) if classes is not None else protocol_rows(embeddings)
            self.table = row_embeddings(embeddings, self.rows)
        self.hidden = hidden
        self.head_channels = head_channels

    def input_size(self, size: Sequence[int]) -> tuple[int, ...]:
        return self.body.input_size(size)

    def smallest_patch(self, size: Sequence[int]) -> tuple[int, ...]:
        return self.body.smallest_patch(size)

    def check_input_size(self, size: tuple[int, ...], what: str) -> None:
        self.body.check_input_size(size, what)

    def decoder_prefixes(self) -> tuple[str, ...] | None:
        inner = self.body.decoder_prefixes()
        return tuple(f"body.{p}" for p in inner) if inner else None

    def frozen_modules(self, session: int = 1) -> list[nn.Module]:
        return self.body.frozen_modules(session)

    def make_classifier(self, num_classes: int, cosine: bool = True, temperature: float = 10.0) -> PixelClassifier:
        """The text-conditioned head over the first ``num_classes`` rows (``cosine`` does not apply)."""
        if num_classes > len(self.rows):
            raise ConfigError(
                f"backbone clip-driven: {num_classes} classifier rows, but the text embeddings list "
                f"{len(self.rows)} (background included)"
            )
        return TextDrivenClassifier(
            self.feature_channels, self.table[:num_classes], self.table, self.hidden, self.head_channels, temperature
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def clip_driven(spatial_dims: int = 2, in_channels: int = 1, **kwargs) -> Backbone:
    """The ``clip-driven`` backbone (:class:`ClipDrivenBackbone`)."""
    return ClipDrivenBackbone(spatial_dims=spatial_dims, in_channels=in_channels, **kwargs)


# Registered only where the segmenter asks its backbone for the classifier (``Backbone.make_classifier``):
# elsewhere it would silently get a plain pixel classifier. Without it, ``--methods clip-driven`` puts the
# same head on any backbone.
if hasattr(Backbone, "make_classifier"):
    BACKBONES.register("clip-driven", doc="CLIP-driven universal model: a body (U-Net) + text-conditioned heads")(
        clip_driven
    )
