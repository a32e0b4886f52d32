"""Domain-incremental (MDIL) and semi-supervised (UaD-CE, CSL, RETRIEVE) baselines.

Pure rules are checked on hand-computed tiny tensors; the plugins on the toy
protocol with an unlabelled pool in session 1 (unlabelled phase every epoch).
"""

import copy
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from conftest import toy_protocol_dict
from jascl.data.synthetic import load_or_generate
from jascl.data.types import Split
from jascl.engine.config import resolve_config
from jascl.engine.loop import ContinualTrainer
from jascl.engine.prototypes import PrototypeStore
from jascl.errors import ConfigError
from jascl.methods import Method, Plugin
from jascl.methods.baselines.domain._shared import (
    MASKED_LOGIT,
    adapter_sites,
    domain_distillation,
    domain_specific_keys,
)
from jascl.methods.baselines.domain.domain_inference import batch_statistics, input_statistics, nearest_domain
from jascl.methods.baselines.domain.mdil import MDILPlugin
from jascl.methods.baselines.semi.csl import (
    block_mask,
    confidence_features,
    csl_loss,
    csl_weights_from_features,
    cutmix_box,
    spectral_two_clusters,
)
from jascl.methods.baselines.semi.retrieve import retrieve_greedy
from jascl.methods.baselines.semi.uad_ce import (
    adaptive_lambda,
    class_balanced_selection,
    uad_distillation,
    uad_keep_mask,
    uncertainty_from_samples,
)
from jascl.methods.registry import create_method
from jascl.networks.base import Backbone, create_segmenter
from jascl.protocols import parse_protocol

# ---------------------------------------------------------------- fixtures


class Recorder(Plugin):
    """Loss values of every iteration and the optimiser's learning rates."""

    name = "recorder"

    def __init__(self):
        self.losses, self.lrs = [], []

    def before_backward(self, state):
        self.losses.append({k: float(v.detach()) for k, v in state.losses.items()})
        self.lrs.append([g["lr"] for g in state.optimizer.param_groups])


@pytest.fixture(scope="module")
def pool_protocol():
    d = toy_protocol_dict(2)
    d["sessions"][1]["unlabelled"] = 4
    return parse_protocol(d, source="toy-2d-pool.yaml")


def _config(protocol, *overrides):
    return resolve_config(
        protocol.training,
        "toy-2d-pool.yaml",
        overrides=["pas.start_epoch=0", "pas.every=1", "method_args.uad-ce.noise_passes=2", *overrides],
    )


@pytest.fixture(scope="module")
def base(pool_protocol, tmp_path_factory):
    """Data and the shared session-0 model (trained once for the module)."""
    root = tmp_path_factory.mktemp("base")
    data = load_or_generate(pool_protocol, root / "cache")
    trainer = ContinualTrainer(pool_protocol, _config(pool_protocol), Method("base"), data, progress=False)
    trainer.run_session(0, trainer.new_model(3), PrototypeStore(), root / "s0")
    return data, root / "s0"


def _session1(protocol, config, method, data, base_dir: Path, out: Path):
    """Restore the base as session 0 and train session 1; returns (trainer, model, store)."""
    trainer = ContinualTrainer(protocol, config, method, data, progress=False)
    model, store, _ = trainer.load_session(base_dir, 0)
    trainer.restore_session(0, base_dir, model, store)
    trainer.run_session(1, model, store, out)
    return trainer, model, store


# ---------------------------------------------------------------- MDIL: pure parts


def test_mdil_domain_specific_keys_and_adapter_sites_of_unet():
    model = create_segmenter("unet", 2, 1, 3, features=[4, 4, 8, 8, 8, 8])
    keys = domain_specific_keys(model)
    state = model.state_dict()
    norms = [k for k in state if ".adn.N." in k]
    assert norms and set(norms) <= set(keys)  # every instance-norm affine parameter
    assert {k for k in state if k.startswith("backbone.net.upcat_")} <= set(keys)  # the decoder
    assert "classifier.weight" in keys
    shared = [k for k in state if k not in keys]
    assert shared and all(k.startswith(("backbone.net.conv_0.", "backbone.net.down_")) for k in shared)
    assert all(k.endswith(".conv.weight") or k.endswith(".conv.bias") or ".adn.A." in k for k in shared)
    sites = adapter_sites(model, keys)
    # the two 3x3 convolutions of conv_0 and of each of the four down blocks
    assert len(sites) == 10 and all(n.startswith(("backbone.net.conv_0.", "backbone.net.down_")) for n in sites)


