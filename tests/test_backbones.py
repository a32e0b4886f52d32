"""Every registered backbone behind the one interface: features, logits, GAS, prototypes, growth, layer aliases."""

import pytest
import torch

from jascl.engine.prototypes import align_labels, class_prototypes
from jascl.errors import ConfigError
from jascl.methods.gas import attach_gas, record_sq_grad
from jascl.networks import BACKBONES, create_segmenter

# name -> list of tiny CPU configurations (spatial_dims, in_channels, input size, backbone kwargs)
TINY = {
    "unet": [(2, 1, (32, 32), {"features": [4, 4, 8, 8, 8, 8]})],
    "clip-driven": [
        (
            2,
            1,
            (32, 32),
            {
                "features": [4, 4, 8, 8, 8, 8],
                "encoding": "onehot",
                "classes": ["background", "a", "b", "c", "d", "e"],
                "hidden": 8,
            },
        )
    ],
    "unet3d-authors": [(3, 1, (16, 32, 32), {"base_channels": 4}), (2, 2, (32, 32), {"base_channels": 4})],
    "monai-unet": [
        (2, 1, (32, 32), {"feature_channels": 8, "channels": (4, 8, 16), "strides": (2, 2), "num_res_units": 1}),
        (3, 1, (16, 16, 16), {"feature_channels": 8, "channels": (4, 8, 16), "strides": (2, 2), "num_res_units": 1}),
    ],
    "swinunetr": [
        (2, 1, (64, 64), {"feature_size": 12, "depths": (1, 1, 1, 1), "num_heads": (1, 1, 1, 1), "window_size": 4})
    ],
    "medformer": [
        (
            2,
            1,
            (32, 32),
            {
                "channels": (8, 16, 16, 16, 16, 16, 8, 8),
                "conv_num": (1, 1, 0, 0, 0, 1, 1, 1),
                "trans_num": (0, 1, 1, 1, 1, 1, 0, 0),
                "num_heads": (1, 2, 2, 2, 2, 2, 1, 1),
                "map_size": 2,
                "fusion_depth": 1,
                "fusion_dim": 16,
                "fusion_heads": 2,
            },
        ),
        (
            3,
            1,
            (32, 32, 32),
            {
                "channels": (8, 16, 16, 16, 16, 16, 8, 8),
                "conv_num": (1, 1, 0, 0, 0, 1, 1, 1),
                "trans_num": (0, 1, 1, 1, 1, 1, 0, 0),
                "num_heads": (1, 2, 2, 2, 2, 2, 1, 1),
                "map_size": 2,
                "fusion_depth": 1,
                "fusion_dim": 16,
                "fusion_heads": 2,
            },
        ),
    ],
    "deeplabv3plus": [(2, 1, (64, 64), {"encoder_name": "resnet18", "decoder_channels": 32})],
    "sam-vitb": [
        (
            2,
            1,
            (64, 64),
            {
                "img_size": 64,
                "embed_dim": 64,
                "depth": 2,
                "num_heads": 2,
                "window_size": 2,
                "global_attn_indexes": (1,),
                "proj_channels": 16,
            },
        )
    ],
}
CASES = [
    pytest.param(name, *cfg, id=f"{name}-{cfg[0]}d")
    for name in BACKBONES.list()
    for cfg in TINY.get(name, [None])
    if cfg is not None
]
K = 3


def _build(name, dims, in_ch, size, kwargs, seed=0):
    torch.manual_seed(seed)
    model = create_segmenter(name, spatial_dims=dims, in_channels=in_ch, num_classes=K, **kwargs)
    x = torch.randn(2, in_ch, *size, generator=torch.Generator().manual_seed(1))
    return model, x


def test_every_registered_backbone_has_a_tiny_config():
    assert set(BACKBONES.list()) == set(TINY), "add a tiny configuration for every registered backbone"


@pytest.mark.parametrize("name,dims,in_ch,size,kwargs", CASES)
def test_features_and_logits_shapes(name, dims, in_ch, size, kwargs):
    model, x = _build(name, dims, in_ch, size, kwargs)
    backbone = model.backbone
    assert (backbone.spatial_dims, backbone.in_channels) == (dims, in_ch)
    backbone.check_input_size(size, "patch_size")
    for train in (True, False):
        model.train(train)
        out = model.forward_features(x)
        assert out.features.shape[:2] == (2, backbone.feature_channels)
        assert out.features.dim() == dims + 2
        assert all(f <= s for f, s in zip(out.features.shape[2:], size))
        assert out.logits.shape == (2, K, *size)
        assert torch.isfinite(out.logits).all()


