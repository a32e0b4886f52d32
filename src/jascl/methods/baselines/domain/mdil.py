"""MDIL: multi-domain incremental learning with shared and domain-specific parameters.

Garg, Saluja, Balasubramanian, Arora, Subramanian and Jawahar, "Multi-Domain
Incremental Learning for Semantic Segmentation", WACV 2022 (official code:
github.com/prachigarg23/MDIL-SS). MDIL splits an ERFNet into

* domain-invariant parameters shared by every domain: the encoder's convolutions;
* domain-specific parameters, one copy per domain: parallel 1x1 residual
  adapters beside the encoder convolutions (output = conv(x) + adapter_d(x),
  before the normalisation), the encoder's BatchNorms, and a whole decoder
  with its output layer (a per-domain head);

and learns a new domain by (i) initialising its domain-specific parameters
from the previous domain's, (ii) freezing every earlier domain's
domain-specific parameters, (iii) training the shared parameters with a
learning rate 100x lower than the new domain-specific ones (official code:
5e-6 vs 5e-4) and (iv) distilling, on the new domain's images, the output of
every earlier domain's branch from the model of the previous step
(KL divergence, weight 0.1 in the official scripts, summed over earlier
domains). At test time the official code knows each image's domain and uses its branch.

What is domain-specific here (:func:`domain_specific_keys`), for every backbone:

* every normalisation layer of the backbone (BatchNorm / InstanceNorm /
  GroupNorm / LayerNorm and SAM's ``LayerNorm2d``): affine parameters and
  running statistics; layers inside a backbone's always-frozen modules
  (SAM's image encoder) are excluded, they never train;
* the decoder (:data:`DECODER_PREFIXES`, below the ``backbone.`` prefix):
  ``unet`` ``net.upcat_*``; ``monai-unet`` every up layer of MONAI's nested
  UNet (``net.model.2``, ``net.model.1.submodule.2``, ...) and ``out_norm``;
  ``unet3d-authors`` ``up.*``; ``medformer`` ``up.*``;
  ``deeplabv3plus`` ``net.decoder.*``; ``swinunetr`` ``net.decoder1-5``;
  ``sam-vitb`` ``decoder.*`` (the projection); another backbone needs
  ``--set method_args.mdil.decoder=[prefix, ...]``;
* the classifier (the per-domain head);
* residual adapters, kept by the plugin (not in the Segmenter): a 1x1(x1)
  convolution with the same stride beside every shared encoder convolution
  that has a spatial kernel, one input group and "same" padding; its output is
  added to the convolution's through a forward hook.

Everything else in the backbone is shared. The Segmenter's state dict stays
standard: the live model always holds the parameters of the domain trained
last (what a session checkpoint saves, loadable by anything that loads jascl
checkpoints); every domain's copy and all adapters are the plugin's extra
state (saved with each session, restored on resume).

Deviations, to fit our loop and benchmarks:

* Domain 0 is the shared base model, trained without adapters: its adapters
  are zero (the plain model) and the first new domain starts from them (MDIL
  initialises every new domain from the previous one, which here is that).
* Heads grow with the classes: a domain's head covers the classes seen when
  it last trained; when another domain's split is scored, rows added after
  that are masked (that head has no output for them). A domain that returns
  (Med JASCL-Mixed) resumes from its own stored parameters, and its earlier
  branch (teacher shared parameters + its stored copy) is distilled into the
  live model over its earlier head's rows, like every other earlier branch
  (MDIL never revisits a domain).
* A session with several domains is one "domain" (its sorted domain names joined by "+").
* The distillation uses log-probabilities (the official code passes
  probabilities to ``KLDivLoss``) and keeps earlier domains' normalisation
  statistics intact (the official code's train-mode forward through the old
  branch updates the old BatchNorm statistics).
* Optimiser: the loop's SGD (momentum, weight decay, Nesterov from the run
  configuration) with two parameter groups, not the official Adam + poly.
* Test-time domain: the official code scores each test split with its own
  domain's branch, an oracle the paper's setting (and every other method) does
  not have. By default (``domain_oracle: false``, the paper tables' plans) the
  branch of every test batch is inferred: the domain whose training images'
  intensity statistics are nearest to the batch's
  (:mod:`jascl.methods.baselines.domain.domain_inference`); the session record's
  ``mdil_domains`` counts the batches each split sent to each branch.
  ``--set method_args.mdil.domain_oracle=true`` restores the official oracle.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.func import functional_call

from jascl.engine.plugin import Method, Plugin
from jascl.errors import ConfigError
from jascl.methods.options import freeze_option, freeze_policy, option
from jascl.methods.registry import METHODS
from jascl.networks.base import eval_mode

if TYPE_CHECKING:
    from jascl.engine.config import RunConfig
    from jascl.engine.state import LoopState
    from jascl.networks.base import Segmenter
from jascl.methods.baselines.domain._shared import (
    MASKED_LOGIT,
    DomainParameters,
    _decode,
    _encode,
    _site_key,
    adapter_sites,
    domain_distillation,
    domain_key,
    domain_specific_keys,
)
from jascl.methods.baselines.domain.domain_inference import batch_statistics, input_statistics, nearest_domain

log = logging.getLogger("jascl")


@dataclass
class MDILOptions:
    """``method_args.mdil`` options (defaults: the official code and scripts).

    Attributes:
        kd_weight: lambda of the old-branch distillation (official scripts: 0.1).
        shared_lr_ratio: learning rate of the shared parameters / the session's
            learning rate (official code: 5e-6 / 5e-4 = 0.01).
        adapters: use the parallel residual adapters (MDIL's RAPs).
        decoder: decoder prefixes below ``backbone.`` for a backbone that does not name its
            decoder (empty = the backbone's own ``decoder_prefixes()``).
        freeze: "none" (default: MDIL trains shared and domain-specific
            backbone parameters), "config" or "all_but_classifier".
        domain_oracle: score each test split with its own domain's branch (the
            official code's test-time oracle); false (default) infers the branch of
            every test batch from the nearest domain statistics.
    """

    kd_weight: float = option(0.1, ge=0)
    shared_lr_ratio: float = option(0.01, ge=0)
    adapters: bool = True
    decoder: list = option([])
    freeze: str = freeze_option("none")
    domain_oracle: bool = False


class MDILPlugin(Plugin):
    """MDIL on the loop (see the module docstring for the method and every deviation).

    Events: ``before_session`` loads/initialises the session's domain and
    snapshots the shared parameters (the teacher); ``make_optimizer`` builds the
    two learning-rate groups; ``after_forward`` adds ``kd_weight * sum_d L_KD``
    over earlier domains d; ``after_training`` stores the domain's parameters;
    ``before_eval_split`` switches to the scored split's domain and
    ``after_eval`` switches back; ``session_restored`` rebuilds the plugin's
    view of a reused session (the base model becomes domain 0).
    """

    name = "mdil"
    loss_terms = ("mdil",)

    def __init__(
        self,
        kd_weight: float = 0.1,
        shared_lr_ratio: float = 0.01,
        adapters: bool = True,
        decoder: tuple[str, ...] | None = None,
        freeze: str | None = "none",
        domain_oracle: bool = False,
    ) -> None:
        self.kd_weight = kd_weight
        self.shared_lr_ratio = shared_lr_ratio
        self.use_adapters = adapters
        self.decoder = tuple(decoder) if decoder else None
        self.freeze_incremental = freeze
        self.domain_oracle = domain_oracle
        #: domain -> (2C,) intensity statistics of its training images (the test-time domain inference)
        self.stats: dict[str, torch.Tensor] = {}
        self._infer_hook: torch.utils.hooks.RemovableHandle | None = None
        self._routed: dict[str, dict[str, int]] = {}
        self.domains: dict[str, DomainParameters] = {}
        self.adapters: dict[str, nn.ModuleDict] = {}
        self._pending_adapters: dict[str, dict[str, torch.Tensor]] = {}
        self.current: str | None = None
        self.active: str | None = None  # the domain whose adapters the hooks apply
        self._model: Segmenter | None = None
        self._hooks: list = []
        self._keys: list[str] = []
        self._sites: dict[str, nn.Module] = {}
        self._mask_from: int | None = None
        self._teacher_shared: dict[str, torch.Tensor] | None = None
        self._old: list[str] = []
        self._returning = False

    # ------------------------------------------------------------ model wiring

    def _attach(self, model: Segmenter) -> None:
        """Install the adapter and head-mask hooks on ``model`` (once per model object)."""
        if self._model is model:
            return
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self._model = model
        self._keys = domain_specific_keys(model, self.decoder)
        self._sites = adapter_sites(model, self._keys) if self.use_adapters else {}
        for name, conv in self._sites.items():
            self._hooks.append(conv.register_forward_hook(self._adapter_hook(_site_key(name))))
        self._hooks.append(model.classifier.register_forward_hook(self._mask_hook))
        device = next(model.parameters()).device
        for entry in self.domains.values():
            entry.params = {k: v.to(device) for k, v in entry.params.items()}
        for key in list(self.adapters):  # rebuild for the new model object (same architecture)
            self.adapters[key] = self._new_adapters(device, self.adapters[key].state_dict())
        for key, tensors in self._pending_adapters.items():
            self.adapters[key] = self._new_adapters(device, tensors)
        self._pending_adapters = {}

    def _new_adapters(self, device: torch.device, state: dict[str, torch.Tensor] | None = None) -> nn.ModuleDict:
        """Zero-initialised adapters for every site (optionally loaded from ``state``)."""
        mods = nn.ModuleDict()
        for name, conv in self._sites.items():
            cls = nn.Conv3d if isinstance(conv, nn.Conv3d) else nn.Conv2d
            a = cls(conv.in_channels, conv.out_channels, kernel_size=1, stride=conv.stride, bias=True)
            nn.init.zeros_(a.weight)
            nn.init.zeros_(a.bias)
            mods[_site_key(name)] = a
        mods = mods.to(device)
        if state:
            mods.load_state_dict(state)
        mods.requires_grad_(False)
        return mods

    def _adapter_hook(self, key: str):
        def hook(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
            adapters = self.adapters.get(self.active) if self.active is not None else None
            if adapters is None:
                return output
            return output + adapters[key](inputs[0])

        return hook

    def _mask_hook(self, module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        if self._mask_from is None or output.shape[1] <= self._mask_from or inputs[0].dim() == 2:
            return output
        out = output.clone()
        out[:, self._mask_from :] = MASKED_LOGIT
        return out

    def _snapshot(self, model: Segmenter) -> dict[str, torch.Tensor]:
        state = model.state_dict()
        return {k: state[k].detach().clone() for k in self._keys}

    @torch.no_grad()
    def _load_domain(self, model: Segmenter, key: str) -> None:
        """Copy a domain's stored parameters into the live model; mask head rows it does not have."""
        stored = self.domains[key]
        live = model.state_dict()
        for name, value in stored.params.items():
            target = live[name]
            if name.startswith("classifier.") and target.shape != value.shape:
                target[: value.shape[0]].copy_(value)
            else:
                target.copy_(value)
        self._mask_from = len(stored.rows) if len(stored.rows) < model.num_classes else None
        self.active = key

    # ------------------------------------------------------------ events

    def before_session(self, state: LoopState) -> None:
        model = state.model
        self._attach(model)
        key = domain_key(state.session.domains)
        self._mask_from = None
        if state.session.index == 0:
            self.current = self.active = key
            self._teacher_shared, self._old, self._returning = None, [], False
            return
        previous = self.active if self.active in self.adapters else None
        if key in self.domains:  # a returning domain resumes from its own parameters
            self._load_domain(model, key)
            self._mask_from = None
        elif self.use_adapters:  # a new domain starts from the previous domain's (live parameters already are)
            device = next(model.parameters()).device
            start = self.adapters[previous].state_dict() if previous else None
            self.adapters[key] = self._new_adapters(device, copy.deepcopy(start) if start else None)
        for name, mods in self.adapters.items():
            mods.requires_grad_(name == key)
        self.current = self.active = key
        specific = set(self._keys)
        self._teacher_shared = {k: v.detach().clone() for k, v in model.state_dict().items() if k not in specific}
        self._old = [d for d in self.domains if d != key]
        self._returning = key in self.domains

    def make_optimizer(self, state: LoopState, params: list, lr: float) -> torch.optim.Optimizer | None:
        if state.session.index == 0:
            return None
        specific = set(self._keys)
        names = {id(p): n for n, p in state.model.named_parameters()}
        shared = [p for p in params if names.get(id(p)) not in specific]
        own = [p for p in params if names.get(id(p)) in specific]
        adapters = self.adapters.get(self.current)
        if adapters is not None:
            # adapters belong to the backbone: they train only if the freezing policy lets the backbone train
            train = any(p.requires_grad for p in state.model.backbone.parameters())
            adapters.requires_grad_(train)
            own += list(adapters.parameters()) if train else []
        cfg = state.config
        groups = [
            g for g in ({"params": shared, "lr": lr * self.shared_lr_ratio}, {"params": own, "lr": lr}) if g["params"]
        ]
        return torch.optim.SGD(
            groups,
            lr=lr,
            momentum=cfg.momentum,
            weight_decay=cfg.weight_decay,
            nesterov=cfg.nesterov and cfg.momentum > 0,
        )

    def _branch_logits(self, model: Segmenter, x: torch.Tensor, key: str, teacher: bool) -> torch.Tensor:
        """Logits of domain ``key``'s branch: with the current shared parameters, or the teacher's."""
        stored = self.domains[key].params
        buffers = {name for name, _ in model.named_buffers()}
        # buffers are cloned so that a train-mode forward cannot touch the stored statistics
        swap = {k: v.detach().clone() if k in buffers else v.detach() for k, v in stored.items()}
        if teacher:
            swap = {**self._teacher_shared, **swap}
        self.active = key
        try:
            return functional_call(model, swap, (x,), strict=False)
        finally:
            self.active = self.current

    def _teacher_logits(self, model: Segmenter, x: torch.Tensor, key: str) -> torch.Tensor:
        with eval_mode(model):  # the previous model is used in eval mode, as in the official code
            with torch.no_grad():
                return self._branch_logits(model, x, key, teacher=True)

    def after_forward(self, state: LoopState) -> None:
        if state.session.index == 0 or not (self._old or self._returning) or self.kd_weight == 0:
            return
        model = state.model
        x = state.batch["image"].to(state.device)
        total = None
        for key in self._old:
            kd = domain_distillation(
                self._branch_logits(model, x, key, teacher=False), self._teacher_logits(model, x, key)
            )
            total = kd if total is None else total + kd
        if self._returning:  # the returning domain's earlier branch, over its earlier head's rows
            teacher = self._teacher_logits(model, x, self.current)
            kd = domain_distillation(state.output.logits[:, : teacher.shape[1]], teacher)
            total = kd if total is None else total + kd
        state.losses[self.name] = self.kd_weight * total

    def after_training(self, state: LoopState) -> None:
        self.domains[self.current] = DomainParameters(self._snapshot(state.model), list(state.seen))
        self._remember_stats(self.current, state)
        self._teacher_shared = None

    def _remember_stats(self, key: str | None, state: LoopState) -> None:
        if key is not None and key not in self.stats and len(state.data.train.images):
            self.stats[key] = input_statistics(state.data.train.images)

    def before_eval_split(self, state: LoopState) -> None:
        key = domain_key(state.protocol.sessions[state.eval_session].domains)
        known = {k: v for k, v in self.stats.items() if k in self.domains}
        if not self.domain_oracle and not known:  # a run saved before domain statistics were kept
            log.warning("mdil: no domain statistics stored; scoring each test split with its own domain's branch")
        if self.domain_oracle or not known:
            if key not in self.domains:
                raise ConfigError(
                    f"method mdil: no parameters stored for domain {key!r} of session {state.eval_session}"
                )
            self._load_domain(state.model, key)
            return
        routed = self._routed.setdefault(key, {})
        if self._infer_hook is not None:
            self._infer_hook.remove()

        def infer(module: nn.Module, inputs: tuple) -> None:  # every test batch: the nearest domain's branch
            chosen = nearest_domain(batch_statistics(inputs[0]), known)
            routed[chosen] = routed.get(chosen, 0) + 1
            if chosen != self.active:
                self._load_domain(state.model, chosen)

        self._infer_hook = state.model.register_forward_pre_hook(infer)

    def after_eval(self, state: LoopState) -> None:
        if self._infer_hook is not None:
            self._infer_hook.remove()
            self._infer_hook = None
            state.record["mdil_domains"] = self._routed
            self._routed = {}
        self._load_domain(state.model, self.current)
        self._mask_from = None

    def session_restored(self, state: LoopState) -> None:
        self._attach(state.model)
        key = domain_key(state.session.domains)
        if key not in self.domains:  # the shared base model (trained without the method): domain 0
            self.domains[key] = DomainParameters(self._snapshot(state.model), list(state.seen))
        self._remember_stats(key, state)
        if key not in self.adapters and self.use_adapters:
            self.adapters[key] = self._new_adapters(next(state.model.parameters()).device)
        self.current = self.active = key
        self._mask_from = None

    # ------------------------------------------------------------ plugin state

    def extra_state(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        if self.current is not None:
            out["current"] = _encode(self.current)
        for i, key in enumerate(sorted(self.domains)):
            entry = self.domains[key]
            out[f"d{i}.name"] = _encode(key)
            out[f"d{i}.rows"] = torch.tensor(entry.rows, dtype=torch.long)
            for name, value in entry.params.items():
                out[f"d{i}.p.{name}"] = value.detach().cpu().clone().contiguous()
            if key in self.adapters:
                for name, value in self.adapters[key].state_dict().items():
                    out[f"d{i}.a.{name}"] = value.detach().cpu().clone().contiguous()
            if key in self.stats:
                out[f"d{i}.stats"] = self.stats[key].detach().cpu().clone().contiguous()
        return out

    def load_extra_state(self, tensors: dict[str, torch.Tensor]) -> None:
        self.domains, self._pending_adapters, self.stats = {}, {}, {}
        self.adapters = {}
        self._model = None  # adapters are rebuilt on the next model the plugin sees
        names = {k.split(".")[0]: _decode(v) for k, v in tensors.items() if k.count(".") == 1 and k.endswith(".name")}
        for index, key in names.items():
            params, adapters = {}, {}
            for name, value in tensors.items():
                if name.startswith(f"{index}.p."):
                    params[name[len(index) + 3 :]] = value
                elif name.startswith(f"{index}.a."):
                    adapters[name[len(index) + 3 :]] = value
            self.domains[key] = DomainParameters(params, tensors[f"{index}.rows"].tolist())
            if f"{index}.stats" in tensors:
                self.stats[key] = tensors[f"{index}.stats"]
            if adapters:
                self._pending_adapters[key] = adapters
        self.current = _decode(tensors["current"]) if "current" in tensors else None
        self.active = self.current


@METHODS.register(
    "mdil",
    options=MDILOptions,
    paper="Garg et al., WACV 2022",
    doc="baseline: shared encoder + per-domain adapters, norms, decoder and head; old-branch distillation",
    fidelity="faithful",
    flags=("test-time domain oracle",),
)
def mdil(o: MDILOptions, config: RunConfig) -> Method:
    """MDIL: domain-specific parameters per domain on a shared encoder (see the module docstring)."""
    plugin = MDILPlugin(
        kd_weight=o.kd_weight,
        shared_lr_ratio=o.shared_lr_ratio,
        adapters=o.adapters,
        decoder=tuple(o.decoder) or None,
        freeze=freeze_policy(o.freeze),
        domain_oracle=o.domain_oracle,
    )
    return Method("mdil", [plugin], "MDIL: domain-specific parameters per domain, shared encoder")
