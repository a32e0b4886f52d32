"""Named sets of configuration values (``--preset NAME``, or ``preset: NAME`` in a config file or ``--set``).

A preset is data: a list of items, each a few ordinary configuration keys with the values the preset gives
them. Every key stays selectable on its own (``--set imprint=authors``), and the resolved configuration a run
saves holds the values, not just the preset's name. Layering (:func:`jascl.engine.config.resolve_config`):
defaults < the protocol's ``training`` section < the preset < a config file < ``--set``.

``authors``: the training path of the authors' research code (github prinshul/JASCL @ 227bf00, summarised in
the project's AUTHORS-CODE-NOTES), item by item, for every method of a run (vanilla included, so comparisons
stay fair). The evaluation stays jascl's (whole volumes by sliding window, foreground classes): the authors'
evaluation is ``eval_mode=authors`` and ``background_in_mean=true``, kept out of the preset because a training
preset should not change what a table measures. Their known defects (noise at evaluation, the prototype
lookup by position, the gradient-free consistency loss, the optimiser re-created every epoch) are not
reproduced: jascl follows the paper where the two disagree.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from jascl.errors import ConfigError


@dataclass(frozen=True)
class PresetItem:
    """One difference between jascl's default and a preset.

    Attributes:
        item: what differs, in a few words.
        values: dotted configuration key -> the preset's value.
        preset: what the preset does (for ``authors``: what their code does, and where).
        default: jascl's default, in words.
        why: why the default is what it is.
    """

    item: str
    values: Mapping[str, Any]
    preset: str
    default: str
    why: str


AUTHORS: tuple[PresetItem, ...] = (
    PresetItem(
        "Replay prototype values",
        {"method_args.jascl.replay.values": "authors", "method_args.jascl.replay.base_samples": 10},
        "per image the mean of L2-normalised pixel features, averaged over images without renormalising; the "
        "complement takes every pixel that is not the class (ignore included); 10 random images per class at "
        "base, the K shots later (methods/utils.py get_prototype, trainer.py save_protos)",
        "eq. 2: unit-normalised per-sample means of raw features, averaged; every labelled sample; ignore "
        "pixels left out of the complement",
        "eq. 2 is the paper's definition",
    ),
    PresetItem(
        "GAS noise on replayed prototypes",
        {"method_args.jascl.replay.noise_draws": "per-prototype"},
        "one classifier call, hence one noise draw, per prototype (trainer.py: forward_fc in a loop)",
        "one draw for all 2N prototypes of a step (one batched classifier call)",
        "the paper does not say; one call per step is one kernel launch instead of 2N",
    ),
    PresetItem(
        "Loss weights",
        {"class_weights": "authors", "dice": "authors", "lambda_ce_base": 0.5, "lambda_dice_base": 0.5},
        "class weights [0.25] + [0.75]·(C−1) in CE and Dice; Dice over the whole batch with squared "
        "denominators; 0.5·CE + 0.5·Dice at base, CE + Dice later (run.py, utils/VerSe_utils.py DiceLoss)",
        "unweighted CE + per-sample soft Dice (MONAI's DiceCE), the same in every session",
        "the paper names no class weights; MONAI's DiceCE is the field's default",
    ),
    PresetItem(
        "Frozen modules' mode",
        {"frozen_mode": "train"},
        "the whole model in train mode: frozen BatchNorm normalises with batch statistics and updates its "
        "running ones on the new domain (trainer.py: model.train())",
        "frozen modules in eval mode",
        "frozen means frozen: a frozen encoder should not drift with a few shots of a new domain",
    ),
    PresetItem(
        "Mean teacher's EMA",
        {"method_args.jascl.pas.ema": "phase"},
        "one EMA step (parameters only) at the end of each unlabelled phase (MSS trainer.py update_teacher)",
        "one EMA step after every optimiser step",
        "the standard mean teacher; one step per phase leaves the teacher almost where it started",
    ),
    PresetItem(
        "GAS at the start of a session",
        {"method_args.jascl.gas.variant": "authors"},
        "eq. 1 in float32 with 1 + G^-1 rounded first: the first step of a session, with a zero buffer, "
        "is noise-free; the old rows' last squared gradient is carried into the next session",
        "eq. 1 in float64 as printed: the first step has scale 1 everywhere; each session's buffer starts at 0",
        "eq. 1 is the paper's definition",
    ),
    PresetItem(
        "New classifier rows (imprinting)",
        {"imprint": "authors"},
        "the mean of per-image means of L2-normalised pixel features (imprinting.py warm_up)",
        "eq. 2 prototypes",
        "eq. 2 is the paper's prototype",
    ),
    PresetItem(
        "Checkpoint of a session",
        {"model_selection": "best_val_new", "validation_eval_mode": "authors"},
        "the epoch with the best validation Dice on the session's classes (run.py), soft Dice of the validation "
        "loader's crops (trainer.py validate)",
        "the last epoch, unless the protocol says otherwise (the paper's medical protocols select "
        "best_val_new, scoring validation as the test data: whole volumes by sliding window); a protocol "
        "without validation samples keeps the last epoch, with a warning",
        "selection needs validation samples, which the embedded benchmarks do not have by default",
    ),
    PresetItem(
        "L_proto weight",
        {},
        "0.1 medical, 0.2 natural, 0.01 natural semi-supervised (AUTHORS-CODE-NOTES: Prototypes and L_proto)",
        "the paper protocols carry the authors' weight of their domain (0.1 is also ReplayOptions' default); "
        "synthetic-3d uses 0.03, so `--preset authors` there keeps 0.03 unless `--set "
        "method_args.jascl.replay.weight=0.1` is given",
        "the weight differs by benchmark, so the preset leaves it to the protocol; on synthetic-3d 0.1 lets the "
        "replayed old rows take the new classes' voxels (docs/method.md, 'The replay weight, a trade-off')",
    ),
    PresetItem(
        "Optimiser, learning rates, batch",
        {},
        "medical: SGD, Nesterov, momentum 0.9, weight decay 1e-4, constant rate 0.01 incremental / 1e-3 base, "
        "effective batch 4 (the optimiser re-created every epoch: not copied); natural: Adam 1e-3, weight decay 4e-5, poly 0.9",
        "the same, from each protocol's training section (SGD / Nesterov / 0.9 / 1e-4 are also RunConfig's "
        "defaults; the medical protocols train with batch_size 2 per step), so the preset leaves them to the "
        "protocol",
        "they differ by benchmark; the protocols carry the authors' values",
    ),
)

PRESETS: dict[str, tuple[PresetItem, ...]] = {"authors": AUTHORS}


def preset_items(name: str) -> tuple[PresetItem, ...]:
    """The items of preset ``name``.

    Raises:
        ConfigError: an unknown name, with the known ones.
    """
    if name not in PRESETS:
        raise ConfigError(f"preset {name!r}: unknown; presets: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]


def preset_mapping(name: str) -> dict:
    """Preset ``name`` as a nested mapping of configuration keys (``{"method_args": {"jascl": ...}}``),
    ``preset: name`` included."""
    out: dict = {"preset": name}
    for item in preset_items(name):
        for key, value in item.values.items():
            node = out
            *parents, last = key.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[last] = value
    return out