@pytest.mark.parametrize("name,dims,in_ch,size,kwargs", CASES)
def test_gas_on_classifier_is_noise_in_training_only(name, dims, in_ch, size, kwargs):
    model, x = _build(name, dims, in_ch, size, kwargs)
    attach_gas(model.classifier)
    model.eval()
    with torch.no_grad():
        a, b = model.forward_features(x), model.forward_features(x)
    assert torch.equal(a.logits, b.logits)

    model.train()
    with torch.no_grad():
        torch.manual_seed(5)
        noisy = model.forward_features(x)
        noisy2 = model.forward_features(x)
        model.classifier.eval()  # the same training forward (same dropout masks) without GAS noise
        torch.manual_seed(5)
        clean = model.forward_features(x)
    assert torch.allclose(noisy.features, clean.features)
    assert not torch.allclose(noisy.logits, clean.logits)
    assert not torch.allclose(noisy.logits, noisy2.logits)


@pytest.mark.parametrize("name,dims,in_ch,size,kwargs", CASES)
def test_prototypes_from_features(name, dims, in_ch, size, kwargs):
    model, x = _build(name, dims, in_ch, size, kwargs)
    model.eval()
    labels = torch.zeros(2, *size, dtype=torch.long)
    half = size[-1] // 2
    labels[0, ..., :half] = 1
    labels[1, ..., half:] = 2
    with torch.no_grad():
        features = model.forward_features(x).features
    protos = class_prototypes(features, labels, [0, 1, 2])
    assert set(protos) == {0, 1, 2}
    # class 1 only occurs in sample 0: its prototype is that sample's normalised masked mean
    mask = align_labels(labels, features.shape[2:])[0] == 1
    expected = torch.nn.functional.normalize(features[0][:, mask].mean(dim=1), dim=0)
    channels = model.backbone.feature_channels
    assert protos[0].shape == protos[1].shape == protos[2].shape == (channels,)
    assert torch.allclose(protos[1], expected, atol=1e-6)


@pytest.mark.parametrize("name,dims,in_ch,size,kwargs", CASES)
def test_classifier_growth_keeps_old_logits(name, dims, in_ch, size, kwargs):
    model, x = _build(name, dims, in_ch, size, kwargs)
    model.eval()
    with torch.no_grad():
        old = model(x)
        model.classifier.grow(2)
        new = model(x)
    assert new.shape == (2, K + 2, *size)
    assert torch.allclose(new[:, :K], old, atol=1e-5)


@pytest.mark.parametrize("name,dims,in_ch,size,kwargs", CASES)
def test_layer_aliases_resolve_to_weighted_layers(name, dims, in_ch, size, kwargs):
    model, x = _build(name, dims, in_ch, size, kwargs)
    assert {"encoder", "decoder"} <= set(model.backbone.layer_aliases)
    for alias in ("encoder", "decoder"):
        layer = model.resolve_layer(alias)
        assert isinstance(layer.weight, torch.Tensor) and layer.weight.dim() >= 2
    # the GAS layer-choice ablation on the decoder layer: a training step fills its gradient buffer
    layer = model.resolve_layer("decoder")
    noise = attach_gas(layer)
    model.train()
    labels = torch.randint(0, K, (2, *size))
    torch.nn.functional.cross_entropy(model(x), labels).backward()
    record_sq_grad(layer)
    assert noise.sq_grad.shape == layer.parametrizations["weight"].original.shape
    assert noise.sq_grad.sum() > 0


@pytest.mark.parametrize("name,dims,in_ch,size,kwargs", CASES)
def test_frozen_modules_are_frozen(name, dims, in_ch, size, kwargs):
    """Only SAM freezes a module by itself: its encoder, in every session with train_encoder="never"
    (trained in session 0 by default: tests/test_sam_training.py)."""
    if name == "sam-vitb":
        kwargs = {**kwargs, "train_encoder": "never"}
    model, _ = _build(name, dims, in_ch, size, kwargs)
    frozen = model.backbone.frozen_modules()
    assert frozen == model.backbone.frozen_modules(0)
    if name == "sam-vitb":
        assert len(frozen) == 1 and frozen[0] is model.backbone.encoder
    else:
        assert frozen == []
    model.train()
    for module in frozen:
        assert not module.training
        assert all(not p.requires_grad for p in module.parameters())


