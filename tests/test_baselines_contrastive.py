"""Contrastive baselines: SupCL, UnSupCL, UnSupCL-HNM (hand-computed losses, then each plugin on the toy protocol,
its loss term recomputed from the step's own tensors)."""

import math

import pytest
import torch
import torch.nn.functional as F

from jascl.engine.loop import ContinualTrainer
from jascl.engine.prototypes import PrototypeStore, align_labels
from jascl.errors import ConfigError
from jascl.methods import Method, Plugin
from jascl.methods.baselines.contrastive._shared import pixel_vectors, sample_per_class, sample_uniform, step_generator
from jascl.methods.baselines.contrastive.supcl import SupCLOptions, SupCLPlugin, supcon_loss
from jascl.methods.baselines.contrastive.unsupcl import UnSupCLOptions, UnSupCLPlugin, hard_negative_loss, nt_xent_loss
from jascl.methods.registry import create_method

E1, E2 = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
e = math.e


# ----------------------------------------------------------------------------- SupCon


def test_supcon_loss_by_hand():
    # z = [e1, e1, e2, -e2], labels [0, 0, 1, 1], tau = 1.
    # anchor 0: positive 1 (s = 1), others s = 0, 0: -log(e / (e + 2)); anchor 1 the same.
    # anchor 2: positive 3 (s = -1), others 0, 0: -log(e^-1 / (e^-1 + 2)); anchor 3 the same.
    # mean = (log(e + 2) - 1 + log(1/e + 2) + 1) / 2 = (log(e + 2) + log(1/e + 2)) / 2 = 1.2067198
    z = torch.stack([E1, E1, E2, -E2])
    loss = supcon_loss(z, torch.tensor([0, 0, 1, 1]), temperature=1.0)
    assert loss.item() == pytest.approx((math.log(e + 2) + math.log(1 / e + 2)) / 2, rel=1e-6)
    assert loss.item() == pytest.approx(1.2067198, rel=1e-6)


def test_supcon_averages_over_positives_and_skips_anchors_without_one():
    # labels [0, 0, 0, 1]: anchor 3 has no positive and is left out.
    # anchor 0 = e1 with positives e1 (s=1) and e2 (s=0), other -e1 (s=-1); tau = 1; denominator e + 1 + 1/e:
    # -(1/2) [(1 - log D) + (0 - log D)] = log D - 1/2
    z = torch.stack([E1, E1, E2, -E1])
    per = []
    for i in range(3):
        s = z @ z[i]
        den = sum(math.exp(float(s[k])) for k in range(4) if k != i)
        pos = [k for k in range(3) if k != i]
        per.append(-sum(float(s[k]) - math.log(den) for k in pos) / len(pos))
    d = e + 1 + 1 / e
    assert per[0] == pytest.approx(math.log(d) - 0.5)
    loss = supcon_loss(z, torch.tensor([0, 0, 0, 1]), temperature=1.0)
    assert loss.item() == pytest.approx(sum(per) / 3, rel=1e-6)


def test_supcon_without_positives_is_zero_with_a_gradient_path():
    z = F.normalize(torch.randn(3, 4), dim=1).requires_grad_(True)
    loss = supcon_loss(z, torch.tensor([0, 1, 2]))
    assert loss.item() == 0.0
    loss.backward()
    assert z.grad is not None


def test_supcon_temperature_sharpens_identically_to_scaling_similarities():
    z = F.normalize(torch.randn(6, 3, generator=torch.Generator().manual_seed(0)), dim=1)
    labels = torch.tensor([0, 0, 1, 1, 2, 2])
    # tau = 0.5 on z equals tau = 1 on sqrt(2) z (the similarities are doubled either way)
    assert supcon_loss(z, labels, 0.5).item() == pytest.approx(supcon_loss(z * math.sqrt(2), labels, 1.0).item())


# ----------------------------------------------------------------------------- NT-Xent and hard negatives


