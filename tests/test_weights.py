"""Local pretrained weights: formats, wrappers, prefixes, one-line errors, refusal of code-executing pickles."""

import pickle

import pytest
import torch
from safetensors.torch import save_file

from jascl.errors import CheckpointError
from jascl.networks import create_segmenter
from jascl.networks.weights import load_backbone_weights

UNET_ARGS = {"features": [4, 4, 8, 8, 8, 8]}


def _backbone(seed: int, in_channels: int = 1):
    torch.manual_seed(seed)
    return create_segmenter("unet", spatial_dims=2, in_channels=in_channels, num_classes=2, **UNET_ARGS).backbone


def _assert_same(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("suffix", [".safetensors", ".pth", ".pt", ".bin"])
def test_roundtrip(tmp_path, suffix):
    src, dst = _backbone(0), _backbone(1)
    assert not torch.equal(src.net.conv_0.conv_0.conv.weight, dst.net.conv_0.conv_0.conv.weight)
    path = tmp_path / f"w{suffix}"
    state = {k: v.contiguous() for k, v in src.state_dict().items()}
    save_file(state, str(path)) if suffix == ".safetensors" else torch.save(state, path)
    assert load_backbone_weights(dst, path) == []
    _assert_same(src, dst)


@pytest.mark.parametrize(
    "wrap",
    [
        lambda s: {"state_dict": s, "epoch": 3},
        lambda s: {"model": {f"module.{k}": v for k, v in s.items()}},
        lambda s: {f"backbone.{k}": v for k, v in s.items()},
        lambda s: {"state_dict": {f"module.backbone.{k}": v for k, v in s.items()}},
    ],
)
def test_wrapped_and_prefixed(tmp_path, wrap):
    src, dst = _backbone(0), _backbone(1)
    path = tmp_path / "w.pth"
    torch.save(wrap(src.state_dict()), path)
    load_backbone_weights(dst, path)
    _assert_same(src, dst)


def test_full_segmenter_checkpoint_loads_its_backbone_part(tmp_path):
    torch.manual_seed(0)
    seg = create_segmenter("unet", spatial_dims=2, in_channels=1, num_classes=2, **UNET_ARGS)
    dst = _backbone(1)
    path = tmp_path / "seg.safetensors"
    save_file({k: v.contiguous() for k, v in seg.state_dict().items()}, str(path))
    load_backbone_weights(dst, path)  # "backbone.*" selected, "classifier.*" left out
    _assert_same(seg.backbone, dst)


def test_shape_mismatch_names_key_and_shapes(tmp_path):
    dst = _backbone(1)
    state = dict(dst.state_dict())
    key = "net.down_4.convs.conv_1.conv.weight"
    state[key] = torch.zeros(5, 8, 3, 3)
    path = tmp_path / "bad.pth"
    torch.save(state, path)
    with pytest.raises(CheckpointError) as err:
        load_backbone_weights(dst, path)
    msg = str(err.value)
    assert "\n" not in msg and str(path) in msg
    assert f"{key}: model [8, 8, 3, 3] vs file [5, 8, 3, 3]" in msg


def test_missing_and_unexpected_keys(tmp_path):
    dst = _backbone(1)
    state = dict(dst.state_dict())
    del state["net.upcat_1.convs.conv_1.conv.weight"]
    state["extra.weight"] = torch.zeros(2)
    path = tmp_path / "partial.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    with pytest.raises(
        CheckpointError, match=r"missing in file net\.upcat_1\.convs\.conv_1\.conv\.weight \[8, 8, 3, 3\]"
    ):
        load_backbone_weights(dst, path)
    with pytest.raises(CheckpointError, match=r"not in model extra\.weight \[2\]"):
        load_backbone_weights(dst, path)
    assert load_backbone_weights(dst, path, strict=False) == ["net.upcat_1.convs.conv_1.conv.weight"]


