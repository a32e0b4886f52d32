"""Few-shot class-incremental baselines: PIFS, GAPS, NC-FSCIL, FeCAM, Subspace (pure functions with hand-computed
values, then each method end to end on the toy two-session protocol)."""

import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from jascl.engine.config import resolve_config
from jascl.engine.loop import ContinualTrainer
from jascl.errors import ConfigError
from jascl.experiments.runner import run_benchmark
from jascl.methods import Method, Plugin
from jascl.methods.baselines.fewshot.fecam import (
    FeCAMHead,
    FeCAMOptions,
    FeCAMPlugin,
    GaussianAccumulator,
    correlation_matrix,
    fecam_precision,
    mahalanobis_sq,
    shrink_covariance,
    tukey_transform,
)
from jascl.methods.baselines.fewshot.gaps import (
    GAPSOptions,
    GAPSPlugin,
    PasteParams,
    PoolEntry,
    context_candidates,
    crop_to_object,
    paste_object,
    sample_paste,
    uniform_interval_pick,
    vrfs_probabilities,
)
from jascl.methods.baselines.fewshot.ncfscil import (
    ETFClassifier,
    ProjectionHead,
    class_balance_weights,
    dot_regression_loss,
    simplex_etf,
)
from jascl.methods.baselines.fewshot.pifs import pifs_distillation, pifs_prototypes
from jascl.methods.baselines.fewshot.subspace import anchor_distance, subspace_distance
from jascl.methods.registry import create_method

MINE = ("pifs", "gaps", "nc-fscil", "fecam", "subspace")


# ----------------------------------------------------------------------------- NC-FSCIL


@pytest.mark.parametrize("k,d", [(2, 2), (4, 4), (5, 9)])
def test_simplex_etf_has_unit_columns_and_pairwise_cosine_minus_one_over_k_minus_one(k, d):
    w = simplex_etf(k, d, torch.Generator().manual_seed(0)).double()
    assert w.shape == (d, k)
    gram = w.t() @ w
    expected = torch.full((k, k), -1.0 / (k - 1), dtype=torch.float64)
    expected.fill_diagonal_(1.0)
    assert torch.allclose(gram, expected, atol=1e-5)


def test_simplex_etf_needs_enough_dimensions():
    with pytest.raises(ValueError, match="dim >= 4"):
        simplex_etf(4, 3)


def test_dot_regression_loss_hand_values():
    mu = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    targets = torch.tensor([[0.6, 0.8], [0.0, 1.0]])
    # dots 0.6 and 1 -> 1/2 * mean(0.16, 0) = 0.04
    assert dot_regression_loss(mu, targets).item() == pytest.approx(0.04)
    # class balance: classes [0, 0, 0, 1] -> gamma = 4 / 2 = 2, weights 2/3 x3 and 2
    w = class_balance_weights(torch.tensor([0, 0, 0, 1]))
    assert torch.allclose(w, torch.tensor([2 / 3, 2 / 3, 2 / 3, 2.0]))
    mu4 = torch.tensor([[1.0, 0.0]] * 4)
    t4 = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])  # dots 1, 1, 0, 0
    # 1/2 * (0 + 0 + 2/3 * 1 + 2 * 1) / 4 = 1/3
    assert dot_regression_loss(mu4, t4, class_balance_weights(torch.tensor([0, 0, 0, 1]))).item() == pytest.approx(
        1 / 3
    )


def test_projection_head_acts_per_pixel_and_etf_classifier_scores_by_cosine():
    torch.manual_seed(0)
    head = ProjectionHead(3, 4)
    x = torch.randn(2, 3, 5, 5)
    per_pixel = head(x.movedim(1, -1).reshape(-1, 3)).reshape(2, 5, 5, 4).movedim(-1, 1)
    assert torch.allclose(head(x), per_pixel, atol=1e-6)
    etf = simplex_etf(4, 4, torch.Generator().manual_seed(1))
    clf = ETFClassifier(head, etf, [0, 2, 3], temperature=10.0)  # seen rows use ETF columns 0, 2, 3
    logits = clf(x)
    mu = torch.nn.functional.normalize(head(x), dim=1)
    assert logits.shape == (2, 3, 5, 5) and clf.num_classes == 3
    assert torch.allclose(logits[:, 1], 10.0 * torch.einsum("bdhw,d->bhw", mu, etf[:, 2]), atol=1e-5)