def test_mdil_decoder_of_monai_unet_and_unknown_backbone():
    model = create_segmenter("monai-unet", 2, 1, 3, feature_channels=8, channels=(8, 16, 32), strides=(2, 2))
    assert model.backbone.decoder_prefixes() == ("out_norm.", "net.model.2.", "net.model.1.submodule.2.")

    class Odd(Backbone):  # a backbone that does not name its decoder
        feature_channels = 4
        spatial_dims = 2

    odd = copy.copy(model)
    odd.backbone = Odd()
    with pytest.raises(ConfigError, match="method_args.mdil.decoder"):
        domain_specific_keys(odd)
    assert domain_specific_keys(odd, decoder=("x",)) == ["classifier.weight"]


def test_domain_distillation_is_kl_teacher_to_student():
    teacher = torch.zeros(1, 2, 1, 1)  # q = (1/2, 1/2)
    student = torch.tensor([math.log(3.0), 0.0]).view(1, 2, 1, 1).requires_grad_(True)  # p = (3/4, 1/4)
    kd = domain_distillation(student, teacher)
    assert kd.item() == pytest.approx(0.5 * math.log(4 / 3), rel=1e-6)  # 1/2 ln(2/3) + 1/2 ln 2
    kd.backward()
    assert student.grad.abs().sum() > 0
    assert domain_distillation(teacher, teacher).item() == 0.0


# ---------------------------------------------------------------- MDIL: on the loop


def _domain_logits(plugin, trainer, model, store, session, x):
    state = trainer.loop_state(1, model, store)
    state.eval_session = session
    plugin.before_eval_split(state)
    model.eval()
    with torch.no_grad():
        out = model(x)
    plugin.after_eval(state)
    return out


def test_mdil_switches_domains_and_round_trips(pool_protocol, base, tmp_path):
    data, base_dir = base
    config = _config(pool_protocol, "freeze_incremental=all_but_classifier")
    plugin, rec = MDILPlugin(shared_lr_ratio=0.0, domain_oracle=True), Recorder()
    trainer, model, store = _session1(
        pool_protocol, config, Method("mdil", [plugin, rec]), data, base_dir, tmp_path / "s1"
    )
    base_model, _, _ = trainer.load_session(base_dir, 0)
    keys = set(domain_specific_keys(model))

    # MDIL's own freezing (none) overrides the config; shared params learn at ratio * lr (here 0), so the
    # old branch cannot drift from the teacher and the distillation is exactly 0
    assert rec.lrs[0] == [0.0, config.lr_incremental]
    assert [r["mdil"] for r in rec.losses] == [0.0, 0.0]
    trained, start = model.state_dict(), base_model.state_dict()
    assert all(torch.equal(trained[k], start[k]) for k in trained if k not in keys)
    assert any(not torch.equal(trained[k], start[k]) for k in keys if not k.startswith("classifier"))
    # domain 0 is the plain base model: zero adapters
    assert all(float(p.detach().abs().sum()) == 0 for p in plugin.adapters["a"].parameters())
    assert any(float(p.detach().abs().sum()) > 0 for p in plugin.adapters["b"].parameters())

    x = torch.from_numpy(data[0].test.images).float()
    out_a = _domain_logits(plugin, trainer, model, store, 0, x)
    out_b = _domain_logits(plugin, trainer, model, store, 1, x)
    with torch.no_grad():
        expected_a = base_model.eval()(x)
    # domain a's branch is exactly the model trained for domain a; its head has no row for class 3
    assert torch.allclose(out_a[:, :3], expected_a, atol=1e-5)
    assert torch.all(out_a[:, 3] == MASKED_LOGIT)
    assert (out_b[:, :3] - out_a[:, :3]).abs().max() > 1e-3
    assert torch.allclose(model.eval()(x), out_b)  # after_eval restored the domain trained last

    # the checkpoint is a standard Segmenter state dict; the rest is plugin state that restores the branches
    saved = load_file(str(tmp_path / "s1" / "model.safetensors"))
    assert set(saved) == set(trainer.new_model(4).state_dict())
    plugin2 = MDILPlugin(shared_lr_ratio=0.0, domain_oracle=True)
    trainer2 = ContinualTrainer(pool_protocol, config, Method("mdil", [plugin2]), data, progress=False)
    model2, store2, _ = trainer2.load_session(tmp_path / "s1", 1)
    trainer2.restore_session(1, tmp_path / "s1", model2, store2)
    a, b = plugin.extra_state(), plugin2.extra_state()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.allclose(_domain_logits(plugin2, trainer2, model2, store2, 0, x), out_a, atol=1e-6)
    assert torch.allclose(_domain_logits(plugin2, trainer2, model2, store2, 1, x), out_b, atol=1e-6)


