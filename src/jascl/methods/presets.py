"""Registered methods: plain fine-tuning and the JASCL preset with switchable components."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jascl.methods.base import METHODS, Method
from jascl.methods.gas_plugin import GASPlugin
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


@METHODS.register("jascl", doc="GAS + prototype replay (components switchable: jascl.gas / jascl.replay)")
def jascl(config: "RunConfig") -> Method:
    plugins = []
    if config.jascl.gas:
        plugins.append(_gas(config))
    if config.jascl.replay:
        plugins.append(_replay(config))
    return Method("jascl", plugins, "gradient-adaptive stabilization + prototype replay")


@METHODS.register("jascl-no-gas", doc="ablation: JASCL without GAS (prototype replay only)")
def jascl_no_gas(config: "RunConfig") -> Method:
    return Method("jascl-no-gas", [_replay(config)], "prototype replay only")


@METHODS.register("jascl-no-replay", doc="ablation: JASCL without prototype replay (GAS only)")
def jascl_no_replay(config: "RunConfig") -> Method:
    return Method("jascl-no-replay", [_gas(config)], "GAS only")


def create_method(name: str, config: "RunConfig") -> Method:
    return METHODS.create(name, config=config)