# ----------------------------------------------------------------------------- FeCAM


def test_tukey_shrinkage_and_correlation_hand_values():
    assert torch.allclose(tukey_transform(torch.tensor([9.0, -4.0, 0.0])), torch.tensor([3.0, -2.0, 0.0]))
    cov = torch.tensor([[2.0, 0.5], [0.5, 1.0]])
    # V1 = mean diag = 1.5, V2 = mean non-zero off-diagonal = 0.5
    shrunk = shrink_covariance(cov)
    assert torch.allclose(shrunk, torch.tensor([[3.5, 1.0], [1.0, 2.5]]))
    corr = correlation_matrix(shrunk)
    assert torch.allclose(corr, torch.tensor([[1.0, 1.0 / math.sqrt(8.75)], [1.0 / math.sqrt(8.75), 1.0]]))
    # the official code shrinks twice: second pass V1 = 3, V2 = 1
    assert torch.allclose(
        torch.linalg.inv(fecam_precision(cov, shrink_passes=2, normalise=False)),
        torch.tensor([[6.5, 2.0], [2.0, 5.5]]),
        atol=1e-5,
    )


def test_mahalanobis_equals_the_closed_form_in_2d():
    cov = torch.tensor([[2.0, 0.5], [0.5, 1.0]])
    inv = torch.tensor([[1.0, -0.5], [-0.5, 2.0]]) / (2.0 * 1.0 - 0.25)  # 2x2 inverse by hand
    x = torch.tensor([[1.0, 2.0], [0.0, 1.0]])
    d = mahalanobis_sq(x, torch.tensor([0.0, 1.0]), torch.linalg.inv(cov))
    # delta (1, 1): (1 - 0.5 - 0.5 + 2) / 1.75; delta (0, 0): 0
    assert d.tolist() == pytest.approx([2.0 / 1.75, 0.0], abs=1e-6)
    assert torch.allclose(torch.linalg.inv(cov), inv)


def test_fecam_head_predicts_by_mahalanobis_where_euclid_would_not():
    # class A at angle 0 with a covariance elongated along the circle's tangent (y), class B at 40 degrees, tight
    mean_a, mean_b = torch.tensor([1.0, 0.0]), torch.tensor([math.cos(math.radians(40)), math.sin(math.radians(40))])
    prec_a = torch.linalg.inv(torch.tensor([[0.01, 0.0], [0.0, 1.0]]))
    prec_b = torch.linalg.inv(torch.tensor([[0.01, 0.0], [0.0, 0.01]]))
    head = FeCAMHead(torch.stack([mean_a, mean_b]), torch.stack([prec_a, prec_b]), torch.tensor([0, 1]), 2, beta=1.0)
    angle = math.radians(25)
    x = torch.tensor([math.cos(angle), math.sin(angle)])  # Euclid: closer to B (15 deg) than to A (25 deg)
    assert (x - mean_b).norm() < (x - mean_a).norm()
    logits = head(x.view(1, 2, 1, 1) * 3.0)  # the head normalises features (scale-free)
    da = (x - mean_a) @ prec_a @ (x - mean_a)
    db = (x - mean_b) @ prec_b @ (x - mean_b)
    assert logits.shape == (1, 2, 1, 1)
    assert logits[0, :, 0, 0].tolist() == pytest.approx([-float(da), -float(db)], rel=1e-5)
    assert int(logits.argmax(1)) == 0


def test_fecam_head_takes_the_nearest_gaussian_of_a_class_and_marks_classes_without_one():
    means = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    eye = torch.eye(2).expand(2, 2, 2)
    head = FeCAMHead(means, eye, torch.tensor([1, 1]), 3, beta=1.0)  # both Gaussians belong to row 1
    logits = head(torch.tensor([[0.0, 2.0]]))
    assert logits[0, 1].item() == pytest.approx(0.0, abs=1e-6)  # min(|(0,1)-(1,0)|^2 = 2, 0) = 0
    assert logits[0, 0].item() < -1e20 and logits[0, 2].item() < -1e20
    many = torch.randn(7, 2, 3, 3)
    chunked = FeCAMHead(means, eye, torch.tensor([1, 2]), 3, beta=1.0)
    whole = chunked(many)
    chunked.chunk = 5  # the distance is computed in blocks of pixels; the result must not depend on it
    assert torch.allclose(chunked(many), whole)


