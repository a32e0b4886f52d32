"""Vanilla, JASCL and its ablations on the detection task (same names and ``method_args.jascl`` as for
segmentation; :mod:`jascl.methods.presets`).

JASCL on boxes is the same three components on the detector's box classifier:

* GAS (eq. 1) on the box predictor's classification weight (``layer: classifier``), training forwards only;
* prototype replay: the stored RoI-feature prototypes (eq. 2 over boxes, :mod:`jascl.engine.tasks.detection`) and
  their complements trained through the box classifier (:class:`~jascl.methods.replay.PrototypeReplayPlugin`,
  unchanged);
* PAS on the teacher's detections (:mod:`jascl.methods.detection.pas`).

The session-0 plugin follows ``method_args.jascl.base`` as for segmentation (the stochastic classifier by
default; ``base=shared`` starts every row of the table from the one vanilla base, as the paper's table reports a
single base model, 0.2840 mAP).
"""

from __future__ import annotations

from jascl.engine.config import RunConfig
from jascl.engine.plugin import Method, Plugin
from jascl.errors import ConfigError
from jascl.methods.detection.pas import DetectionMeanTeacherPlugin
from jascl.methods.presets import PAPER, JasclOptions, _base, _gas, _replay, teacher_options
from jascl.methods.registry import METHODS

TASK = "detection"


def _teacher(o: JasclOptions, filter: str) -> DetectionMeanTeacherPlugin:
    """PAS on boxes with ``method_args.jascl.pas`` (``anchors``: the mean prototypes only)."""
    if o.pas.anchors != "mean":
        raise ConfigError(
            f"method_args.jascl.pas.anchors={o.pas.anchors}: PAS on boxes compares with each class's mean RoI "
            "prototype (eq. 2); per-sample anchors are implemented for pixels only: set it to mean"
        )
    return DetectionMeanTeacherPlugin(filter=filter, **teacher_options(o))


def _family(name: str):
    return METHODS.register(
        name, options=JasclOptions, options_key="jascl", paper=PAPER, task=TASK, fidelity="faithful"
    )


@METHODS.register("vanilla", paper=PAPER, task=TASK, fidelity="faithful")
def vanilla(config: RunConfig) -> Method:
    """Fine-tuning of the detector with the task's defaults (the paper's "RCNN" row)."""
    return Method("vanilla", [], "plain fine-tuning of the detector")


def _jascl_plugins(o: JasclOptions, gas: bool = True, replay: bool = True, pas: str | None = "pas") -> list[Plugin]:
    plugins: list[Plugin] = _base(o)
    if gas and o.components.gas:
        plugins.append(_gas(o))
    if replay and o.components.replay:
        plugins.append(_replay(o))
    if pas is not None and o.components.pas:
        plugins.append(_teacher(o, pas))
    return plugins


@_family("jascl")
def jascl(o: JasclOptions, config: RunConfig) -> Method:
    """JASCL on boxes: GAS on the box classifier, RoI-prototype replay, PAS on the teacher's detections."""
    return Method("jascl", _jascl_plugins(o), "GAS + RoI-prototype replay + PAS on boxes")


@_family("jascl-no-gas")
def jascl_no_gas(o: JasclOptions, config: RunConfig) -> Method:
    """The paper's "JASCL w/o GAS" row: prototype replay + PAS on boxes."""
    return Method("jascl-no-gas", _jascl_plugins(o, gas=False), "RoI-prototype replay + PAS on boxes")


@_family("jascl-no-pas")
def jascl_no_pas(o: JasclOptions, config: RunConfig) -> Method:
    """The paper's "JASCL w/o PAS" row: GAS + prototype replay (the unlabelled pool unused)."""
    return Method("jascl-no-pas", _jascl_plugins(o, pas=None), "GAS + RoI-prototype replay")


@_family("jascl-conf")
def jascl_conf(o: JasclOptions, config: RunConfig) -> Method:
    """JASCL with a confidence-only teacher filter on boxes (no prototype check)."""
    return Method("jascl-conf", _jascl_plugins(o, pas="confidence"), "GAS + RoI-prototype replay + confident boxes")


@_family("jascl-no-replay")
def jascl_no_replay(o: JasclOptions, config: RunConfig) -> Method:
    """The ablation without prototype replay: GAS + PAS on boxes."""
    return Method("jascl-no-replay", _jascl_plugins(o, replay=False), "GAS + PAS on boxes")


@_family("jascl-no-unlabelled")
def jascl_no_unlabelled(o: JasclOptions, config: RunConfig) -> Method:
    """JASCL ignoring the unlabelled pool: GAS + prototype replay (the same plugins as ``jascl-no-pas``)."""
    return Method("jascl-no-unlabelled", _jascl_plugins(o, pas=None), "GAS + RoI-prototype replay, labelled only")