def test_nt_xent_by_hand():
    # views z1 = z2 = [e1, e2], tau = 1: anchor 0 has positive s=1, others s=0 (e2) and 0 (e2): log(e + 2) - 1
    z = torch.stack([E1, E2])
    assert nt_xent_loss(z, z, temperature=1.0).item() == pytest.approx(math.log(e + 2) - 1, rel=1e-6)
    # z1 = [e1, e1], z2 = [e1, e2]: anchor 0 positive s=1, negatives s=1 (z1[1]) and 0 (z2[1]): log(2e + 1) - 1
    per = nt_xent_loss(torch.stack([E1, E1]), torch.stack([E1, E2]), temperature=1.0, reduction="none")
    assert per.shape == (4,)
    assert per[0].item() == pytest.approx(math.log(2 * e + 1) - 1, rel=1e-6)  # 0.8619948


def test_hard_negatives_upweight_the_similar_negative_by_hand():
    # anchor 0 of z1 = [e1, e1], z2 = [e1, e2]; tau = 1; positive s+ = 1; negatives s = 1, 0; Q = 2.
    # beta = 1: w = 2 e^s / (e + 1) -> sum w e^s = 2 (e^2 + 1) / (e + 1) = 4.5123293 (plain sum: e + 1 = 3.718)
    z1, z2 = torch.stack([E1, E1]), torch.stack([E1, E2])
    ng = 2 * (e * e + 1) / (e + 1)
    per = hard_negative_loss(z1, z2, temperature=1.0, beta=1.0, tau_plus=0.0, reduction="none")
    assert per[0].item() == pytest.approx(math.log(e + ng) - 1, rel=1e-6)  # 0.9783236
    assert per[0].item() == pytest.approx(0.9783236, rel=1e-6)
    # debiasing with tau+ = 0.1: Ng = (4.5123293 - 0.1 * 2 * e) / 0.9 = 4.4096366
    per = hard_negative_loss(z1, z2, temperature=1.0, beta=1.0, tau_plus=0.1, reduction="none")
    assert per[0].item() == pytest.approx(math.log(e + (ng - 0.2 * e) / 0.9) - 1, rel=1e-6)  # 0.9640193
    # tau+ = 0.9 drives the estimate below its floor Q e^(-1/tau) = 2/e
    per = hard_negative_loss(z1, z2, temperature=1.0, beta=1.0, tau_plus=0.9, reduction="none")
    assert per[0].item() == pytest.approx(math.log(e + 2 / e) - 1, rel=1e-6)  # 0.2395448


def test_hard_negative_loss_without_reweighting_or_debiasing_is_nt_xent():
    g = torch.Generator().manual_seed(1)
    z1, z2 = (F.normalize(torch.randn(5, 8, generator=g), dim=1) for _ in range(2))
    for tau in (0.1, 0.5):
        plain = nt_xent_loss(z1, z2, tau, reduction="none")
        hnm = hard_negative_loss(z1, z2, tau, beta=0.0, tau_plus=0.0, reduction="none")
        assert torch.allclose(plain, hnm, atol=1e-5)
    # beta > 0 weights hard negatives up: the loss can only grow (weighted mean >= plain mean when weights rise with e^s)
    assert hard_negative_loss(z1, z2, 0.5, beta=1.0, tau_plus=0.0) >= nt_xent_loss(z1, z2, 0.5)


# ----------------------------------------------------------------------------- sampling


def test_sample_per_class_takes_at_most_k_of_each_class_and_never_ignored_pixels():
    labels = torch.tensor([0, 0, 0, 0, 1, 1, 255, 2, 2, 2])
    idx = sample_per_class(labels, 2, torch.Generator().manual_seed(0))
    drawn = labels[idx].tolist()
    assert drawn.count(0) == 2 and drawn.count(1) == 2 and drawn.count(2) == 2 and 255 not in drawn
    assert len(set(idx.tolist())) == 6
    assert sample_per_class(torch.full((4,), 255), 2, torch.Generator()).numel() == 0


