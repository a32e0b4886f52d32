"""MedFormer: the paper's 39.59 M parameters, counted by hand per stage; B-MHA on bare tensors; a tiny forward.

The literal per-stage numbers were measured on the JASCL authors' own model
(``networks/med_former`` with their ``med_args``, instantiated on CPU); the
formulas below rebuild them from the layer list, so a changed layer shows
which stage moved.
"""

import math

import pytest
import torch

from jascl.errors import ConfigError
from jascl.networks import BACKBONES, create_segmenter
from jascl.networks.medformer import MedFormer
from jascl.networks.medformer_blocks import bidirectional_attention, space_to_depth

K3 = 27  # weights of one 3x3x3 kernel


def sep(c_in: int, c_out: int) -> int:
    """Depthwise 3x3x3 (c_in kernels) + pointwise 1x1x1, no bias."""
    return c_in * K3 + c_in * c_out


def res_block(c_in: int, c_out: int) -> int:
    """Two 3x3x3 convolutions, a 3x3x3 shortcut when the channels change; no bias, norms without parameters."""
    return K3 * c_in * c_out + K3 * c_out * c_out + (K3 * c_in * c_out if c_in != c_out else 0)


def ffn(c: int, expansion: int = 4) -> int:
    """1x1 expansion, depthwise 3x3x3, squeeze-excitation (two 1x1 with bias, ratio 4), 1x1 projection."""
    e = expansion * c
    return c * e + e * K3 + (e * (e // 4) + e // 4) + ((e // 4) * e + e) + e * c


def bmha(c_in: int, c_map: int, c_out: int, map_out: bool = True) -> int:
    """Feature q/v and output (depthwise-separable), map q/v and output (1x1), 1x1 shortcut, feed-forward."""
    attn = sep(c_in, 2 * c_out) + sep(c_out, c_out) + c_map * 2 * c_out + (c_out * c_map if map_out else 0)
    return attn + (c_in * c_out if c_in != c_out else 0) + ffn(c_out)


def merge(c_in: int, c_out: int) -> int:
    """Patch merging: 8 sub-grids stacked (8 c_in channels), depthwise-separable projection."""
    return sep(8 * c_in, c_out)


def map_gen(c: int, tokens: int = 64) -> int:
    """Semantic map generation: 3x3x3 conv to the map's channels + 3x3x3 conv to ``tokens`` weight maps."""
    return K3 * c * c + K3 * c * tokens


def fusion(levels: tuple[int, ...] = (128, 256, 320), dim: int = 320, depth: int = 2) -> int:
    """1x1 in/out projections (no bias) + pre-norm layers: 2 LayerNorms, qkv (no bias), out (bias), MLP dim->dim->dim."""
    layer = 2 * (2 * dim) + 3 * dim * dim + (dim * dim + dim) + 2 * (dim * dim + dim)
    return 2 * dim * sum(levels) + depth * layer


# per stage: (measured on the authors' model, rebuilt by hand)
PAPER_STAGES = {
    "stem": (56_160, K3 * 1 * 32 + res_block(32, 32)),
    "down.0": (465_664, merge(32, 64) + 2 * res_block(64, 64)),
    "down.1": (2_009_472, merge(64, 128) + res_block(128, 128) + map_gen(128) + bmha(128, 128, 128)),
    "down.2": (8_439_808, merge(128, 256) + map_gen(256) + 4 * bmha(256, 256, 256)),
    "down.3": (17_865_856, merge(256, 320) + map_gen(320) + 6 * bmha(320, 320, 320)),
    "fusion": (1_683_840, fusion()),
    "up.0": (6_405_568, (320 + 256) * 256 + bmha(320 + 256, 256, 256) + 3 * bmha(256, 256, 256)),
    "up.1": (1_420_928, (256 + 128) * 128 + bmha(256 + 128, 128, 128, map_out=False) + res_block(128, 128)),
    "up.2": (995_328, res_block(128 + 64, 64) + res_block(64, 64)),
    "up.3": (248_832, res_block(64 + 32, 32) + res_block(32, 32)),
}


def _count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.fixture(scope="module")
def paper_model() -> MedFormer:
    return MedFormer()  # the defaults are the authors' med_args


@pytest.mark.parametrize("stage", list(PAPER_STAGES))
def test_each_stage_matches_the_authors_model_and_the_hand_count(paper_model, stage):
    measured, by_hand = PAPER_STAGES[stage]
    assert by_hand == measured
    assert _count(paper_model.get_submodule(stage)) == measured


def test_paper_parameter_count_39_59_m(paper_model):
    """Paper, table 'Computational analysis for Session 1', Med Semi-Supervised-JASCL: 39.59 M."""
    backbone = sum(measured for measured, _ in PAPER_STAGES.values())
    assert backbone == 39_591_456 == _count(paper_model)
    # session 1 of med-ss: background + 15 + 5 = 21 classifier rows; the cosine classifier adds 32 per row
    segmenter = create_segmenter("medformer", spatial_dims=3, in_channels=1, num_classes=21)
    assert _count(segmenter) == backbone + 32 * 21 == 39_592_128
    assert round(_count(segmenter) / 1e6, 2) == 39.59
    # any class count below 100 prints the same (the authors' 1x1 head with bias: 33 per row, 39,592,149 at K = 21)
    assert round((backbone + 33 * 99) / 1e6, 2) == 39.59


def test_the_map_nothing_reads_has_no_output_projection(paper_model):
    """up.1's last block would add 128 x 128 = 16,384 parameters (39.61 M): the authors drop it too."""
    blocks = [paper_model.up[0].transformer[i] for i in range(4)] + [paper_model.up[1].transformer[0]]
    assert [b.out_map is None for b in blocks] == [False, False, False, False, True]
    assert round((_count(paper_model) + 32 * 21 + 128 * 128) / 1e6, 2) == 39.61


def test_bidirectional_attention_by_hand():
    """N = 2 positions, M = 2 map tokens, one head of width 1: sim = [[1, -1], [0, 0]]."""
    q_feat = torch.tensor([[1.0], [0.0]]).view(1, 1, 2, 1)
    q_map = torch.tensor([[1.0], [-1.0]]).view(1, 1, 2, 1)
    v_feat = torch.tensor([[1.0], [3.0]]).view(1, 1, 2, 1)
    v_map = torch.tensor([[2.0], [4.0]]).view(1, 1, 2, 1)
    feat, mapped = bidirectional_attention(q_feat, q_map, v_feat, v_map, scale=1.0)

    def sig(t: float) -> float:
        return 1 / (1 + math.exp(-t))

    # rows (softmax over the map): position 0 weighs the tokens sigma(2), sigma(-2); position 1 evenly
    assert feat.flatten().tolist() == pytest.approx([2 * sig(2) + 4 * sig(-2), 3.0])
    # columns (softmax over positions): token 0 from sims (1, 0), token 1 from (-1, 0)
    assert mapped.flatten().tolist() == pytest.approx([sig(1) * 1 + sig(-1) * 3, sig(-1) * 1 + sig(1) * 3])


def test_space_to_depth_stacks_the_four_sub_grids_last_axis_fastest():
    x = torch.arange(16.0).view(1, 1, 4, 4)
    out = space_to_depth(x)
    assert out.shape == (1, 4, 2, 2)
    assert out[0, :, 0, 0].tolist() == [0.0, 1.0, 4.0, 5.0]  # offsets (0,0), (0,1), (1,0), (1,1)
    assert out[0, 0].tolist() == [[0.0, 2.0], [8.0, 10.0]]


SMALL = {
    "channels": (8, 16, 16, 16, 16, 16, 8, 8),
    "conv_num": (1, 1, 0, 0, 0, 1, 1, 1),
    "trans_num": (0, 1, 1, 1, 1, 1, 0, 0),
    "num_heads": (1, 2, 2, 2, 2, 2, 1, 1),
    "map_size": 2,
    "fusion_depth": 1,
    "fusion_dim": 16,
    "fusion_heads": 2,
}


@pytest.mark.parametrize("proj_type", ["depthwise", "linear"])
def test_tiny_3d_forward_and_every_parameter_gets_a_gradient(proj_type):
    torch.manual_seed(0)
    model = BACKBONES.create("medformer", spatial_dims=3, in_channels=1, proj_type=proj_type, **SMALL)
    x = torch.randn(1, 1, 32, 32, 32)
    out = model(x)
    assert out.shape == (1, 8, 32, 32, 32) and torch.isfinite(out).all()
    out.square().mean().backward()
    no_grad = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert no_grad == []


def test_map_size_per_axis_and_2d():
    model = MedFormer(spatial_dims=2, **{**SMALL, "map_size": (2, 1)})
    assert model.down[1].map_gen.weights.out_channels == 2
    assert model(torch.randn(1, 1, 32, 32)).shape == (1, 8, 32, 32)


def test_configurations_that_cannot_work_are_refused():
    with pytest.raises(ConfigError, match="no map arrives from below"):
        MedFormer(**{**SMALL, "trans_num": (0, 1, 1, 0, 1, 1, 0, 0)})
    with pytest.raises(ConfigError, match="not divisible by 3 heads"):
        MedFormer(**{**SMALL, "num_heads": (1, 3, 2, 2, 2, 2, 1, 1)})
    with pytest.raises(ConfigError, match="proj_type"):
        MedFormer(**{**SMALL, "proj_type": "conv"})
    with pytest.raises(ConfigError, match="conv_num\\[6\\] > 0 or trans_num\\[6\\] > 0"):
        MedFormer(**{**SMALL, "conv_num": (1, 1, 0, 0, 0, 1, 0, 1)})