def test_domain_statistics_and_the_nearest_domain_by_hand():
    # two 1-channel images: [0, 2] (mean 1, std 1) and [1, 1, 1, 1] (mean 1, std 0) -> [1, 0.5]
    images = [np.array([[0.0, 2.0]]), np.array([[1.0, 1.0, 1.0, 1.0]])]
    assert input_statistics(images).tolist() == [1.0, 0.5]
    assert input_statistics(images, limit=1).tolist() == [1.0, 1.0]
    batch = torch.tensor([[[0.0, 2.0]], [[4.0, 4.0]]])  # means 1, 4; stds 1, 0 -> [2.5, 0.5]
    assert batch_statistics(batch).tolist() == [2.5, 0.5]
    domains = {"ct": torch.tensor([2.0, 0.0]), "mri": torch.tensor([3.0, 1.0])}
    assert nearest_domain(torch.tensor([2.5, 0.5]), domains) == "ct"  # a tie (0.707 each): the first name
    assert nearest_domain(torch.tensor([2.9, 0.6]), domains) == "mri"
    with pytest.raises(ValueError):
        nearest_domain(torch.tensor([0.0, 0.0]), {})


def test_mdil_infers_each_test_batch_domain_without_the_oracle(pool_protocol, base, tmp_path):
    data, base_dir = base
    config = _config(pool_protocol, "freeze_incremental=all_but_classifier")
    oracle = MDILPlugin(shared_lr_ratio=0.0, domain_oracle=True)
    trainer, model, store = _session1(pool_protocol, config, Method("mdil", [oracle]), data, base_dir, tmp_path / "o")
    inferred = MDILPlugin(shared_lr_ratio=0.0)
    trainer2 = ContinualTrainer(pool_protocol, config, Method("mdil", [inferred]), data, progress=False)
    model2, store2, _ = trainer2.load_session(tmp_path / "o", 1)
    trainer2.restore_session(1, tmp_path / "o", model2, store2)
    assert set(inferred.stats) == {"a", "b"}  # saved with the session, per domain
    xa = torch.from_numpy(data[0].test.images).float()
    xb = torch.from_numpy(data[1].test.images).float()
    # whatever split the evaluation says (0 here), each batch goes to the branch of its own statistics: the same
    # logits as the oracle's branch of the batch's true domain
    got_a = _domain_logits(inferred, trainer2, model2, store2, 0, xa)
    got_b = _domain_logits(inferred, trainer2, model2, store2, 0, xb)
    assert torch.allclose(got_a, _domain_logits(oracle, trainer, model, store, 0, xa), atol=1e-6)
    assert torch.allclose(got_b, _domain_logits(oracle, trainer, model, store, 1, xb), atol=1e-6)
    assert not torch.allclose(got_b, _domain_logits(oracle, trainer, model, store, 0, xb), atol=1e-3)
    # the method's option: off in the paper's plans, on with --set method_args.mdil.domain_oracle=true
    assert create_method("mdil", config).plugins[0].domain_oracle is False
    on = resolve_config(pool_protocol.training, "toy.yaml", overrides=["method_args.mdil.domain_oracle=true"])
    assert create_method("mdil", on).plugins[0].domain_oracle is True