def test_in_channel_mismatch_is_explicit(tmp_path):
    rgb, gray = _backbone(0, in_channels=3), _backbone(1, in_channels=1)
    path = tmp_path / "rgb.safetensors"
    save_file({k: v.contiguous() for k, v in rgb.state_dict().items()}, str(path))
    with pytest.raises(CheckpointError, match="first conv .*expects 1 input channels, file has 3"):
        load_backbone_weights(gray, path)


class _Evil:
    def __reduce__(self):
        return (print, ("this pickle runs code",))


def test_code_executing_pickle_is_refused(tmp_path, capsys):
    path = tmp_path / "evil.pth"
    with open(path, "wb") as f:
        pickle.dump({"net.conv_0.conv_0.conv.weight": _Evil()}, f, protocol=2)
    with pytest.raises(CheckpointError, match="not a plain tensor file"):
        load_backbone_weights(_backbone(0), path)
    assert "this pickle runs code" not in capsys.readouterr().out


def test_bad_files(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        load_backbone_weights(_backbone(0), tmp_path / "nope.pth")
    odd = tmp_path / "w.ckpt"
    odd.write_bytes(b"x")
    with pytest.raises(CheckpointError, match="unknown weights format"):
        load_backbone_weights(_backbone(0), odd)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_backbone_weights(_backbone(0), junk)
    empty = tmp_path / "meta.pth"
    torch.save({"epoch": 3}, empty)
    with pytest.raises(CheckpointError, match="no tensors found"):
        load_backbone_weights(_backbone(0), empty)


def test_sam_checkpoint_image_encoder_keys(tmp_path):
    """A full SAM checkpoint's ``image_encoder.*`` keys load into the backbone's ``encoder.*`` (strict=False: no decoder)."""
    kwargs = {
        "img_size": 32,
        "embed_dim": 16,
        "depth": 1,
        "num_heads": 2,
        "window_size": 2,
        "global_attn_indexes": (0,),
        "proj_channels": 8,
    }
    torch.manual_seed(0)
    src = create_segmenter("sam-vitb", spatial_dims=2, in_channels=3, num_classes=2, **kwargs).backbone
    torch.manual_seed(1)
    dst = create_segmenter("sam-vitb", spatial_dims=2, in_channels=3, num_classes=2, **kwargs).backbone
    state = {
        f"image_encoder.{k[len('encoder.') :]}": v for k, v in src.state_dict().items() if k.startswith("encoder.")
    }
    state["prompt_encoder.pe_layer.positional_encoding_gaussian_matrix"] = torch.zeros(2, 4)
    path = tmp_path / "sam.pth"
    torch.save(state, path)
    missing = load_backbone_weights(dst, path, strict=False)
    assert missing and all(k.startswith("decoder.") for k in missing)
    assert torch.equal(src.encoder.patch_embed.proj.weight, dst.encoder.patch_embed.proj.weight)


def test_cli_run_with_mismatched_or_unsafe_weights_exits_2(tmp_path, capsys):
    """`jascl run --weights` on a file that does not fit, or that would run code, stops with one line and exit 2."""
    import pickle

    import yaml
    from safetensors.torch import save_file

    from conftest import toy_protocol_dict
    from jascl.cli import main

    proto = tmp_path / "toy.yaml"
    proto.write_text(yaml.safe_dump(toy_protocol_dict()))
    bad = tmp_path / "bad.safetensors"
    save_file({"net.conv_0.conv_0.conv.weight": torch.zeros(4, 3, 3, 3)}, str(bad))
    args = [
        "run",
        "--protocol",
        str(proto),
        "--methods",
        "vanilla",
        "--cache-dir",
        str(tmp_path / "c"),
        "--no-progress",
    ]
    assert main(args + ["--weights", str(bad), "--out", str(tmp_path / "o1")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad.safetensors" in err[0] and "conv_0.conv_0.conv.weight" in err[0]

    class Evil:
        def __reduce__(self):
            import os

            return (os.system, ("true",))

    evil = tmp_path / "evil.pth"
    evil.write_bytes(pickle.dumps({"x": Evil()}))
    assert main(args + ["--weights", str(evil), "--out", str(tmp_path / "o2")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "evil.pth" in err[0]