def test_gaussian_accumulator_matches_torch_cov_of_tukey_features():
    torch.manual_seed(0)
    features = torch.randn(2, 3, 4, 4)
    labels = torch.zeros(2, 4, 4, dtype=torch.long)
    labels[:, :2] = 5
    acc = GaussianAccumulator([5, 0], beta=0.5)
    acc.update(features[:1], labels[:1])
    acc.update(features[1:], labels[1:])  # streamed over two batches
    out = acc.compute()
    pixels = features.movedim(1, -1)[labels == 5]
    mean, cov, n = out[5]
    assert n == 16
    assert torch.allclose(mean, pixels.mean(0), atol=1e-6)
    assert torch.allclose(cov, torch.cov(tukey_transform(pixels).t()), atol=1e-5)


def test_fecam_options_are_checked():
    with pytest.raises(ConfigError, match="method_args.fecam.beta"):
        FeCAMPlugin(FeCAMOptions(beta=0.0))
    cfg = resolve_config(overrides=["method_args.fecam.background=sometimes"])
    with pytest.raises(ConfigError, match="method_args.fecam.background"):
        create_method("fecam", cfg)


# ----------------------------------------------------------------------------- PIFS


def test_pifs_initialisation_is_the_normalised_prototype_of_normalised_pixels():
    # image 0: class 7 on pixels (3, 4) and (1, 0); image 1: class 7 on (0, 5)
    f = torch.tensor([[[3.0, 1.0, 0.0]], [[4.0, 0.0, 2.0]]])[None]  # (1, 2, 1, 3)
    lab = torch.tensor([[[7, 7, 0]]])
    f1 = torch.tensor([[[0.0]], [[5.0]]])[None]
    lab1 = torch.tensor([[[7]]])
    protos = pifs_prototypes([(0, f, lab), (1, f1, lab1)], [7, 9])  # (sample, features, labels) pieces
    per_image0 = torch.tensor([0.6 + 1.0, 0.8 + 0.0])
    per_image0 = per_image0 / per_image0.norm()
    expected = per_image0 + torch.tensor([0.0, 1.0])
    expected = expected / expected.norm()
    assert set(protos) == {7}  # class 9 absent
    assert torch.allclose(protos[7], expected, atol=1e-6)
    assert protos[7].norm().item() == pytest.approx(1.0)
    # image 0 in two pieces (a volume taken in blocks): its pixels' sum is normalised once, at its end
    split = [(0, f[..., :1], lab[..., :1]), (0, f[..., 1:], lab[..., 1:]), (1, f1, lab1)]
    assert torch.allclose(pifs_prototypes(split, [7, 9])[7], expected, atol=1e-6)
    # were the pieces taken as images, each would be normalised: (0.6, 0.8) + (1, 0) + (0, 1), another direction
    wrong = torch.tensor([1.6, 1.8]) / torch.tensor([1.6, 1.8]).norm()
    as_images = pifs_prototypes([(0, f[..., :1], lab[..., :1]), (1, f[..., 1:], lab[..., 1:]), (2, f1, lab1)], [7])
    assert torch.allclose(as_images[7], wrong, atol=1e-6) and not torch.allclose(wrong, expected, atol=1e-3)


def test_pifs_distillation_hand_value_and_narrowing_to_the_teacher_classes():
    student = torch.zeros(1, 3, 1, 1)
    student[0, 2] = 100.0  # a class the teacher does not have: excluded from the student's softmax
    teacher = torch.zeros(1, 2, 1, 1)
    # -(1/2) * (0.5 * log 0.5 + 0.5 * log 0.5) = log(2) / 2
    assert pifs_distillation(student, teacher).item() == pytest.approx(math.log(2) / 2)
    teacher2 = torch.tensor([0.0, math.log(3.0)]).view(1, 2, 1, 1)  # q = (1/4, 3/4)
    student2 = torch.tensor([math.log(3.0), 0.0]).view(1, 2, 1, 1)  # p = (3/4, 1/4)
    value = -(0.25 * math.log(0.75) + 0.75 * math.log(0.25)) / 2
    assert pifs_distillation(student2, teacher2).item() == pytest.approx(value, rel=1e-6)


# ----------------------------------------------------------------------------- GAPS


