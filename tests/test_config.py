"""Run configuration: precedence of the sources, validation messages, and the listing commands."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from jascl.cli import main
from jascl.engine.config import RunConfig, parse_overrides, resolve_config
from jascl.errors import ConfigError
from jascl.methods.presets import jascl_options


def _write(tmp_path: Path, data, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def _error(**kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        resolve_config(**kwargs)
    message = str(info.value)
    assert "\n" not in message, message
    return message


# --------------------------------------------------------------------------- precedence


def test_defaults():
    cfg = resolve_config()
    assert cfg == RunConfig()
    assert cfg.epochs_base == 20 and cfg.epochs_incremental == 50
    assert cfg.classifier == "cosine" and cfg.temperature == 10.0
    assert cfg.freeze_incremental == "all_but_classifier"
    assert cfg.eval_mode == "sliding-window"
    jascl = jascl_options(cfg)
    assert jascl.gas.eps == 1e-8 and jascl.gas.sigma2 == 1.0 and jascl.gas.in_base is False
    assert jascl.replay.weight == 0.1 and jascl.replay.reduction == "sum"
    assert jascl.components.gas is True and jascl.components.replay is True
    assert cfg.seed is None and cfg.patch_size is None


def test_precedence_defaults_protocol_file_set(tmp_path):
    protocol = {
        "epochs_base": 7,
        "epochs_incremental": 11,
        "lr_base": 0.05,
        "replay": {"reduction": "mean"},
        "gas": {"sigma2": 2.0},
    }
    config_file = _write(tmp_path, {"epochs_base": 9, "batch_size": 3, "gas": {"eps": 1e-5}})

    only_protocol = resolve_config(protocol, "p.yaml")
    assert only_protocol.epochs_base == 7
    assert jascl_options(only_protocol).replay.reduction == "mean"
    assert jascl_options(only_protocol).gas.sigma2 == 2.0
    assert jascl_options(only_protocol).gas.eps == 1e-8  # untouched nested key keeps its default
    assert only_protocol.batch_size == 8

    with_file = resolve_config(protocol, "p.yaml", config_file)
    assert with_file.epochs_base == 9  # file beats protocol
    assert with_file.epochs_incremental == 11  # protocol beats default
    assert with_file.batch_size == 3
    gas = jascl_options(with_file).gas
    assert gas.eps == 1e-5 and gas.sigma2 == 2.0  # nested keys merge, not replace
    assert jascl_options(with_file).replay.reduction == "mean"

    # the spellings of earlier versions (gas.eps) and the current one (method_args.jascl.gas.eps) mix
    full = resolve_config(
        protocol,
        "p.yaml",
        config_file,
        [
            "epochs_base=3",
            "gas.eps=1e-6",
            "method_args.jascl.replay.reduction=sum",
            "augment=false",
            "method_args.ewc.weight=3",
        ],
    )
    assert full.epochs_base == 3  # --set beats file
    options = jascl_options(full)
    assert isinstance(options.gas.eps, float) and options.gas.eps == 1e-6
    assert options.gas.sigma2 == 2.0
    assert options.replay.reduction == "sum"
    assert full.method_args["ewc"] == {"weight": 3}  # method_args merge key by key across the levels
    assert full.augment is False
    assert full.batch_size == 3 and full.epochs_incremental == 11 and full.lr_base == 0.05
    assert full.momentum == 0.9  # default survives every level


def test_later_set_wins_and_numbers_are_coerced(tmp_path):
    cfg = resolve_config(
        overrides=[
            "epochs_base=3",
            "epochs_base=4",
            "lr_base=1",
            "epochs_incremental=5.0",
            "temperature=2e1",
            "patch_size=[32, 48]",
            "seed=7",
            "device=cuda:1",
        ]
    )
    assert cfg.epochs_base == 4
    assert cfg.lr_base == 1.0 and isinstance(cfg.lr_base, float)
    assert cfg.epochs_incremental == 5 and isinstance(cfg.epochs_incremental, int)
    assert cfg.temperature == 20.0
    assert cfg.patch_size == [32, 48]
    assert cfg.seed == 7
    assert cfg.device == "cuda:1"


def test_scientific_notation_in_config_file(tmp_path):
    # YAML 1.1 reads 1e-6 (no dot) as a string; numeric keys still accept it
    path = _write(tmp_path, "gas:\n  eps: 1e-6\nweight_decay: 5e-4\n")
    cfg = resolve_config(config_file=path)
    assert jascl_options(cfg).gas.eps == 1e-6 and cfg.weight_decay == 5e-4


def test_protocol_training_section_of_builtin():
    from jascl.protocols import get_protocol

    p = get_protocol("synthetic-3d")
    cfg = resolve_config(p.training, p.path)
    assert cfg.patch_size == [32, 32, 32]
    assert cfg.backbone == "unet"
    assert cfg.batch_size == p.training["batch_size"]
    assert cfg.epochs_base == p.training["epochs_base"]


def test_parse_overrides():
    assert parse_overrides(["a.b=1", "c=x"]) == {"a": {"b": 1}, "c": "x"}
    assert parse_overrides(["gas.eps=1e-6", "gas.in_base=true", "device=a=b", "patch_size=[8, 8]"]) == {
        "gas": {"eps": "1e-6", "in_base": True},
        "device": "a=b",
        "patch_size": [8, 8],
    }
    assert parse_overrides([]) == {}


def test_to_dict_is_nested_and_keeps_method_args_as_given():
    d = resolve_config(overrides=["replay.weight=0.5", "backbone_args.features=[4, 4, 8, 8, 8, 8]"]).to_dict()
    assert d["method_args"] == {"jascl": {"replay": {"weight": 0.5}}}
    assert d["backbone_args"] == {"features": [4, 4, 8, 8, 8, 8]}


# --------------------------------------------------------------------------- errors


def test_unknown_top_level_key_names_source():
    message = _error(protocol_defaults={"epochz": 1}, protocol_source="p.yaml")
    assert message.startswith("p.yaml: training: epochz: unknown configuration key")
    assert "epochs_base" in message  # lists the valid keys


def test_unknown_nested_key_names_path_and_source(tmp_path):
    message = _error(protocol_defaults={"backbone_args": 1}, protocol_source="p.yaml")
    assert message.startswith("p.yaml: training: backbone_args: must be a mapping")
    path = _write(tmp_path, {"epochz": 1})
    assert _error(config_file=path).startswith("run.yaml: epochz: unknown configuration key")
    assert _error(overrides=["epochz=1"]).startswith("--set: epochz: unknown configuration key")


@pytest.mark.parametrize(
    "override, key, reason",
    [
        ("gas.epz=1", "gas.epz", "unknown configuration key; valid keys: eps, in_base, layer, sigma2"),
        ("replay.mode=sum", "replay.mode", "unknown configuration key"),
        ("gas=3", "gas", "must be a mapping of layer, eps, sigma2, in_base"),
        ("replay.reduction=avg", "replay.reduction", "must be one of sum, mean (got 'avg')"),
        ("gas.eps=0", "gas.eps", "must be > 0 (got 0.0)"),
        ("gas.sigma2=-1", "gas.sigma2", "must be >= 0 (got -1.0)"),
        ("pas.tau_sim=1.5", "pas.tau_sim", "must be >= 0 and <= 1 (got 1.5)"),
        ("pas.every=0", "pas.every", "must be >= 1 (got 0)"),
        ("method_args.jascl.pas.anchors=all", "pas.anchors", "must be one of per-sample, mean (got 'all')"),
    ],
)
def test_jascl_options_are_checked_under_their_new_name(override, key, reason):
    """JASCL's options (old spellings too) are read as method_args.jascl and checked when the method is built."""
    config = resolve_config(overrides=[override])
    with pytest.raises(ConfigError) as info:
        jascl_options(config)
    assert str(info.value).startswith(f"method_args.jascl.{key}: "), str(info.value)
    assert reason in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    "override, key, reason",
    [
        ("epochs_base=ten", "epochs_base", "must be a number (got 'ten')"),
        ("epochs_base=2.5", "epochs_base", "must be an integer"),
        ("augment=3", "augment", "must be true or false (got 3)"),
        ("lr_base=true", "lr_base", "must be a number"),
        ("backbone=5", "backbone", "must be a string"),
        ("backbone_args=[1]", "backbone_args", "must be a mapping"),
        ("patch_size=32", "patch_size", "list of positive integers"),
        ("patch_size=[32, 0]", "patch_size", "list of positive integers"),
        ("freeze_incremental=half", "freeze_incremental", "all_but_classifier, encoder, none"),
        ("eval_mode=x", "eval_mode", "sliding-window, authors"),
        ("classifier=x", "classifier", "'cosine' or 'linear'"),
        ("epochs_base=-1", "epochs_base", "must be >= 0"),
        ("batch_size=0", "batch_size", "must be >= 1"),
        ("lr_incremental=0", "lr_incremental", "must be > 0"),
        ("sw_overlap=1", "sw_overlap", "[0, 1)"),
        ("eval_mc_samples=-2", "eval_mc_samples", "must be >= 0"),
        ("seed=abc", "seed", "non-negative integer"),
        ("seed=-1", "seed", "non-negative integer"),
    ],
)
def test_bad_values_from_set(override, key, reason):
    message = _error(overrides=[override])
    assert message.startswith(f"--set: {key}: "), message
    assert reason in message, message