def test_mdil_distills_old_domains_when_shared_parameters_move(pool_protocol, base, tmp_path):
    data, base_dir = base
    plugin, rec = MDILPlugin(), Recorder()  # official ratio 0.01
    config = _config(pool_protocol)
    trainer, model, store = _session1(
        pool_protocol, config, Method("mdil", [plugin, rec]), data, base_dir, tmp_path / "s1"
    )
    assert rec.lrs[0] == pytest.approx([0.01 * config.lr_incremental, config.lr_incremental])
    assert rec.losses[0]["mdil"] == 0.0 and rec.losses[1]["mdil"] > 0  # after one step the shared encoder moved
    x = torch.from_numpy(data[0].test.images).float()
    base_model, _, _ = trainer.load_session(base_dir, 0)
    with torch.no_grad():
        drift = (_domain_logits(plugin, trainer, model, store, 0, x)[:, :3] - base_model.eval()(x)).abs().max()
    assert 0 < drift < 1.0  # logits are cosine x 10; the old branch moves a little, through the shared encoder


# ---------------------------------------------------------------- UaD-CE: pure parts


def test_uad_uncertainty_is_std_of_the_mean_prediction():
    # (M=2, B=1, K=2, 2 pixels): pixel 0 passes (.6,.4),(.8,.2); pixel 1 passes (.1,.9),(.5,.5)
    samples = torch.tensor([[[[0.6, 0.1], [0.4, 0.9]]], [[[0.8, 0.5], [0.2, 0.5]]]])
    pred, std = uncertainty_from_samples(samples)
    assert pred.tolist() == [[0, 1]]  # means (.7,.3) and (.3,.7)
    assert std[0].tolist() == pytest.approx([math.sqrt(0.02), math.sqrt(0.08)])  # unbiased std over 2 passes


def test_uad_keep_mask_drops_only_uncertain_pool_pixels():
    unc = torch.tensor([[0.1, 0.5], [0.3, 0.9]])  # image 0 labelled, image 1 from the pool
    keep = uad_keep_mask(unc, torch.tensor([False, True]), u_t=0.5)
    # sorted (.1,.3,.5,.9), position int(.5*4)=2 -> threshold .5: only the pool's .9 goes
    assert keep.tolist() == [[True, True], [True, False]]
    assert uad_keep_mask(unc, torch.tensor([True, True]), u_t=0.5).tolist() == [[True, True], [True, False]]
    # u_t=.25: position 1 -> threshold .3: .5 and .9 go (.3 is not above it)
    assert uad_keep_mask(unc, torch.tensor([True, True]), u_t=0.25).tolist() == [[True, False], [True, False]]


def test_uad_distillation_and_adaptive_weight():
    teacher = torch.zeros(1, 2, 2)  # two pixels, q = (1/2, 1/2) at any temperature
    student = torch.tensor([[[2 * math.log(3.0), 5.0], [0.0, -5.0]]]).requires_grad_(True)  # T=2: p=(3/4,1/4)
    keep = torch.tensor([[True, False]])
    kd = uad_distillation(student, teacher, keep, temperature=2.0)
    assert kd.item() == pytest.approx(0.5 * math.log(4 / 3), rel=1e-6)
    kd.backward()
    assert student.grad[0, :, 0].abs().sum() > 0 and student.grad[0, :, 1].abs().sum() == 0
    assert uad_distillation(student, teacher, torch.zeros(1, 2, dtype=torch.bool), 2.0).item() == 0.0
    assert adaptive_lambda(2.0, 0.6, 3, 2) == pytest.approx(2 / 0.6 * math.sqrt(1.5))
    assert adaptive_lambda(2.0, 0.6, 3, 2, adapt=False) == 2.0