def test_crop_and_paste_put_the_object_where_expected():
    image = torch.zeros(1, 6, 6)
    mask = torch.zeros(6, 6, dtype=torch.bool)
    mask[2, 3] = mask[3, 3] = mask[3, 4] = True
    obj = torch.arange(36.0).view(1, 6, 6)
    crop_img, crop_mask = crop_to_object(obj, mask)
    assert crop_mask.tolist() == [[True, False], [True, True]]
    assert crop_img[0].tolist() == [[15.0, 16.0], [21.0, 22.0]]
    label = torch.full((6, 6), 1)
    new_img, new_lab = paste_object(image, label, crop_img, crop_mask, 9, PasteParams(False, (2, 2), (0, 4)))
    assert new_lab[0:2, 4:6].tolist() == [[9, 1], [9, 9]] and int((new_lab == 9).sum()) == 3
    assert new_img[0, 0:2, 4:6].tolist() == [[15.0, 0.0], [21.0, 22.0]]
    assert torch.equal(image, torch.zeros(1, 6, 6)) and torch.equal(label, torch.full((6, 6), 1))  # inputs untouched
    # flipped along the last axis and doubled in size (nearest mask, 4x4 region at the origin)
    _, flip_lab = paste_object(image, label, crop_img, crop_mask, 9, PasteParams(True, (4, 4), (0, 0)))
    assert (flip_lab[:4, :4] == 9).tolist() == [
        [False, False, True, True],
        [False, False, True, True],
        [True, True, True, True],
        [True, True, True, True],
    ]


def test_sample_paste_shrinks_to_fit_and_is_seeded():
    a = sample_paste(np.random.default_rng(3), (10, 20), (8, 8))
    b = sample_paste(np.random.default_rng(3), (10, 20), (8, 8))
    assert a == b
    assert all(s <= 8 for s in a.size)
    for _ in range(50):
        p = sample_paste(np.random.default_rng(_), (3, 3), (16, 16))
        assert all(0 <= o and o + s <= 16 for o, s in zip(p.offset, p.size))
        assert 1 <= p.size[0] <= 6


def test_vrfs_probability_interval_pick_and_context_candidates():
    assert vrfs_probabilities(4, 2, 8) == pytest.approx(0.5)  # r = max(1, sqrt(0.25 / 0.25)) = 1
    r = math.sqrt(0.5 / 0.01)
    assert vrfs_probabilities(2, 1, 100) == pytest.approx(2 * r / (3 * r + 1))
    picks = uniform_interval_pick(10, 3, np.random.default_rng(0))
    assert [p // 3 for p in picks] == [0, 1, 2] and max(picks) < 9  # one per interval [0,3), [3,6), [6,9)
    memory = torch.nn.functional.normalize(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [-1.0, 0.0]]), dim=1)
    support = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    assert context_candidates(support, memory, fraction=0.05) == [0, 1]  # k = max(1, int(0.2)) = 1 each
    assert context_candidates(support, memory, fraction=0.5) == [0, 1, 2]


def test_gaps_synthesis_pastes_the_session_class_with_its_pixels():
    plugin = GAPSPlugin(GAPSOptions(context_prob=0.0))
    plugin.memory_images = [torch.zeros(1, 16, 16)]
    base_label = torch.zeros(16, 16, dtype=torch.long)
    base_label[:4, :4] = 1  # a base class in the memory image
    plugin.memory_labels = [base_label]
    plugin.num_base_classes = 2
    obj = torch.full((1, 16, 16), 0.75)
    mask = torch.zeros(16, 16, dtype=torch.bool)
    mask[5:9, 5:9] = True
    plugin.pool = [PoolEntry.make(3, obj, mask)]
    plugin._rng = np.random.default_rng(0)
    pasted = 0
    for _ in range(10):
        image, label = plugin.synthesise(3)
        assert label.shape == (16, 16) and image.shape == (1, 16, 16)
        assert torch.allclose(
            image[0][label == 3], torch.tensor(0.75)
        )  # pasted pixels carry the object's intensities and class
        assert torch.all(image[0][label != 3] == 0.0)
        pasted += int((label == 3).any())
    # one class in the pool: p = vRFS(3 classes, 1 shot, memory 1) = 0.5 per sample; seed 0 pastes in some samples
    assert 0 < pasted < 10


# ----------------------------------------------------------------------------- Subspace


