"""Registered methods: plain fine-tuning and the JASCL preset with switchable components."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jascl.methods.base import METHODS, Method
from jascl.methods.gas_plugin import GASPlugin
from jascl.methods.mean_teacher import MeanTeacherPlugin
from jascl.methods.replay import PrototypeReplayPlugin

if TYPE_CHECKING:
    from jascl.training.config import RunConfig


@METHODS.register("vanilla", doc="plain fine-tuning of the same backbone (the paper's 'Vanilla' row)")
def vanilla(config: "RunConfig") -> Method:
    return Method("vanilla", [], "plain fine-tuning")


def _gas(config: "RunConfig") -> GASPlugin:
    g = config.gas
    return GASPlugin(layer=g.layer, eps=g.eps, sigma2=g.sigma2, in_base=g.in_base)


def _replay(config: "RunConfig") -> PrototypeReplayPlugin:
    return PrototypeReplayPlugin(weight=config.replay.weight, reduction=config.replay.reduction)


def _mean_teacher(config: "RunConfig", filter: str) -> MeanTeacherPlugin:
    p = config.pas
    return MeanTeacherPlugin(filter=filter, tau_conf=p.tau_conf, tau_sim=p.tau_sim, weight=p.weight,
                             ema_decay=p.ema_decay, start_epoch=p.start_epoch, every=p.every, batch_size=p.batch_size,
                             normalize_pixels=p.normalize_pixels, anchors=p.anchors, max_anchors=p.max_anchors)


@METHODS.register("jascl", doc="GAS + prototype replay + PAS mean teacher on unlabelled pools (--ablate gas,pas,proto)")
def jascl(config: "RunConfig") -> Method:
    plugins = []
    if config.jascl.gas:
        plugins.append(_gas(config))
    if config.jascl.replay:
        plugins.append(_replay(config))
    if config.jascl.pas:
        plugins.append(_mean_teacher(config, "pas"))
    return Method("jascl", plugins, "gradient-adaptive stabilization + prototype replay + PAS")


@METHODS.register("jascl-no-unlabelled", doc="comparison: JASCL ignoring unlabelled pools (GAS + prototype replay)")
def jascl_no_unlabelled(config: "RunConfig") -> Method:
    return Method("jascl-no-unlabelled", [_gas(config), _replay(config)], "GAS + prototype replay, labelled data only")


@METHODS.register("jascl-conf", doc="comparison: JASCL with a confidence-only mean teacher (no prototype check)")
def jascl_conf(config: "RunConfig") -> Method:
    return Method("jascl-conf", [_gas(config), _replay(config), _mean_teacher(config, "confidence")],
                  "GAS + prototype replay + mean teacher with confidence-only filtering")


@METHODS.register("mean-teacher-conf", doc="baseline: fine-tuning + mean teacher with confidence-only pseudo-labels")
def mean_teacher_conf(config: "RunConfig") -> Method:
    return Method("mean-teacher-conf", [_mean_teacher(config, "confidence")],
                  "plain fine-tuning + mean teacher with confidence-only filtering")


@METHODS.register("jascl-no-gas", doc="ablation: JASCL without GAS (prototype replay + PAS)")
def jascl_no_gas(config: "RunConfig") -> Method:
    return Method("jascl-no-gas", [_replay(config), _mean_teacher(config, "pas")], "prototype replay + PAS")


@METHODS.register("jascl-no-replay", doc="ablation: JASCL without prototype replay (GAS + PAS)")
def jascl_no_replay(config: "RunConfig") -> Method:
    return Method("jascl-no-replay", [_gas(config), _mean_teacher(config, "pas")], "GAS + PAS")


def create_method(name: str, config: "RunConfig") -> Method:
    return METHODS.create(name, config=config)