@pytest.mark.parametrize(
    "training, key",
    [
        ({"epochs_base": "ten"}, "epochs_base"),
        ({"augment": 3}, "augment"),
        ({"freeze_incremental": "half"}, "freeze_incremental"),
        ({"eval_mode": "x"}, "eval_mode"),
        ({"classifier": "x"}, "classifier"),
    ],
)
def test_bad_values_name_the_level_they_came_from(tmp_path, training, key):
    assert _error(protocol_defaults=training, protocol_source="p.yaml").startswith(f"p.yaml: training: {key}: ")
    path = _write(tmp_path, training)
    assert _error(config_file=path).startswith(f"run.yaml: {key}: ")


def test_later_level_does_not_hide_earlier_valid_values(tmp_path):
    # a valid value from the file is kept when --set changes something else
    path = _write(tmp_path, {"classifier": "linear"})
    cfg = resolve_config({"classifier": "cosine"}, "p.yaml", path, ["eval_mode=authors"])
    assert cfg.classifier == "linear" and cfg.eval_mode == "authors"


def test_set_without_equals():
    with pytest.raises(ConfigError) as info:
        parse_overrides(["epochs_base"])
    assert str(info.value) == "--set epochs_base: expected KEY=VALUE, e.g. --set epochs_base=10"
    assert _error(overrides=["epochs_base=3", "gas.eps"]).startswith("--set gas.eps: expected KEY=VALUE")