def test_subspace_distance_and_anchor_hand_values():
    base = torch.tensor([[2.0, 0.0, 0.0], [1.0, 1.0, 0.0]])  # spans the xy-plane
    new = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, -1.0]])
    assert subspace_distance(new, base).item() == pytest.approx(9.0 + 1.0, abs=1e-5)  # squared z-components
    assert subspace_distance(torch.tensor([[4.0, -1.0, 0.0]]), base).item() == pytest.approx(0.0, abs=1e-6)
    assert anchor_distance(
        torch.tensor([[3.0, 4.0], [1.0, 1.0]]), torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    ).item() == pytest.approx(5.0)  # not squared, as the official regloss


@pytest.mark.parametrize(
    "override,match",
    [
        ("method_args.pifs.freeze=partial", "method_args.pifs.freeze: must be one of config, none, all_but_classifier"),
        ("method_args.gaps.memory_size=0", "method_args.gaps.memory_size: must be >= 1"),
        ("method_args.gaps.context_prob=2", r"method_args.gaps.context_prob: must be >= 0 and <= 1 \(got 2.0\)"),
        ("method_args.nc-fscil.proj_dim=-1", "method_args.nc-fscil.proj_dim: must be >= 0"),
        ("method_args.subspace.lambda_pull=-1", r"method_args.subspace.lambda_pull: must be >= 0 \(got -1.0\)"),
        ("method_args.fecam.beta=x", "method_args.fecam.beta: must be a number"),
    ],
)
def test_bad_options_are_one_line_config_errors(override, match):
    name = override.split(".")[1]
    with pytest.raises(ConfigError, match=match):
        create_method(name, resolve_config(overrides=[override]))


def test_nc_fscil_refuses_a_projection_smaller_than_the_class_count(runs, tmp_path):
    protocol, config, root, _ = runs
    small = dataclasses.replace(config, method_args={"nc-fscil": {"proj_dim": 3}})  # 4 protocol classes need d >= 4
    with pytest.raises(ConfigError, match="method_args.nc-fscil.proj_dim: 3 < 4 protocol classes"):
        run_benchmark(
            protocol,
            small,
            ["nc-fscil"],
            tmp_path / "run",
            cache_dir=root / "cache",
            progress=False,
            echo=lambda *a: None,
        )


# ----------------------------------------------------------------------------- end to end


class Probe(Plugin):
    """Largest |value| of every loss term per session; batch ids and trainable parameter count per session."""

    name = "probe"

    def __init__(self):
        self.terms: dict[int, dict[str, float]] = {}
        self.ids: dict[int, set] = {}

    def before_backward(self, state):
        terms = self.terms.setdefault(state.session.index, {})
        for key, value in state.losses.items():
            v = float(value.detach())
            assert math.isfinite(v)
            terms[key] = max(terms.get(key, 0.0), abs(v))
        self.ids.setdefault(state.session.index, set()).update(state.batch["id"])


def _run(name, toy_protocol, toy_config, out, cache):
    probe = Probe()
    results = run_benchmark(
        toy_protocol,
        toy_config,
        [name],
        out,
        cache_dir=cache,
        progress=False,
        echo=lambda *a: None,
        extra_plugins=[probe],
    )
    return results, probe


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from conftest import toy_protocol_dict
    from jascl.protocols import parse_protocol

    protocol = parse_protocol(toy_protocol_dict(2), source="toy-2d.yaml")
    config = resolve_config(protocol.training, "toy-2d.yaml")
    root = tmp_path_factory.mktemp("fewshot")
    out = {}
    for name in MINE:
        out[name] = _run(name, protocol, config, root / "run", root / "cache")
    return protocol, config, root, out


@pytest.mark.parametrize("name", MINE)
def test_each_method_trains_evaluates_and_its_terms_act_in_session_1(name, runs):
    protocol, config, root, out = runs
    results, probe = out[name]
    sessions = results["methods"][name]["sessions"]
    assert len(sessions) == 2 and all(0.0 <= s["all"] <= 1.0 for s in sessions)
    for plugin in create_method(name, config).plugins:
        for term in plugin.loss_terms:
            assert probe.terms[1].get(term, 0.0) > 0.0, f"{name}: {term} never non-zero in session 1"
    assert (root / "run" / name / "s1-inc" / "metrics.json").exists()


