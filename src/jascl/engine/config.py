"""The run configuration: typed defaults, overridden by the protocol's ``training``
section, then a config file, then ``--set key=value`` on the command line.

Unknown keys and bad values stop the run with one line naming the key and
where it came from.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from jascl.errors import ConfigError

FREEZE_POLICIES = ("all_but_classifier", "encoder", "none")
EVAL_MODES = ("sliding-window", "authors")
OPTIMIZERS = ("sgd", "adam", "adamw")
LR_SCHEDULES = ("constant", "poly")
PRECISIONS = ("auto", "fp32", "bf16")
MODEL_SELECTIONS = ("last", "best_val_new", "best_val_all")
CLASS_WEIGHTS = ("none", "authors")
DICE_FORMS = ("monai", "authors")
FROZEN_MODES = ("eval", "train")
PROTOTYPE_FORMS = ("eq2", "authors")


@dataclass
class RunConfig:
    """Everything that determines a run besides the protocol.

    Attributes:
        backbone: registered backbone name (``jascl backbones``).
        backbone_args: keyword arguments of the backbone factory.
        weights: local pretrained backbone weights (safetensors, or .pth read with
            ``weights_only=True``) loaded into the session-0 model; never downloaded.
        classifier: "cosine" (authors: L2-normalised, temperature 10, no bias) or "linear".
        temperature: cosine classifier logit scale.
        epochs_base / epochs_incremental: epochs of session 0 / later sessions.
        batch_size: training batch size.
        lr_base / lr_incremental: learning rates of session 0 / later sessions.
        optimizer: "sgd" (authors' medical code), "adam" (authors' natural semi-supervised code:
            Adam 1e-3, weight decay 4e-5) or "adamw"; a method may bring its own.
        lr_schedule: "constant", or "poly": the learning rate of epoch e of an E-epoch session is
            lr * (1 - e / E) ** lr_power (authors' natural code: poly 0.9); applied to every
            parameter group of any optimiser, from its rate at creation.
        lr_power: exponent of the poly schedule.
        momentum, weight_decay, nesterov: SGD options (authors: 0.9, 1e-4, True); weight_decay
            also applies to Adam/AdamW.
        lambda_ce / lambda_dice: weights of the supervised loss's cross-entropy and Dice terms.
        lambda_ce_base / lambda_dice_base: the same in session 0 (null: ``lambda_ce`` / ``lambda_dice``; the
            authors' base code: 0.5 and 0.5, their incremental code 1 and 1).
        class_weights: "none", or "authors": per-class weights [0.25] + [0.75] * (K - 1) over the K classifier
            rows (background first) in both terms, as the authors' medical code.
        dice: "monai" (soft Dice per sample and class, MONAI's default) or "authors" (one soft Dice per class
            over the whole batch, squared terms in the denominator: the authors' ``DiceLoss``).
        frozen_mode: what frozen modules do while the rest trains: "eval" (no dropout, BatchNorm uses and keeps
            its running statistics) or "train" (the authors' code: the whole model in train mode, so BatchNorm
            normalises with batch statistics and updates its running ones on the new data).
        imprint: how new classifier rows are initialised from their prototypes: "eq2" (eq. 2: the mean of the
            unit-normalised per-sample means of raw features) or "authors" (the mean of per-sample means of
            L2-normalised pixel features, the per-sample means not renormalised: their ``get_prototype``).
        preset: a named set of configuration values applied over the protocol's ``training`` section and
            under a config file and ``--set`` (:mod:`jascl.engine.config_presets`; ``authors``: the authors'
            training path). Recorded for provenance; the values it set are in the resolved configuration.
        freeze_incremental: "all_but_classifier" (paper's medical setting), "none" (natural) or "encoder"
            (partially frozen: the backbone's encoder frozen, its decoder and the classifier trained; the
            paper's frozen / partially frozen / unfrozen study).
        patch_size: training crop (None = whole image/volume); also the sliding-window ROI.
        augment: random flips during training (MONAI transforms).
        eval_mode: "sliding-window" (whole images/volumes) or "authors" (one
            ground-truth-centred crop per volume, soft Dice).
        background_in_mean: count background in the all-class mean (the authors' code does; the
            paper's class-wise tables average foreground classes only, the default).
        eval_mc_samples: 0 = deterministic evaluation; N > 0 averages softmax over N GAS noise draws.
        sw_batch_size / sw_overlap: sliding-window inference options.
        model_selection: which epoch's model ends a session: "last", or the epoch with the best
            validation score (the protocol's ``validation`` samples, :class:`jascl.engine.defaults.ModelSelection`):
            "best_val_new" (mean Dice of the session's own classes on its validation samples, as the
            authors chose the checkpoint) or "best_val_all" (mean Dice of every seen foreground class on
            the validation samples of every session so far). A session without validation samples
            keeps its last epoch, with a warning.
        validate_every: with a best-validation ``model_selection``, score every N epochs (and always
            after the last).
        validation_eval_mode: how validation samples are scored: "same" (as ``eval_mode``), "sliding-window"
            or "authors" (one ground-truth-centred crop per volume, soft Dice: what the authors selected
            their checkpoints with, at a fraction of the cost: docs/protocols.md, "What validation costs").
        device: "auto", "cpu", "cuda", "cuda:1", ...
        seed: training seed (None = the protocol's seed).
        threads: torch CPU threads (0 = leave torch's default).
        method_args: every method's options, ``{options key: {option: value}}`` (e.g.
            ``--set method_args.ewc.weight=500``, ``--set method_args.jascl.gas.eps=1e-9``); each method
            checks its own (:mod:`jascl.methods.options`, ``jascl methods NAME``). Merged key by key
            across the protocol, a config file and ``--set``.
        tensorboard: log losses, GAS noise-scale statistics, per-session metrics and pseudo-label
            statistics to ``<run>/tensorboard/<method>/`` (``jascl.results.tensorboard``).
        precision: "auto" (bf16 autocast on a GPU that supports it, else fp32), "fp32" or "bf16".
        channels_last: channels-last memory format for the model and its training inputs (GPU convolutions).
        cudnn_benchmark: on a GPU, cuDNN picks the fastest convolution algorithm for each input shape by timing
            them (``torch.backends.cudnn.benchmark``); results are then not bit-identical between runs.
        compile: experimental: ``torch.compile`` the backbone (the classifier grows and carries GAS, so it
            stays eager); see the README for a known Inductor failure with MONAI's BasicUNet on CPU.
        num_workers: data-loading worker processes per rank (-1 = auto: 4 on CUDA, 0 on CPU).
        pin_memory: page-locked host batches (null = on CUDA only).
        prepare_workers: processes that preprocess, before training, the samples a run on datasets reads and
            the store lacks (-1 = auto: as many as ``jascl data prepare`` starts, from 16 missing samples and 256 MiB of files;
            0 = each on first access, one after another; :func:`jascl.data.prepare.fill_store`).
        checkpoint_every: write a resumable in-session checkpoint every N epochs (0 = only whole
            sessions are saved); the last epoch of a session is always checkpointed.
        checkpoint_steps: also write it every N training steps inside an epoch (0 = at epoch ends only),
            for long epochs; a method with a plugin that cannot resume inside an epoch
            (``Plugin.mid_epoch_resume``) keeps to epoch ends, with a warning.
        find_unused_parameters: DistributedDataParallel's option, for methods whose trainable
            parameters do not all receive a gradient every step (several processes only).
        sync_batchnorm: with several GPU processes, BatchNorm layers use the whole global batch's
            statistics (SyncBatchNorm), as one process does; needs GPUs (no effect on the CPU).
    """

    backbone: str = "unet"
    backbone_args: dict = field(default_factory=dict)
    weights: str | None = None
    classifier: str = "cosine"
    temperature: float = 10.0
    epochs_base: int = 20
    epochs_incremental: int = 50
    batch_size: int = 8
    lr_base: float = 0.01
    lr_incremental: float = 0.01
    optimizer: str = "sgd"
    lr_schedule: str = "constant"
    lr_power: float = 0.9
    momentum: float = 0.9
    weight_decay: float = 1e-4
    nesterov: bool = True
    lambda_ce: float = 1.0
    lambda_dice: float = 1.0
    lambda_ce_base: float | None = None
    lambda_dice_base: float | None = None
    class_weights: str = "none"
    dice: str = "monai"
    frozen_mode: str = "eval"
    imprint: str = "eq2"
    preset: str | None = None
    freeze_incremental: str = "all_but_classifier"
    patch_size: list | None = None
    augment: bool = True
    eval_mode: str = "sliding-window"
    background_in_mean: bool = False
    eval_mc_samples: int = 0
    sw_batch_size: int = 4
    sw_overlap: float = 0.25
    model_selection: str = "last"
    validate_every: int = 1
    validation_eval_mode: str = "same"
    device: str = "auto"
    seed: int | None = None
    threads: int = 0
    method_args: dict = field(default_factory=dict)
    tensorboard: bool = False
    precision: str = "auto"
    channels_last: bool = False
    cudnn_benchmark: bool = False
    compile: bool = False
    num_workers: int = -1
    pin_memory: bool | None = None
    prepare_workers: int = -1
    checkpoint_every: int = 1
    checkpoint_steps: int = 0
    find_unused_parameters: bool = False
    sync_batchnorm: bool = False

    def validate(self, source: str = "config") -> None:
        def bad(key: str, msg: str) -> ConfigError:
            return ConfigError(f"{source}: {key}: {msg}")

        for key in ("epochs_base", "epochs_incremental", "batch_size", "sw_batch_size"):
            if getattr(self, key) < (0 if key.startswith("epochs") else 1):
                raise bad(key, f"must be {'>= 0' if key.startswith('epochs') else '>= 1'} (got {getattr(self, key)})")
        for key in ("lr_base", "lr_incremental", "temperature"):
            if getattr(self, key) <= 0:
                raise bad(key, f"must be > 0 (got {getattr(self, key)})")
        if self.optimizer not in OPTIMIZERS:
            raise bad("optimizer", f"must be one of {', '.join(OPTIMIZERS)} (got {self.optimizer!r})")
        if self.lr_schedule not in LR_SCHEDULES:
            raise bad("lr_schedule", f"must be one of {', '.join(LR_SCHEDULES)} (got {self.lr_schedule!r})")
        if self.lr_power <= 0:
            raise bad("lr_power", f"must be > 0 (got {self.lr_power})")
        if self.classifier not in ("cosine", "linear"):
            raise bad("classifier", f"must be 'cosine' or 'linear' (got {self.classifier!r})")
        if self.freeze_incremental not in FREEZE_POLICIES:
            raise bad(
                "freeze_incremental", f"must be one of {', '.join(FREEZE_POLICIES)} (got {self.freeze_incremental!r})"
            )
        for key, choices in (
            ("class_weights", CLASS_WEIGHTS),
            ("dice", DICE_FORMS),
            ("frozen_mode", FROZEN_MODES),
            ("imprint", PROTOTYPE_FORMS),
        ):
            if getattr(self, key) not in choices:
                raise bad(key, f"must be one of {', '.join(choices)} (got {getattr(self, key)!r})")
        for key in ("lambda_ce", "lambda_dice", "lambda_ce_base", "lambda_dice_base"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
                raise bad(key, f"must be a number >= 0{' or null' if key.endswith('_base') else ''} (got {value!r})")
        if self.eval_mode not in EVAL_MODES:
            raise bad("eval_mode", f"must be one of {', '.join(EVAL_MODES)} (got {self.eval_mode!r})")
        if self.eval_mc_samples < 0:
            raise bad("eval_mc_samples", f"must be >= 0 (got {self.eval_mc_samples})")
        if not 0 <= self.sw_overlap < 1:
            raise bad("sw_overlap", f"must be in [0, 1) (got {self.sw_overlap})")
        if self.model_selection not in MODEL_SELECTIONS:
            raise bad("model_selection", f"must be one of {', '.join(MODEL_SELECTIONS)} (got {self.model_selection!r})")
        if self.validate_every < 1:
            raise bad("validate_every", f"must be >= 1 epoch (got {self.validate_every})")
        if self.validation_eval_mode not in ("same", *EVAL_MODES):
            raise bad(
                "validation_eval_mode",
                f"must be one of same, {', '.join(EVAL_MODES)} (got {self.validation_eval_mode!r})",
            )
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise bad("seed", f"must be a non-negative integer or null (got {self.seed!r})")
        if self.threads < 0:
            raise bad("threads", f"must be >= 0 (got {self.threads})")
        if self.precision not in PRECISIONS:
            raise bad("precision", f"must be one of {', '.join(PRECISIONS)} (got {self.precision!r})")
        if self.num_workers < -1:
            raise bad("num_workers", f"must be >= 0, or -1 for auto (got {self.num_workers})")
        if self.prepare_workers < -1:
            raise bad("prepare_workers", f"must be >= 0, or -1 for auto (got {self.prepare_workers})")
        if self.pin_memory is not None and not isinstance(self.pin_memory, bool):
            raise bad("pin_memory", f"must be true, false or null (got {self.pin_memory!r})")
        if self.checkpoint_every < 0:
            raise bad("checkpoint_every", f"must be >= 0 epochs (got {self.checkpoint_every})")
        if self.checkpoint_steps < 0:
            raise bad("checkpoint_steps", f"must be >= 0 steps (got {self.checkpoint_steps})")
        if self.patch_size is not None and (
            not isinstance(self.patch_size, list) or not all(isinstance(v, int) and v > 0 for v in self.patch_size)
        ):
            raise bad("patch_size", f"must be a list of positive integers or null (got {self.patch_size!r})")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_NUMBER = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")


def _at(source: str | None) -> str:
    """The message prefix naming where a value came from ("" when the key itself says it)."""
    return f"{source}: " if source else ""


def _optional(target: Any, key: str) -> bool:
    """Whether ``target``'s annotation of field ``key`` allows None."""
    for f in dataclasses.fields(target):
        if f.name == key:
            return "None" in [p.strip() for p in str(f.type).split("|")]
    return True


def _coerce(value: Any, current: Any, key: str, source: str | None, target: Any = None) -> Any:
    """Check ``value`` against the type of the default ``current``; null only where ``target``'s annotation of
    the field allows it (optional fields are checked by ``RunConfig.validate``)."""
    if target is not None and value is None and not _optional(target, key.rsplit(".", 1)[-1]):
        raise ConfigError(f"{_at(source)}{key}: must not be null (its default is {current!r})")
    if current is None or value is None:
        return value
    if isinstance(current, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{_at(source)}{key}: must be true or false (got {value!r})")
        return value
    if isinstance(current, (int, float)) and not isinstance(current, bool):
        if isinstance(value, str) and _NUMBER.match(value.strip()):
            value = float(value)  # YAML 1.1 reads "1e-6" (no dot) as a string
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{_at(source)}{key}: must be a number (got {value!r})")
        if isinstance(current, int) and not isinstance(current, bool) and isinstance(value, float):
            if not value.is_integer():
                raise ConfigError(f"{_at(source)}{key}: must be an integer (got {value!r})")
            value = int(value)
        return type(current)(value) if isinstance(current, float) else value
    if isinstance(current, str) and not isinstance(value, str):
        raise ConfigError(f"{_at(source)}{key}: must be a string (got {value!r})")
    if isinstance(current, dict) and not isinstance(value, Mapping):
        raise ConfigError(f"{_at(source)}{key}: must be a mapping (got {value!r})")
    if isinstance(current, list) and not isinstance(value, list):
        raise ConfigError(f"{_at(source)}{key}: must be a list (got {value!r})")
    return value


#: top-level sections of earlier versions, now options of the JASCL family: section -> key in method_args.jascl
LEGACY_SECTIONS = {"gas": "gas", "replay": "replay", "pas": "pas", "jascl": "components"}


def translate_legacy(updates: Mapping[str, Any]) -> dict:
    """``updates`` with the sections of earlier versions (``gas``, ``replay``, ``pas``, ``jascl``) moved to
    ``method_args.jascl.<gas|replay|pas|components>``, where JASCL's options live now."""
    out = {k: v for k, v in updates.items() if k not in LEGACY_SECTIONS}
    moved = {LEGACY_SECTIONS[k]: v for k, v in updates.items() if k in LEGACY_SECTIONS}
    if moved:
        method_args = dict(out.get("method_args") or {})
        jascl = dict(method_args.get("jascl") or {})
        for section, value in moved.items():
            jascl[section] = _merge(jascl.get(section), value)
        method_args["jascl"] = jascl
        out["method_args"] = method_args
    return out


def _merge(base: Any, update: Any) -> Any:
    """``update`` merged into ``base`` key by key where both are mappings, else ``update``."""
    if isinstance(base, Mapping) and isinstance(update, Mapping):
        merged = dict(base)
        for key, value in update.items():
            merged[key] = _merge(merged.get(key), value)
        return merged
    return update


def apply_mapping(target: Any, updates: Mapping[str, Any], source: str | None, prefix: str = "") -> None:
    """Set ``target``'s fields (a dataclass, nested ones included) from ``updates``, type-checked.

    Raises:
        ConfigError: one line naming the key (with ``prefix``) and ``source``: unknown key or wrong type.
    """
    names = {f.name for f in dataclasses.fields(target)}
    for key, value in updates.items():
        full = f"{prefix}{key}"
        if key not in names:
            raise ConfigError(f"{_at(source)}{full}: unknown configuration key; valid keys: {', '.join(sorted(names))}")
        current = getattr(target, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, Mapping):
                raise ConfigError(
                    f"{_at(source)}{full}: must be a mapping of "
                    f"{', '.join(f.name for f in dataclasses.fields(current))}"
                )
            apply_mapping(current, value, source, prefix=f"{full}.")
        elif full == "method_args":  # merged key by key: the protocol's, a file's and --set's options all hold
            setattr(target, key, _merge(current, _coerce(value, current, full, source, target)))
        else:
            setattr(target, key, _coerce(value, current, full, source, target))


def parse_overrides(items: list[str]) -> dict:
    """``["a.b=1", "c=x"]`` -> ``{"a": {"b": 1}, "c": "x"}`` (values parsed as YAML)."""
    out: dict = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set {item}: expected KEY=VALUE, e.g. --set epochs_base=10")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            value = raw
        node = out
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item}: {part!r} was already set to a value by another --set")
        node[parts[-1]] = value
    return out


def _preset_name(*sources: Mapping[str, Any] | None) -> str | None:
    """The ``preset`` the last of ``sources`` that names one names (None when none does)."""
    name = None
    for source in sources:
        if source and source.get("preset") is not None:
            name = source["preset"]
    if name is not None and not isinstance(name, str):
        raise ConfigError(f"preset: must be a preset name (got {name!r})")
    return name


def resolve_config(
    protocol_defaults: Mapping[str, Any] | None = None,
    protocol_source: str = "protocol",
    config_file: str | Path | None = None,
    overrides: list[str] | None = None,
) -> RunConfig:
    """Defaults < protocol ``training`` section < the named preset < config file < ``--set`` overrides.

    The preset is the one the last of these sources names (``preset: NAME``; ``--preset NAME`` on the command
    line is ``--set preset=NAME`` before the other ``--set``); its values (:mod:`jascl.engine.config_presets`)
    apply right above the protocol's, so a config file and ``--set`` still override any of them.
    """
    from jascl.engine.config_presets import preset_mapping

    cfg = RunConfig()
    file_data: Mapping[str, Any] | None = None
    if config_file is not None:
        path = Path(config_file)
        if not path.is_file():
            raise ConfigError(f"{path}: config file not found")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" line {mark.line + 1}:" if mark is not None else ""
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ConfigError(f"{path}:{where} not valid YAML ({problem})") from None
        if not isinstance(data, Mapping):
            raise ConfigError(f"{path}: must contain a mapping of configuration keys")
        file_data = translate_legacy(data)
    set_data = translate_legacy(parse_overrides(overrides)) if overrides else None
    preset = _preset_name(protocol_defaults, file_data, set_data)
    if protocol_defaults:
        apply_mapping(cfg, translate_legacy(protocol_defaults), f"{protocol_source}: training")
        cfg.validate(f"{protocol_source}: training")
    if preset is not None:
        apply_mapping(cfg, preset_mapping(preset), f"preset {preset}")
        cfg.validate(f"preset {preset}")
    if file_data is not None:
        assert config_file is not None
        apply_mapping(cfg, file_data, Path(config_file).name)
        cfg.validate(Path(config_file).name)
    if set_data is not None:
        apply_mapping(cfg, set_data, "--set")
    cfg.validate("--set" if overrides else "config")
    return cfg
