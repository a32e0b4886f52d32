"""SoftNet: a soft-subnetwork learned in the base session, only its minor weights trained afterwards.

Kang, Yoon, Madjid, Hwang, Yoo, "On the Soft-Subnetwork for Few-shot Class
Incremental Learning", ICLR 2023 (arXiv 2209.07529; official code
github.com/ihaeyong/SoftNet-FSCIL, ``methods/archs/signet.py``,
``methods/WSNBase_model.py``, ``methods/WSN_fusion_model.py``,
``methods/losses/losses.py``).

What it does:

* Every masked weight W (below) gets a learnable score tensor s of its shape.
  Per layer, the top-c share of the weights by |s| form the *major* subnetwork
  (mask 1); the rest form the *minor* subnetwork, whose mask values are soft,
  drawn from U[0, 1)::

      m_soft = 1                 where |s| is among the top c of the layer
             = u ~ U[0, 1)       elsewhere
      forward weight = W * m_soft

  (:func:`major_mask`, :func:`soft_subnetwork_mask`). In session 0 the masked
  network is trained with the loop's supervised loss; W and s are both learned
  (the loop's optimiser). The top-c selection has no gradient, so s receives
  the gradient of the mask itself, straight through (:func:`straight_through`,
  as the official ``GetSubnetFaster.backward``: dL/ds = dL/dm). The soft values
  are drawn afresh at every training forward (global random stream, inside the
  training step); evaluation forwards use one fixed draw per layer, made from
  a generator seeded by the run's seed.
* At the end of session 0 each layer's mask is fixed: the final top-c
  selection of the scores, with that fixed draw as the minor values.
* Incremental sessions: the major subnetwork is frozen and only the minor
  weights are trained (:func:`minor_only_gradient` on the gradient of W; major
  entries are also copied back after every update, so neither weight decay nor
  momentum can move them). Every other parameter (biases, normalisation layers,
  the classifier) is frozen; normalisation layers stay in training mode (the
  official code fine-tunes with ``model.train()``). The loss is the official incremental
  metric loss (``IncrementalCPTFixPNLoss``, cosine with temperature tau):
  cross-entropy over the cosine similarities / tau of each labelled pixel's
  feature to the prototypes of every seen class, where the new classes'
  prototypes are the batch means of their L2-normalised pixel features
  (differentiable) and every other class keeps a fixed prototype
  (:func:`prototype_metric_loss`). After training, the new classes' rows are
  imprinted again from their eq. 2 prototypes computed with the fine-tuned
  network (the official code recomputes the novel prototypes after fine-tuning
  and predicts by nearest prototype).

Masked weights: every backbone module's own ``weight`` parameter of rank >= 2
(2D/3D convolutions, transposed convolutions, linear layers, in any registered
backbone), put behind a :mod:`torch.nn.utils.parametrize` parametrization, so no
backbone is rewritten. Norm layers, biases (rank 1) and the pixel classifier
are not masked (the official ResNet masks convolutions only, ``mask_fc=False``);
weights of modules a backbone freezes in incremental sessions (SAM's image
encoder) are left alone.

State: during a session the scores, the fixed draws and the raw weights live in
the model (parametrizations), so in-session checkpoints hold them. At the end
of every session the parametrizations are removed with the *effective* weight
W * m_soft left in place, so the session checkpoint has the standard layout and
is the network SoftNet evaluates; the masks and the raw minor weights (which
W * m cannot give back where m is small) are saved as plugin state
(``plugins.safetensors``: ``<layer>.mask``, ``<layer>.minor``) and brought back
by :meth:`SoftNetPlugin.load_extra_state` when a saved session is reused. The
scores are not kept after session 0 (the masks are fixed then).

Adaptations to dense segmentation:

* The base classifier is the loop's (cosine) pixel classifier trained with the
  run's DiceCE (the paper trains a linear classifier with cross-entropy); its
  rows serve as the fixed prototypes of the base classes and background, which
  the loop's evaluation uses (the official code predicts base classes with
  class-mean prototypes, NCM). Prediction is the cosine classifier, whose new
  rows are the new classes' normalised prototypes: nearest prototype by cosine.
* The metric loss is per pixel, on the features the classifier sees (labels
  resized to them, nearest); a new class absent from a batch keeps its
  imprinted row as prototype in that step. A class taught again in a new domain
  (recurring) keeps its old row as a fixed prototype, as background does.

Deviations from the paper, with reasons:

* Tie-breaking at the top-c threshold: weights whose |s| equals the threshold
  stay minor (so at most round(c n) weights are major; the official percentile
  rule keeps ties major). Ties do not occur with continuous scores.
* The official incremental code fine-tunes the minor weights of one chosen
  layer (``finetune_layer``) and keeps resampling parts of the mask; here every
  masked layer's minor weights train, with the fixed mask that is also used for
  evaluation, as the paper describes the method.
* Incremental learning rate: the official incremental configuration's 1e-3
  (``lr_incremental``), with the run's optimiser settings (momentum, weight
  decay, schedule); the base session uses the run's configuration.
* Session-0 uses the run's supervised loss (DiceCE) instead of cross-entropy,
  like every baseline here.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from jascl.data.sampling import derive_seed
from jascl.engine.defaults import default_supervised_loss
from jascl.engine.optim import make_optimizer
from jascl.engine.plugin import Method, Plugin
from jascl.engine.prototypes import align_labels
from jascl.errors import ConfigError
from jascl.methods.baselines.fewshot._soft_subnetwork import (
    SoftSubnetwork,
    attach_fixed,
    attach_learnable,
    detach_all,
    masked_layers,
    minor_only_gradient,
    prototype_metric_loss,
)
from jascl.methods.options import check_options, option
from jascl.methods.registry import METHODS

if TYPE_CHECKING:
    from jascl.engine.config import RunConfig
    from jascl.engine.state import LoopState


# ------------------------------------------------------------------------------------------------ pure functions


@dataclass
class SoftNetOptions:
    """``method_args.softnet`` options (defaults: the official SoftNet configuration and loss).

    Attributes:
        capacity: c, the share of each layer's weights in the major subnetwork (official CIFAR-100 base
            configuration ``sparsity: 0.03``: 3% of the weights are minor, c = 97%).
        tau: temperature of the incremental metric loss (official ``IncrementalCPTFixPNLoss``: 0.1).
        lr_incremental: learning rate of the minor weights in incremental sessions (official incremental
            configuration: 1e-3); null = the run's ``lr_incremental``.
    """

    capacity: float = option(0.97, gt=0, le=1, doc="c: share of each layer's weights in the major subnetwork")
    tau: float = option(0.1, gt=0, doc="temperature of the incremental metric loss")
    lr_incremental: float | None = option(0.001, gt=0, doc="incremental learning rate (null: the run's)")


class SoftNetPlugin(Plugin):
    """Soft-subnetwork masks learned in session 0; only minor weights train afterwards (see the module docstring)."""

    name = "softnet"
    loss_terms = ("softnet_metric",)
    changes_base_session = True
    # the plugin freezes all but the minor weights itself, so the loop must leave the backbone trainable
    freeze_incremental = "none"
    # session 0 adds the loop's "seg" term itself; incremental sessions use the metric loss alone
    replaces = ("supervised-loss",)
    snapshot_exclude = ("_layers", "_hooks", "_major")

    def __init__(self, options: SoftNetOptions | None = None) -> None:
        self.options = options or SoftNetOptions()
        check_options(self.options, "method_args.softnet")
        #: layer path -> fixed soft mask (CPU), from the end of session 0
        self.masks: dict[str, torch.Tensor] = {}
        #: layer path -> raw minor weights W[mask < 1] (CPU, 1-D) at the end of the last session
        self.minor: dict[str, torch.Tensor] = {}
        self._layers: dict[str, tuple[nn.Module, SoftSubnetwork]] = {}
        self._hooks: list = []
        self._major: dict[str, torch.Tensor] = {}

    # -- in-session state lives in the model (parametrizations) and the optimiser; masks are set up again
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def make_optimizer(self, state: LoopState, params: list, lr: float) -> torch.optim.Optimizer | None:
        if state.session.index == 0 or self.options.lr_incremental is None:
            return None
        return make_optimizer(state.config, params, self.options.lr_incremental)

    # -- events

    def before_session(self, state: LoopState) -> None:
        model, t = state.model, state.session.index
        if not model.classifier.cosine:
            raise ConfigError("method softnet: predicts by cosine similarity to prototypes; set classifier: cosine")
        layers = masked_layers(model)
        if not layers:
            raise ConfigError(
                f"method softnet: backbone {state.config.backbone!r} has no trainable convolution or linear weight "
                "to mask"
            )
        self._layers, self._hooks, self._major = {}, [], {}
        if t == 0:
            generator = torch.Generator().manual_seed(derive_seed(state.seed, "softnet"))
            self._layers = attach_learnable(layers, self.options.capacity, generator)
            return
        missing = sorted(set(layers) - set(self.masks))
        if missing:
            raise ConfigError(
                f"method softnet: no soft-subnetwork mask for {missing[0]} (and {len(missing) - 1} more); "
                "session 0 must be trained (or restored) with softnet and this backbone"
            )
        for p in model.parameters():
            p.requires_grad_(False)
        self._layers = attach_fixed(layers, self.masks, self.minor)
        for path, (module, fixed) in self._layers.items():
            original = module.parametrizations["weight"].original
            original.requires_grad_(True)
            self._hooks.append(original.register_hook(partial(minor_only_gradient, mask=fixed.mask)))
            self._major[path] = original.detach().clone()

    def after_forward(self, state: LoopState) -> None:
        if state.session.index == 0:
            state.losses["seg"] = default_supervised_loss(state)
            return
        assert state.output is not None and state.batch is not None  # set by the loop before after_forward
        features = state.output.features
        labels = align_labels(state.batch["label"].to(state.device), features.shape[2:])
        rows = [state.seen.index(c) for c in state.session.new_classes if c in state.seen]
        state.losses["softnet_metric"] = prototype_metric_loss(
            features, state.class_index(labels), state.model.classifier.weight, rows, self.options.tau
        )

    @torch.no_grad()
    def after_update(self, state: LoopState) -> None:
        if state.session.index == 0:
            return
        for path, (module, fixed) in self._layers.items():
            original = module.parametrizations["weight"].original
            original.copy_(torch.where(fixed.mask == 1, self._major[path], original))

    def after_training(self, state: LoopState) -> None:
        if state.session.index == 0:
            for _, soft in self._layers.values():
                soft.fix()
            return
        new = [c for c in state.session.new_classes if c in state.seen]
        if not new:
            return
        prototypes = state.compute_prototypes(new)
        weight = state.model.classifier.weight
        with torch.no_grad():
            for c in new:
                if c in prototypes:
                    weight[state.seen.index(c)] = F.normalize(prototypes[c].to(weight), dim=0)

    def after_session(self, state: LoopState) -> None:
        for handle in self._hooks:
            handle.remove()
        for path, (mask, minor) in detach_all(self._layers).items():
            self.masks[path], self.minor[path] = mask, minor
        self._layers, self._hooks, self._major = {}, [], {}

    def extra_state(self) -> dict[str, torch.Tensor]:
        out = {}
        for path, mask in self.masks.items():
            out[f"{path}.mask"] = mask
            out[f"{path}.minor"] = self.minor[path]
        return out

    def load_extra_state(self, tensors: dict[str, torch.Tensor]) -> None:
        self.masks = {k[: -len(".mask")]: v.float() for k, v in tensors.items() if k.endswith(".mask")}
        self.minor = {k[: -len(".minor")]: v.float() for k, v in tensors.items() if k.endswith(".minor")}


@METHODS.register(
    "softnet",
    options=SoftNetOptions,
    paper="Kang et al., ICLR 2023",
    doc="baseline: soft-subnetwork (top-c% binary + U[0,1) soft mask) learned in session 0, only minor weights "
    "train afterwards; trains its own base session",
    fidelity="faithful",
)
def softnet(options: SoftNetOptions, config: RunConfig) -> Method:
    """SoftNet: learned soft-subnetwork masks; incremental sessions fine-tune only the minor weights with a
    prototype metric loss (see :mod:`jascl.methods.baselines.fewshot.softnet` for the deviations)."""
    return Method("softnet", [SoftNetPlugin(options)], "SoftNet: soft-subnetwork, minor weights trained incrementally")