def test_nc_fscil_trains_its_own_base_with_dr_only_and_keeps_checkpoints_standard(runs, tmp_path):
    protocol, config, root, out = runs
    _, probe = out["nc-fscil"]
    assert set(probe.terms[0]) == {"ncfscil_dr"} and set(probe.terms[1]) == {"ncfscil_dr"}  # DiceCE replaced
    folder = root / "run" / "nc-fscil" / "s1-inc"
    extra = load_file(folder / "plugins.safetensors")
    assert {"0.ncfscil.etf", "0.ncfscil.head.shortcut.weight", "0.ncfscil.memory.s0.c0"} <= set(extra)
    assert extra["0.ncfscil.etf"].shape[1] == 4  # one column per protocol class, background included
    state = load_file(folder / "model.safetensors")
    assert state["classifier.weight"].shape[0] == 4 and not any("head" in k for k in state)
    # the base session of nc-fscil is its own, not the shared one
    assert (root / "run" / "nc-fscil" / "s0-base" / "metrics.json").exists()


def test_nc_fscil_resumes_from_its_saved_state(runs):
    protocol, config, root, out = runs
    first = out["nc-fscil"][0]["methods"]["nc-fscil"]["sessions"]
    again, probe = _run("nc-fscil", protocol, config, root / "run", root / "cache")
    assert probe.terms == {}  # nothing retrained
    assert json.dumps(again["methods"]["nc-fscil"]["sessions"]) == json.dumps(first)  # NaN-safe equality


def test_fecam_is_training_free_and_restores_the_classifier(runs):
    protocol, config, root, out = runs
    base = load_file(root / "run" / "base" / "model.safetensors")
    s1 = load_file(root / "run" / "fecam" / "s1-inc" / "model.safetensors")
    assert all(torch.equal(base[k], s1[k]) for k in base if k != "classifier.weight")
    assert torch.equal(s1["classifier.weight"][:3], base["classifier.weight"])  # old rows untouched (lr 0)
    extra = load_file(root / "run" / "fecam" / "s1-inc" / "plugins.safetensors")
    # Gaussians of (session, class): base background + classes 1, 2; session 1 background + taught 3 and 1
    means = sorted(k for k in extra if k.endswith(".mean"))
    assert means == sorted(f"0.fecam.s{s}.c{c}.mean" for s, c in [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 3)])
    assert extra["0.fecam.s1.c3.cov"].shape == (8, 8)  # feature channels of the toy U-Net


def test_fecam_session_1_prediction_is_the_mahalanobis_head(runs, tmp_path):
    """Re-evaluating the saved session-1 model with the head built from the saved statistics gives the record."""
    from jascl.data.synthetic import load_or_generate
    from jascl.engine.checkpoint import load_tensors
    from jascl.evaluation.evaluator import evaluate

    protocol, config, root, out = runs
    data = load_or_generate(protocol, root / "cache")
    method = create_method("fecam", config)
    trainer = ContinualTrainer(protocol, config, method, data, progress=False)
    folder = root / "run" / "fecam" / "s1-inc"
    model, store, record = trainer.load_session(folder, 1)
    method.load_extra_state(load_tensors(folder / "plugins.safetensors"))
    state = trainer.loop_state(1, model, store)
    model.classifier = method.plugins[0].head(state)
    result = evaluate(
        model,
        [d.test for d in data[:2]],
        state.seen,
        trainer.device,
        roi=config.patch_size,
        batch_size=config.batch_size,
    )
    assert {str(k): v for k, v in result.dice.items()} == pytest.approx(record["dice"], nan_ok=True)


def test_gaps_trains_on_synthetic_batches_only_and_stores_its_memory(runs):
    protocol, config, root, out = runs
    _, probe = out["gaps"]
    assert probe.ids[1] == {"gaps-synthetic"}
    extra = load_file(root / "run" / "gaps" / "s1-inc" / "plugins.safetensors")
    assert int(extra["0.gaps.num_base_classes"][0]) == 3
    n_memory = len([k for k in extra if k.startswith("0.gaps.memory.") and k.endswith(".image")])
    assert n_memory == 8  # all 8 base images fit in the default 500-image memory
    pool_classes = sorted(int(extra[k][0]) for k in extra if k.endswith(".class"))
    assert set(pool_classes) == {1, 3} and len(pool_classes) >= 4  # 2 shots of each taught class


