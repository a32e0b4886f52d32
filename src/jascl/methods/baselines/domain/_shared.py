"""What a domain-incremental method needs to keep parameters per domain: the domain key of a session, which
parameters are domain-specific (normalisation layers, the decoder, the classifier), where parallel adapters fit, and
the old branches' distillation."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from jascl.errors import ConfigError

if TYPE_CHECKING:
    from jascl.networks.base import Segmenter


#: logit given to classifier rows a domain's head does not have (softmax -> 0)
MASKED_LOGIT = -1e9


def domain_key(domains: tuple[str, ...] | list[str]) -> str:
    """The key of a session's domain set: sorted names joined by "+" (one domain -> its name)."""
    return "+".join(sorted(domains))


def _is_norm(module: nn.Module) -> bool:
    if isinstance(module, (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm)):
        return True
    # other norms (SAM's LayerNorm2d): a leaf module whose class is named like one
    return "Norm" in type(module).__name__ and not list(module.children())


def _frozen_prefixes(model: Segmenter) -> list[str]:
    frozen = {id(m) for m in model.backbone.frozen_modules()}
    return [f"backbone.{n}." for n, m in model.backbone.named_modules() if id(m) in frozen]


def domain_specific_keys(model: Segmenter, decoder: tuple[str, ...] | None = None) -> list[str]:
    """State-dict keys of ``model`` that MDIL keeps per domain (see the module docstring).

    Args:
        model: a Segmenter.
        decoder: decoder prefixes below ``backbone.`` (None = the backbone's :meth:`~jascl.networks.base.Backbone.decoder_prefixes`).

    Raises:
        ConfigError: the backbone's decoder is unknown and no prefixes were given.
    """
    if decoder is None:
        decoder = model.backbone.decoder_prefixes()
        if decoder is None:
            raise ConfigError(
                f"method mdil: no known decoder for backbone {type(model.backbone).__name__}; "
                "name its decoder modules with --set method_args.mdil.decoder=[prefix, ...]"
            )
    frozen = _frozen_prefixes(model)
    keys = set()
    for name, module in model.backbone.named_modules():
        if _is_norm(module):
            keys.update(f"backbone.{name}.{k}" for k, _ in module.named_parameters(recurse=False))
            keys.update(f"backbone.{name}.{k}" for k, _ in module.named_buffers(recurse=False))
    for key in model.state_dict():
        if key.startswith("backbone.") and any(key[len("backbone.") :].startswith(p) for p in decoder):
            keys.add(key)
        if key.startswith("classifier."):
            keys.add(key)
    return sorted(k for k in keys if not any(k.startswith(f) for f in frozen))


def adapter_sites(model: Segmenter, specific: list[str]) -> dict[str, nn.Module]:
    """Shared convolutions that get a parallel 1x1 adapter: {module path in the Segmenter: conv}.

    A site is an ``nn.Conv2d``/``nn.Conv3d`` outside the decoder, the classifier
    and the frozen modules, with a spatial kernel, one group and "same"
    geometry (2 * padding == dilation * (kernel - 1) on every axis), so a 1x1
    convolution with its stride produces an output of the same size.
    """
    specific_modules = {k.rsplit(".", 1)[0] for k in specific}
    frozen = _frozen_prefixes(model)
    sites = {}
    for name, module in model.named_modules():
        path = name + "."
        if not isinstance(module, (nn.Conv2d, nn.Conv3d)) or any(path.startswith(f) for f in frozen):
            continue
        if name in specific_modules or not name.startswith("backbone."):
            continue
        if module.groups != 1 or module.padding_mode != "zeros" or isinstance(module.padding, str):
            continue
        kernel, pad, dil = module.kernel_size, module.padding, module.dilation
        if all(k == 1 for k in kernel) or any(2 * p != d * (k - 1) for k, p, d in zip(kernel, pad, dil)):
            continue
        sites[name] = module
    return sites


def domain_distillation(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Mean over pixels of KL(softmax(teacher) || softmax(student)) over classes (MDIL's L_KD).

    Computed in float64 so that the tiny divergences of a barely changed model
    do not vanish in rounding.

    Args:
        student_logits, teacher_logits: (B, K, *spatial); the teacher side is detached.
    """
    log_p = F.log_softmax(student_logits.double(), dim=1)
    log_q = F.log_softmax(teacher_logits.detach().double(), dim=1)
    return (log_q.exp() * (log_q - log_p)).sum(dim=1).mean().to(student_logits.dtype)


@dataclass
class DomainParameters:
    """One domain's copy of the domain-specific parameters.

    Attributes:
        params: state-dict key -> tensor (the Segmenter's domain-specific entries).
        rows: global class ids of the domain's head rows (row 0 = background).
    """

    params: dict[str, torch.Tensor] = field(default_factory=dict)
    rows: list[int] = field(default_factory=list)


def _site_key(name: str) -> str:
    return name.replace(".", "__")  # ModuleDict keys cannot hold dots


def _encode(text: str) -> torch.Tensor:
    return torch.tensor(list(text.encode()), dtype=torch.uint8)


def _decode(tensor: torch.Tensor) -> str:
    return bytes(tensor.tolist()).decode()