def test_set_scalar_then_nested_conflict():
    with pytest.raises(ConfigError, match="--set gas.eps=1: 'gas' was already set"):
        parse_overrides(["gas=1", "gas.eps=1"])


def test_config_file_problems(tmp_path):
    assert _error(config_file=tmp_path / "missing.yaml").endswith("missing.yaml: config file not found")
    bad = _write(tmp_path, "epochs_base: 3\ngas: {eps: 1e-6\n", name="broken.yaml")
    message = _error(config_file=bad)
    assert message.startswith(f"{bad}:") and "not valid YAML" in message
    listed = _write(tmp_path, "- 1\n- 2\n", name="list.yaml")
    assert _error(config_file=listed).endswith("list.yaml: must contain a mapping of configuration keys")
    empty = _write(tmp_path, "", name="empty.yaml")
    assert resolve_config(config_file=empty) == RunConfig()


# --------------------------------------------------------------------------- CLI


def _one_error_line(capsys) -> str:
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert "Traceback" not in captured.err
    assert lines[0].startswith("jascl: error: ")
    return lines[0]


def test_cli_run_unknown_set_key(tmp_path, capsys):
    assert main(["run", "--set", "epochs_bse=3", "--out", str(tmp_path / "o")]) == 2
    line = _one_error_line(capsys)
    assert line.startswith("jascl: error: --set: epochs_bse: unknown configuration key")
    assert not (tmp_path / "o").exists()


def test_cli_run_bad_set_and_config(tmp_path, capsys):
    assert main(["run", "--set", "epochs_base", "--out", str(tmp_path / "o")]) == 2
    assert "expected KEY=VALUE" in _one_error_line(capsys)
    assert main(["run", "--set", "classifier=x", "--out", str(tmp_path / "o")]) == 2
    assert _one_error_line(capsys).startswith("jascl: error: --set: classifier:")
    cfg = _write(tmp_path, {"gas": {"epz": 1}})
    assert main(["run", "--config", str(cfg), "--out", str(tmp_path / "o")]) == 2
    assert _one_error_line(capsys).startswith("jascl: error: method_args.jascl.gas.epz: unknown configuration key")
    assert main(["run", "--set", "method_args.ewk.weight=1", "--out", str(tmp_path / "o")]) == 2
    assert _one_error_line(capsys).startswith(
        "jascl: error: method_args.ewk: no registered method reads these options; the options blocks are: "
    )
    assert main(["run", "--config", str(tmp_path / "nope.yaml"), "--out", str(tmp_path / "o")]) == 2
    assert "config file not found" in _one_error_line(capsys)
    assert main(["run", "--backbone", "7", "--out", str(tmp_path / "o")]) == 2
    assert _one_error_line(capsys).startswith("jascl: error: --set: backbone: must be a string")
    assert not (tmp_path / "o").exists()