def test_class_balanced_selection_takes_the_most_confident_per_class():
    # six pixels; predicted row and confidence: 0:.9, 0:.8, 0:.6, 1:.7, 1:.95, 2:.5
    conf = [(0, 0.9), (0, 0.8), (0, 0.6), (1, 0.7), (1, 0.95), (2, 0.5)]
    probs = torch.zeros(1, 3, 6)
    for i, (row, c) in enumerate(conf):
        probs[0, :, i] = (1 - c) / 2
        probs[0, row, i] = c
    everything = torch.ones(1, 6, dtype=torch.bool)
    assert class_balanced_selection(probs, everything, [0, 1], quota=2)[0].tolist() == [0, 0, 255, 1, 1, 255]
    assert class_balanced_selection(probs, everything, [0, 1], quota=1)[0].tolist() == [0, 255, 255, 255, 1, 255]
    taken = torch.tensor([[False, True, True, True, True, True]])  # pixel 0 already labelled
    assert class_balanced_selection(probs, taken, [0, 1, 2], quota=2)[0].tolist() == [255, 0, 0, 1, 1, 2]


# ---------------------------------------------------------------- CSL: pure parts


def test_csl_confidence_features():
    probs = torch.tensor([0.7, 0.2, 0.1]).view(1, 3, 1)
    m, v = confidence_features(probs)
    g = 4 / (2 * (0.3 + 1e-8))  # (K-1)^2 / (2 (1 - m + eps))
    assert m.item() == pytest.approx(0.7)
    assert v.item() == pytest.approx(g * ((0.2 - 0.15) ** 2 + (0.1 - 0.15) ** 2) / 2, rel=1e-5)
    _, v2 = confidence_features(torch.tensor([0.6, 0.4]).view(1, 2, 1))
    assert v2.item() == pytest.approx(0.0, abs=1e-12)  # one residual class: no spread


def test_csl_spectral_clusters_and_weights():
    m = torch.tensor([0.9, 0.7, 0.0, 0.0])
    v = torch.tensor([0.0, 0.0, 0.2, 0.1])
    # X^T X = diag(1.3, 0.05): the first singular direction is the confidence axis
    assert spectral_two_clusters(torch.stack([m, v], 1)).tolist() == [0, 0, 1, 1]
    w = csl_weights_from_features(m, v, alpha=2.0)
    # reliable cluster: mean (.8, 0), unbiased variance (.02, 0)
    assert w[0].item() == 1.0  # z_m = +0.707 > 0
    assert w[1].item() == pytest.approx(math.exp(-0.25), rel=1e-5)  # z_m = -0.707, z_v = 0
    assert w[2].item() < 1e-6 and w[3].item() < 1e-6
    valid = torch.tensor([True, False, True, True])
    assert csl_weights_from_features(m, v, valid, alpha=2.0)[1].item() == 0.0


def test_csl_loss_is_weighted_ce_over_valid_pixels():
    logits = torch.tensor([[[2.0, 0.0], [0.0, 1.0]]])  # (1, K=2, 2 pixels)
    pseudo = torch.tensor([[0, 0]])
    ce = [math.log(1 + math.exp(-2.0)), math.log(1 + math.exp(1.0))]
    loss = csl_loss(logits, pseudo, torch.tensor([[1.0, 0.5]]))
    assert loss.item() == pytest.approx((ce[0] + 0.5 * ce[1]) / 2, rel=1e-6)


def test_csl_masks():
    assert block_mask((4, 6), 2, 1.0).all() and not block_mask((4, 6), 2, 0.0).any()
    blocks = block_mask((8, 8), 4, 0.5, torch.Generator().manual_seed(0))
    assert all(blocks[i : i + 4, j : j + 4].unique().numel() == 1 for i in (0, 4) for j in (0, 4))
    assert not cutmix_box((8, 8), 0.0).any()
    box = cutmix_box((10, 10, 10), 1.0, torch.Generator().manual_seed(1))
    side = round(box.sum().item() ** (1 / 3))
    assert side**3 == box.sum().item() and 0.02 * 1000 <= box.sum().item() <= 0.4 * 1000 + 50


# ---------------------------------------------------------------- RETRIEVE: pure part