def test_sam_one_channel_input_is_repeated_to_rgb():
    _, dims, in_ch, size, kwargs = next(c.values for c in CASES if c.values[0] == "sam-vitb")
    model, x = _build("sam-vitb", dims, in_ch, size, kwargs)
    model.eval()
    with torch.no_grad():
        one = model.backbone(x)
        three = model.backbone(x.expand(-1, 3, *size))
    assert torch.equal(one, three)
    assert one.shape[2:] == (size[0] // 16, size[1] // 16)


def test_sam_accepts_sizes_other_than_native():
    kwargs = next(c.values for c in CASES if c.values[0] == "sam-vitb")[4]
    model, x = _build("sam-vitb", 2, 3, (32, 48), kwargs)
    model.eval()
    assert model(x).shape == (2, K, 32, 48)


def test_2d_only_backbones_reject_3d():
    with pytest.raises(ConfigError, match="2D only"):
        create_segmenter("deeplabv3plus", spatial_dims=3, in_channels=1, num_classes=2, encoder_name="resnet18")
    with pytest.raises(ConfigError, match="2D only"):
        create_segmenter("sam-vitb", spatial_dims=3, in_channels=1, num_classes=2)


def test_input_size_checks():
    unet = create_segmenter("unet3d-authors", spatial_dims=3, in_channels=1, num_classes=2, base_channels=4).backbone
    unet.check_input_size((128, 120, 120), "patch_size")  # the authors' patch is not a multiple of 16: fine here
    with pytest.raises(ConfigError, match="at least"):
        unet.check_input_size((8, 32, 32), "patch_size")
    swin = create_segmenter(
        "swinunetr", spatial_dims=2, in_channels=1, num_classes=2, **TINY["swinunetr"][0][3]
    ).backbone
    with pytest.raises(ConfigError, match="multiple of 32"):
        swin.check_input_size((48, 64), "patch_size")


def test_authors_unet_parameter_count_matches_paper():
    """Paper, table 'Computational analysis': 16.27 M for the Med-Disjoint U-Net (backbone + 32xK classifier)."""
    model = create_segmenter("unet3d-authors", spatial_dims=3, in_channels=1, num_classes=21)
    assert round(sum(p.numel() for p in model.parameters()) / 1e6, 2) == 16.27


RUN_CASES = [
    pytest.param(name, *cfg, id=f"{name}-{cfg[0]}d") for name in BACKBONES.list() for cfg in TINY.get(name, [])[:1]
]


@pytest.mark.parametrize("name,dims,in_ch,size,kwargs", RUN_CASES)
def test_two_session_synthetic_run(name, dims, in_ch, size, kwargs, tmp_path):
    """One short epoch per session of JASCL (GAS + replay) on a toy protocol of the backbone's size."""
    from conftest import toy_protocol_dict
    from jascl.engine.config import resolve_config
    from jascl.experiments.runner import run_benchmark
    from jascl.protocols import parse_protocol

    d = toy_protocol_dict(dims)
    d["in_channels"] = in_ch
    d["synthetic"]["size"] = list(size)
    d["training"] = {
        "backbone": name,
        "backbone_args": dict(kwargs),
        "epochs_base": 1,
        "epochs_incremental": 1,
        "batch_size": 2,
        "augment": False,
    }
    protocol = parse_protocol(d, f"toy-{name}.yaml")
    config = resolve_config(protocol.training, protocol.path)
    results = run_benchmark(
        protocol, config, ["jascl"], tmp_path / "run", cache_dir=tmp_path / "cache", progress=False, echo=lambda m: None
    )
    sessions = results["methods"]["jascl"]["sessions"]
    assert [s["session"] for s in sessions] == [0, 1]
    assert set(sessions[1]["per_class"]) == {"0", "1", "2", "3"}
    assert 0.0 <= sessions[1]["background"] <= 1.0