@pytest.fixture
def wide(monkeypatch):
    # rich tables would truncate cells on a narrow, non-terminal console
    monkeypatch.setenv("COLUMNS", "240")


def test_cli_protocols(wide, capsys):
    assert main(["protocols"]) == 0
    out = capsys.readouterr().out
    assert "synthetic-2d" in out and "synthetic-3d" in out
    assert "2D" in out and "3D" in out


def test_cli_protocol_sessions(wide, capsys):
    assert main(["protocols", "synthetic-2d"]) == 0
    out = capsys.readouterr().out
    for row in ("0 base", "1 mri", "2 us", "3 xray"):
        assert row in out
    assert "1:disc, 2:square" in out  # recurring classes of the xray session
    assert "spatial_dims=2" in out and "seed=1024" in out


def test_cli_methods(wide, capsys):
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    assert "vanilla" in out and "jascl" in out


def test_cli_backbones(wide, capsys):
    assert main(["backbones"]) == 0
    assert "unet" in capsys.readouterr().out


def test_cli_unknown_protocol(capsys):
    assert main(["protocols", "no-such-protocol"]) == 2
    assert "not a built-in" in _one_error_line(capsys)


def test_cli_no_command_prints_help(capsys):
    assert main([]) == 0
    assert "usage: jascl" in capsys.readouterr().out


def test_cudnn_benchmark_reaches_torch_on_a_gpu_only(toy_protocol, monkeypatch):
    import torch

    from jascl.engine.loop import ContinualTrainer
    from jascl.engine.optim import apply_cudnn_benchmark
    from jascl.engine.plugin import Method

    saved = torch.backends.cudnn.benchmark
    try:
        assert resolve_config(overrides=["cudnn_benchmark=true"]).cudnn_benchmark is True
        assert RunConfig().cudnn_benchmark is False
        torch.backends.cudnn.benchmark = False
        apply_cudnn_benchmark(True, torch.device("cuda"))  # sets the flag; needs no GPU to do so
        assert torch.backends.cudnn.benchmark is True
        apply_cudnn_benchmark(False, torch.device("cuda:1"))
        assert torch.backends.cudnn.benchmark is False
        apply_cudnn_benchmark(True, torch.device("cpu"))  # a CPU run leaves the process-wide flag alone
        assert torch.backends.cudnn.benchmark is False
        # the loop applies the run's setting on its device
        import jascl.engine.loop as loop

        calls = []
        monkeypatch.setattr(loop, "apply_cudnn_benchmark", lambda enabled, device: calls.append((enabled, device)))
        config = resolve_config(toy_protocol.training, "toy-2d.yaml", None, ["cudnn_benchmark=true", "device=cpu"])
        ContinualTrainer(toy_protocol, config, Method("plain"), [], progress=False)
        assert calls == [(True, torch.device("cpu"))]
    finally:
        torch.backends.cudnn.benchmark = saved
    assert _error(overrides=["cudnn_benchmark=3"]) == "--set: cudnn_benchmark: must be true or false (got 3)"


def test_a_method_whose_own_optimiser_is_not_the_configured_kind_is_named():
    """UCL's SGD under optimizer=adam is said (the run's log); a training-free method's rate-0 SGD is not."""
    import torch

    from jascl.engine.optim import own_optimizer_note

    params = [torch.nn.Parameter(torch.zeros(2))]
    sgd, adam = RunConfig(), RunConfig(optimizer="adam")
    assert own_optimizer_note(torch.optim.SGD(params, lr=0.1), sgd) is None
    assert own_optimizer_note(torch.optim.SGD(params, lr=0.1), adam) == "SGD, not the configured adam"
    assert own_optimizer_note(torch.optim.SGD(params, lr=0.0), adam) is None  # trains nothing
    assert own_optimizer_note(torch.optim.Adam(params, lr=0.1), adam) is None
    assert own_optimizer_note(torch.optim.Adam(params, lr=0.1), sgd) == "Adam, not the configured sgd"
    assert own_optimizer_note(torch.optim.Adam(params), RunConfig(optimizer="adamw")) == (
        "Adam, not the configured adamw"
    )