def test_retrieve_greedy_updates_the_labelled_gradient_after_each_choice():
    grads = torch.tensor([[-1.0, 0.0], [0.0, -1.0], [-2.0, 0.0]])
    target = torch.tensor([1.0, 0.0])

    def val_grad(delta):  # labelled loss 0.5 |w - target|^2 at w = 0 + delta
        return delta - target

    # first choice: gains (1, 0, 2) -> element 2; eta=1 overshoots to w=(2,0): gains (-1, 0) -> element 1
    assert retrieve_greedy(grads, val_grad, budget=2, eta=1.0) == [2, 1]
    # eta=.25: w=(.5,0), gradient (-.5,0): gains (.5, 0) -> element 0
    assert retrieve_greedy(grads, val_grad, budget=2, eta=0.25) == [2, 0]
    assert retrieve_greedy(grads, val_grad, budget=5, eta=0.25, candidates=lambda r: r[-1:]) == [2, 1, 0]


# ---------------------------------------------------------------- semi-supervised methods on the loop


def _garbage(data, seed=0):
    """The same data with the pool's hidden ground truth replaced by random labels."""
    out = copy.copy(data)
    pool = data[1].unlabelled
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 4, size=pool.labels.shape).astype(pool.labels.dtype)
    out[1] = copy.copy(data[1])
    out[1].unlabelled = Split(pool.images, labels, pool.ids)
    return out


@pytest.mark.parametrize("name", ["uad-ce", "csl", "retrieve"])
def test_semi_methods_train_on_the_pool_without_its_labels(name, pool_protocol, base, tmp_path):
    data, base_dir = base
    config = _config(pool_protocol)
    method = create_method(name, config)
    plugin, rec = method.plugins[0], Recorder()
    method.plugins.append(rec)
    trainer, model, _ = _session1(pool_protocol, config, method, data, base_dir, tmp_path / "a")
    record = json.loads((tmp_path / "a" / "metrics.json").read_text())

    # every loss term of the method is non-zero at some iteration of session 1
    for key in plugin.loss_terms:
        assert any(r.get(key, 0.0) != 0.0 for r in rec.losses), (key, rec.losses)
    assert len(rec.losses) == 2  # one step per epoch: the pool (4 images) is one batch
    stats = record["pseudo_labels"]
    assert 0 < stats["coverage"] <= 1 and 0 <= stats["precision"] <= 1
    if name == "uad-ce":
        assert stats["rounds"] == 2 and stats["coverage"] <= 160 / 300
        assert plugin.pseudo is None and plugin.teacher is None  # released after the session
    if name == "retrieve":
        assert [len(c) for c in stats["coresets"]] == [1, 1]  # ceil(0.1 * 4)

    # the hidden ground truth never reaches a loss: garbage labels, identical training
    method2 = create_method(name, config)
    _, model2, _ = _session1(pool_protocol, config, method2, _garbage(data), base_dir, tmp_path / "b")
    a, b = model.state_dict(), model2.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_uad_ce_selection_is_class_balanced_on_the_loop(pool_protocol, base, tmp_path):
    data, base_dir = base
    config = _config(pool_protocol, "epochs_incremental=1")
    method = create_method("uad-ce", config)
    plugin = method.plugins[0]
    seen = []

    class Peek(Plugin):
        name = "peek"

        def after_training(self, state):
            seen.append(plugin.pseudo.clone())

    method.plugins.append(Peek())
    _session1(pool_protocol, config, method, data, base_dir, tmp_path / "s1")
    pseudo = seen[0]
    total = pseudo.numel()
    quota = int(10 / 300 * total) // 3  # background + the session's classes 1 and 3
    counts = [int((pseudo == row).sum()) for row in range(4)]
    assert counts[2] == 0  # class 2 (row 2) is not taught in session 1
    assert all(c <= quota for c in counts) and sum(counts) > 0


def test_semi_options_are_checked(pool_protocol):
    with pytest.raises(ConfigError, match="method_args.uad-ce"):
        create_method("uad-ce", _config(pool_protocol, "method_args.uad-ce.u_t=0"))
    with pytest.raises(ConfigError, match="method_args.retrieve"):
        create_method("retrieve", _config(pool_protocol, "method_args.retrieve.greedy=lazy"))
    with pytest.raises(ConfigError, match="method_args.csl.freeze"):
        create_method("csl", _config(pool_protocol, "method_args.csl.freeze=all"))
    with pytest.raises(ConfigError, match="method_args.mdil.nope"):
        create_method("mdil", _config(pool_protocol, "method_args.mdil.nope=1"))
