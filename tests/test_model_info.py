"""model-info: parameter counts, FLOPs and training-step memory, checked by hand on small models."""

import argparse
import json

import pytest
import torch

from jascl.cli.listing import add_model_info_parser
from jascl.errors import ConfigError
from jascl.experiments.model_info import count_flops, model_info
from jascl.networks.classifier import PixelClassifier

TINY_UNET = {"features": [4, 4, 8, 8, 8, 8]}


def test_parameter_count_by_hand():
    """unet3d-authors in 2D, base 2 (channels 2/4/8/16/20), 3x3 kernels, BatchNorm (2 params per channel), K=3."""
    ch = [2, 4, 8, 16, 20]
    stem = 1 * 2 * 9 + (2 * 2 * 9 + 2 * 2)
    down = sum(ch[l - 1] * ch[l] * 9 + ch[l] * ch[l] * 9 + 2 * 2 * ch[l] for l in range(1, 5))
    up = sum((ch[l + 1] + ch[l]) * ch[l] * 9 + ch[l] * ch[l] * 9 + 2 * 2 * ch[l] for l in range(4))
    classifier = 3 * 2  # cosine classifier: K x C weight, no bias
    info = model_info(
        "unet3d-authors",
        spatial_dims=2,
        in_channels=1,
        num_classes=3,
        spatial_size=(32, 32),
        backbone_args={"base_channels": 2},
        device="meta",
    )
    assert round(info["params_m"] * 1e6) == stem + down + up + classifier == 21904
    assert info["trainable_params_m"] == info["params_m"]


@pytest.mark.parametrize("cosine", [True, False])
def test_classifier_flops_by_hand(cosine):
    """A 1x1 classifier over C channels and K classes at HxW: C*K multiply-adds per pixel = 2*C*K*H*W FLOPs."""
    c, k, h, w = 8, 5, 6, 7
    flops = count_flops(PixelClassifier(c, k, cosine=cosine), torch.randn(1, c, h, w))
    assert flops == 2 * c * k * h * w == 3360  # normalisation and bias are element-wise, not counted


def test_jascl_adds_memory_and_replay_flops_but_no_parameters():
    common = dict(
        spatial_dims=2,
        in_channels=1,
        num_classes=4,
        spatial_size=(32, 32),
        backbone_args=TINY_UNET,
        device="meta",
        batch_size=2,
        num_prototypes=40,
    )
    plain, jascl = model_info("unet", with_jascl=False, **common), model_info("unet", with_jascl=True, **common)
    assert jascl["params_m"] == plain["params_m"]
    assert jascl["train_memory_mib"] > plain["train_memory_mib"]
    # replaying 40 prototypes through the 8 -> 4 classifier: 2 * 40 * 8 * 4 FLOPs on top of the forward
    assert round((jascl["gflops"] - plain["gflops"]) * 1e9) == 2 * 40 * 8 * 4
    # the estimate holds at least parameters + gradients + momentum (3 x 4 bytes per parameter)
    assert plain["train_memory_mib"] * 2**20 > 3 * 4 * plain["params_m"] * 1e6
    assert plain["memory_method"].startswith("estimated")


def test_memory_grows_with_batch():
    common = dict(
        spatial_dims=2, in_channels=1, num_classes=2, spatial_size=(32, 32), backbone_args=TINY_UNET, device="meta"
    )
    one, four = model_info("unet", batch_size=1, **common), model_info("unet", batch_size=4, **common)
    assert four["train_memory_mib"] > one["train_memory_mib"]
    assert four["gflops"] == one["gflops"]  # FLOPs are per image


def test_frozen_sam_encoder_is_not_trainable():
    info = model_info(
        "sam-vitb",
        in_channels=3,
        num_classes=3,
        spatial_size=(32, 32),
        device="meta",
        backbone_args={
            "img_size": 32,
            "embed_dim": 16,
            "depth": 1,
            "num_heads": 2,
            "window_size": 2,
            "global_attn_indexes": (0,),
            "proj_channels": 8,
        },
    )
    # trainable: the 16 -> 8 projection (weight + bias + LayerNorm2d weight/bias) and the 3 x 8 classifier
    assert round(info["trainable_params_m"] * 1e6) == 16 * 8 + 8 + 2 * 8 + 3 * 8
    assert info["params_m"] > info["trainable_params_m"]


def _parser():
    parser = argparse.ArgumentParser(prog="jascl")
    add_model_info_parser(parser.add_subparsers(dest="command"))
    return parser


def test_cli(capsys):
    args = _parser().parse_args(
        [
            "model-info",
            "unet",
            "--spatial-dims",
            "2",
            "--spatial-size",
            "32",
            "--backbone-args",
            "{features: [4, 4, 8, 8, 8, 8]}",
            "--device",
            "meta",
            "--num-classes",
            "3",
            "--json",
        ]
    )
    assert args.func(args) == 0
    (row,) = json.loads(capsys.readouterr().out)
    plain, jascl = row["without_jascl"], row["with_jascl"]
    assert (plain["name"], plain["spatial_size"], plain["num_classes"]) == ("unet", [32, 32], 3)
    assert (plain["with_jascl"], jascl["with_jascl"]) == (False, True)


def test_cli_table_and_errors(capsys):
    parser = _parser()
    args = parser.parse_args(
        [
            "model-info",
            "unet",
            "--spatial-dims",
            "2",
            "--spatial-size",
            "32x32",
            "--backbone-args",
            "{features: [4, 4, 8, 8, 8, 8]}",
            "--device",
            "meta",
        ]
    )
    assert args.func(args) == 0
    assert "unet" in capsys.readouterr().out
    bad = parser.parse_args(["model-info", "unet", "--backbone-args", "[1, 2]", "--device", "meta"])
    with pytest.raises(ConfigError, match="expected a mapping"):
        bad.func(bad)
    with pytest.raises(ConfigError, match="unknown backbone"):
        model_info("no-such-net", device="meta")


def test_step_times_take_turns_and_report_medians_after_warm_up(monkeypatch):
    from jascl.experiments import model_info as mi

    calls: list[bool] = []
    # without JASCL: 9 (warm-up), 9 (warm-up), then 3, 1, 2 -> median 2; with: 9, 9, then 4, 6, 5 -> median 5
    seq = {False: iter([9.0, 9.0, 3.0, 1.0, 2.0]), True: iter([9.0, 9.0, 4.0, 6.0, 5.0])}

    def fake(model, x, labels, with_jascl, num_prototypes):
        calls.append(with_jascl)
        return next(seq[with_jascl])

    monkeypatch.setattr(mi, "_timed_step", fake)
    without, with_jascl = mi.step_times(
        "unet", 3, spatial_dims=2, spatial_size=(16, 16), num_classes=3, backbone_args={}, device="cpu"
    )
    assert (without, with_jascl) == (2.0, 5.0)
    assert calls == [False, True] * 5  # interleaved: a busy machine slows both alike
    with pytest.raises(ConfigError, match="--time 0: give the number of steps"):
        mi.step_times("unet", 0)


def test_cli_time_column(capsys):
    args = _parser().parse_args(
        ["model-info", "unet", "--spatial-dims", "2", "--spatial-size", "32", "--num-classes", "3", "--time", "1",
         "--time-device", "cpu", "--device", "meta", "--backbone-args", "{features: [4, 4, 8, 8, 8, 8]}"]
    )  # fmt: skip
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "s/step" in out and "time ratio" in out and "median of 1 training steps each" in out
