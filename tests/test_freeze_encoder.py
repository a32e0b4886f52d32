"""``freeze_incremental: encoder``: the paper's partially frozen backbones (encoder frozen, decoder and classifier
trained in incremental sessions)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import load_file

from jascl.errors import ConfigError
from jascl.experiments.runner import run_benchmark
from jascl.networks import create_segmenter
from jascl.networks.base import encoder_modules, eval_mode


def _names(backbone, modules):
    ids = {id(m) for m in modules}
    return sorted(n for n, m in backbone.named_modules() if id(m) in ids)


def test_eval_mode_restores_each_modules_own_mode_exactly(monkeypatch):
    """A training model with a frozen (eval-mode) encoder: all eval inside the block, every module's own flag
    afterwards, also when the block raises; ``train`` is not re-run on restore (it would recurse per module)."""
    model = create_segmenter("unet", spatial_dims=2, in_channels=1, num_classes=3, features=[4, 4, 8, 8, 8, 8])
    model.train()
    for m in encoder_modules(model.backbone):
        m.eval()
    before = [m.training for m in model.modules()]
    assert True in before and False in before
    calls = []
    original = type(model.backbone).train
    monkeypatch.setattr(
        type(model.backbone), "train", lambda self, mode=True: calls.append(mode) or original(self, mode)
    )
    with pytest.raises(RuntimeError, match="inside"):
        with eval_mode(model):
            assert not any(m.training for m in model.modules())
            raise RuntimeError("inside")
    assert [m.training for m in model.modules()] == before
    assert calls == [False]  # the model.eval() that entered the block, nothing on the way out


def test_encoder_modules_are_everything_outside_the_decoder():
    model = create_segmenter("unet", spatial_dims=2, in_channels=1, num_classes=3, features=[4, 4, 8, 8, 8, 8])
    names = _names(model.backbone, encoder_modules(model.backbone))
    # MONAI's BasicUNet: conv_0 and the four down blocks are the encoder; upcat_1..4 and final_conv are not
    assert [n for n in names if n.startswith("net.")] == [
        "net.conv_0", "net.down_1", "net.down_2", "net.down_3", "net.down_4", "net.final_conv",
    ]  # fmt: skip
    frozen = {id(p) for m in encoder_modules(model.backbone) for p in m.parameters()}
    assert all(id(p) not in frozen for n, p in model.backbone.named_parameters() if n.startswith("net.upcat_"))

    class NoDecoder(torch.nn.Module):
        def decoder_prefixes(self):
            return None

    with pytest.raises(ConfigError, match="freeze_incremental=encoder: backbone NoDecoder does not name its decoder"):
        encoder_modules(NoDecoder())


def test_incremental_session_trains_decoder_not_encoder(toy_protocol, toy_config, tmp_path):
    config = dataclasses.replace(toy_config, freeze_incremental="encoder")
    out = tmp_path / "run"
    run_benchmark(
        toy_protocol, config, ["vanilla"], out, cache_dir=tmp_path / "c", progress=False, echo=lambda *a: None
    )
    before = load_file(str(out / "base" / "model.safetensors"))
    after = load_file(str(out / "vanilla" / "s1-inc" / "model.safetensors"))
    changed = {k for k in before if k in after and not torch.equal(before[k], after[k])}
    assert not any(k.startswith("backbone.net.down_") or k.startswith("backbone.net.conv_0") for k in changed)
    assert any(k.startswith("backbone.net.upcat_") for k in changed)