def test_pifs_imprints_normalised_prototypes_and_distils_from_the_warm_teacher(runs, tmp_path):
    from jascl.data.synthetic import load_or_generate
    from jascl.engine.prototypes import PrototypeStore
    from jascl.methods.baselines.fewshot._shared import sample_pieces
    from jascl.methods.baselines.fewshot.pifs import PIFSPlugin
    from jascl.methods.common import labelled_loader

    class Snap(Plugin):
        name = "snap"

        def before_session(self, state):
            if state.session.index == 1:
                self.rows = state.model.classifier.weight.detach().clone()
                self.expected = pifs_prototypes(sample_pieces(state, state.model, labelled_loader(state)), [3])
                self.teacher_rows = pifs.teacher.classifier.weight.detach().clone()

    toy_protocol, toy_config, root, _ = runs
    pifs, snap = PIFSPlugin(), Snap()
    data = load_or_generate(toy_protocol, root / "cache")
    trainer = ContinualTrainer(toy_protocol, toy_config, Method("m", [pifs, snap]), data, progress=False)
    model, store = trainer.new_model(3), PrototypeStore()
    trainer.run_session(0, model, store, tmp_path / "s0")
    trainer.run_session(1, model, store, tmp_path / "s1")
    assert torch.allclose(snap.rows[3], snap.expected[3], atol=1e-6) and snap.rows[3].norm().item() == pytest.approx(
        1.0
    )
    assert torch.equal(snap.teacher_rows, snap.rows)  # warm start: the teacher already has the new prototype
    assert pifs.teacher is None  # released after the session


def test_subspace_keeps_anchors_and_one_exemplar_per_class(runs):
    protocol, config, root, out = runs
    extra = load_file(root / "run" / "subspace" / "s1-inc" / "plugins.safetensors")
    anchors = sorted(k for k in extra if ".anchor." in k)
    assert anchors == sorted(f"0.subspace.anchor.c{c}.s{s}" for c, s in [(0, 0), (1, 0), (2, 0), (3, 1)])
    base = load_file(root / "run" / "base" / "model.safetensors")["classifier.weight"]
    assert torch.equal(extra["0.subspace.anchor.c2.s0"], base[2])  # anchored at the end of the base session
    labels = [extra[k] for k in sorted(extra) if k.startswith("0.subspace.exemplar.") and k.endswith(".label")]
    # one image showing each class, in order: base classes 1, 2, then session-1 classes 3, 1
    assert len(labels) == 4 and [bool((l == c).any()) for l, c in zip(labels, [1, 2, 3, 1])] == [True] * 4
    _, probe = out["subspace"]
    assert {"subspace_base", "subspace_pull", "subspace_replay"} <= set(probe.terms[1])
    assert "subspace_novel" not in probe.terms[1]  # no earlier incremental session in a two-session protocol


@pytest.mark.parametrize("shape", [(2, 3, 9, 7), (2, 3, 5, 6, 4)])
def test_fecams_accumulator_takes_a_large_batch_in_slabs_with_the_same_gaussians(shape, monkeypatch):
    """Above CHUNK_PIXELS pixels a batch goes one sample at a time in slabs of the first spatial axis: the same
    counts, means and covariances (sums in another order), and each class's copies bounded by the chunk."""
    from jascl.methods.baselines.fewshot import fecam

    gen = torch.Generator().manual_seed(0)
    features = torch.randn(*shape, generator=gen)
    labels = torch.randint(0, 3, (shape[0], *shape[2:]), generator=gen)
    whole = GaussianAccumulator([0, 1, 2], beta=0.5)
    whole.update(features, labels)
    monkeypatch.setattr(fecam, "CHUNK_PIXELS", 2 * math.prod(shape[3:]))  # two rows of the first axis at a time
    copies = []
    real_add = GaussianAccumulator._add

    def recorded(self, flat, lab):
        copies.append(lab.numel())
        return real_add(self, flat, lab)

    monkeypatch.setattr(GaussianAccumulator, "_add", recorded)
    slabs = GaussianAccumulator([0, 1, 2], beta=0.5)
    slabs.update(features, labels)
    rows = shape[2]
    assert len(copies) == shape[0] * math.ceil(rows / 2) and max(copies) == 2 * math.prod(shape[3:])
    expected, got = whole.compute(), slabs.compute()
    assert got.keys() == expected.keys() == {0, 1, 2}
    for c in got:
        assert got[c][2] == expected[c][2]
        torch.testing.assert_close(got[c][0], expected[c][0], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(got[c][1], expected[c][1], rtol=1e-6, atol=1e-7)