def test_pixel_vectors_and_uniform_sampling_in_3d():
    f = torch.arange(2 * 3 * 2 * 2 * 2, dtype=torch.float).reshape(2, 3, 2, 2, 2)  # (B, C, D, H, W)
    v = pixel_vectors(f)
    assert v.shape == (16, 3)
    assert v[9].tolist() == f[1, :, 0, 0, 1].tolist()  # pixel 9 = batch 1, position 1
    idx = sample_uniform(16, 40, torch.Generator().manual_seed(0), torch.device("cpu"))
    assert sorted(idx.tolist()) == list(range(16))  # all of them when fewer than asked


def test_bad_options_are_one_line_errors():
    with pytest.raises(ConfigError, match=r"method_args\.supcl\.pixels_per_class"):
        SupCLPlugin(SupCLOptions(pixels_per_class=1))
    with pytest.raises(ConfigError, match=r"method_args\.unsupcl-hnm\.tau_plus"):
        UnSupCLPlugin(UnSupCLOptions(tau_plus=1.0), hard_negatives=True)


# ----------------------------------------------------------------------------- end to end


class Recompute(Plugin):
    """After the contrastive plugin, recomputes its term from the step's features, labels and head."""

    name = "recompute"

    def __init__(self, plugin, fn):
        self.plugin, self.fn, self.pairs, self.heads = plugin, fn, [], []

    def after_forward(self, state):
        if state.session.index == 0:
            assert self.plugin.name not in state.losses
            return
        with torch.no_grad():
            self.pairs.append((state.losses[self.plugin.name].item(), self.fn(self.plugin, state).item()))
        self.heads.append([p.detach().clone() for p in self.plugin.head.parameters()])


def _supcl_again(plugin, state):
    f = state.output.features
    rows = align_labels(state.target, f.shape[2:]).reshape(-1)
    idx = sample_per_class(rows, plugin.options.pixels_per_class, step_generator(state, "supcl"))
    assert len(set(rows[idx].tolist())) >= 2  # background and at least one taught class in every batch
    return plugin.options.weight * supcon_loss(plugin.project(pixel_vectors(f)[idx]), rows[idx], 0.1)


def _hnm_again(plugin, state):
    f1 = state.output.features
    f2 = state.model.forward_features(plugin.second_view(state)).features
    assert not torch.equal(f1, f2)  # the photometric view changes the features
    idx = sample_uniform(f1.numel() // f1.shape[1], 256, step_generator(state, "unsupcl-hnm"), f1.device)
    z1, z2 = plugin.project(pixel_vectors(f1)[idx]), plugin.project(pixel_vectors(f2)[idx])
    return 0.1 * hard_negative_loss(z1, z2, 0.5, 1.0, 0.1)


@pytest.mark.parametrize("name,again", [("supcl", _supcl_again), ("unsupcl-hnm", _hnm_again)])
def test_the_loss_term_is_the_pure_loss_of_the_step_and_the_head_trains(
    name, again, toy_protocol, toy_config, tmp_path
):
    from jascl.data.synthetic import load_or_generate

    method = create_method(name, toy_config)
    plugin = method.plugins[0]
    probe = Recompute(plugin, again)
    data = load_or_generate(toy_protocol, tmp_path / "cache")
    trainer = ContinualTrainer(toy_protocol, toy_config, Method(name, [plugin, probe]), data, progress=False)
    model, store = trainer.new_model(3), PrototypeStore()
    trainer.run_session(0, model, store, tmp_path / "s0")
    before = {k: v.clone() for k, v in model.backbone.state_dict().items()}
    trainer.run_session(1, model, store, tmp_path / "s1")
    assert len(probe.pairs) == 2  # 2 shots x 2 classes -> one batch of 4 per epoch, 2 epochs
    for logged, recomputed in probe.pairs:
        assert logged == pytest.approx(recomputed, rel=1e-5) and logged > 0
    # the head is trained by the run's optimiser: its weights moved between the two steps
    assert any(not torch.equal(a, b) for a, b in zip(*probe.heads))
    # freeze: none -> the backbone trains too
    assert any(not torch.equal(before[k], v) for k, v in model.backbone.state_dict().items() if v.is_floating_point())
    assert plugin.head is None  # dropped after the session, as SimCLR drops g
