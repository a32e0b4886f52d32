"""C-FSCIL (Hersche et al., CVPR 2022): pure functions with hand-computed values, then the method end to end on
the toy two-session protocol."""

import math

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from jascl.engine.config import resolve_config
from jascl.engine.loop import ContinualTrainer
from jascl.engine.prototypes import PrototypeStore, align_labels
from jascl.errors import ConfigError
from jascl.methods import Method, Plugin
from jascl.methods.baselines.fewshot._hyperdimensional import (
    attention_loss,
    bundle,
    cosine_similarity,
    episode_loss,
    nudge_prototypes,
    nudging_loss,
    project,
    retrain_loss,
    sharpen,
    softabs,
)
from jascl.methods.baselines.fewshot.cfscil import NO_CLASS_SCORE, CFSCILHead, CFSCILOptions, CFSCILPlugin, align
from jascl.methods.registry import create_method


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


# ----------------------------------------------------------------------------- similarity and sharpening


def test_softabs_hand_values_and_symmetry():
    x = torch.tensor([0.5, 0.0, -1.0, 1.0])
    expected = [
        sigmoid(0.0) + sigmoid(-10.0),  # 0.5: sigma(10 * 0) + sigma(10 * (-1))
        2 * sigmoid(-5.0),  # 0: sigma(-5) + sigma(-5) = 0.013386
        sigmoid(-15.0) + sigmoid(5.0),  # -1: sigma(10 * (-1.5)) + sigma(10 * 0.5) = 0.993307
        sigmoid(5.0) + sigmoid(-15.0),
    ]
    assert softabs(x).tolist() == pytest.approx(expected, rel=1e-6)
    assert sharpen(torch.tensor([-0.3]), "abs").item() == pytest.approx(0.3)
    assert softabs(torch.tensor([0.2]), steepness=2.0).item() == pytest.approx(sigmoid(-0.6) + sigmoid(-1.4))


def test_cosine_similarity_real_and_tanh_representations():
    # real: [3, 4] . [1, 0] / 5 = 0.6, [3, 4] . [0, 2] / 10 = 0.8
    sim = cosine_similarity(torch.tensor([[3.0, 4.0]]), torch.tensor([[1.0, 0.0], [0.0, 2.0]]), "real")
    assert sim[0].tolist() == pytest.approx([0.6, 0.8])
    # [1, 1] vs [10, 1]: real 11 / (sqrt 2 sqrt 101) = 0.77395; tanh: [t1, t1] vs [~1, t1] with t1 = tanh 1
    q, p = torch.tensor([[1.0, 1.0]]), torch.tensor([[10.0, 1.0]])
    t1, t10 = math.tanh(1.0), math.tanh(10.0)
    tanh_cos = (t1 * t10 + t1 * t1) / (math.sqrt(2) * t1 * math.sqrt(t10**2 + t1**2))  # = 0.99097
    assert cosine_similarity(q, p, "real").item() == pytest.approx(11 / math.sqrt(2 * 101), rel=1e-5)
    assert cosine_similarity(q, p, "tanh").item() == pytest.approx(tanh_cos, rel=1e-5)


def test_bundle_is_the_per_class_mean_and_zero_for_an_empty_class():
    acts = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]])
    labels = torch.tensor([0, 1, 0, 5])
    # class 0: ([1, 2] + [5, 6]) / 2 = [3, 4]; class 1: [3, 4] alone; class 2: no pixel -> zeros
    out = bundle(acts, labels, torch.tensor([0, 1, 2]))
    assert out.tolist() == [[3.0, 4.0], [3.0, 4.0], [0.0, 0.0]]


def test_attention_loss_hand_values():
    sim = torch.tensor([[0.6, 0.8]])
    # abs: w = [0.6, 0.8] / 1.4 = [3/7, 4/7]; target 0: (-log(3/7) - log(1 - 4/7)) / 2 = -log(3/7) = 0.847298
    assert attention_loss(sim, torch.tensor([0]), "abs").item() == pytest.approx(-math.log(3 / 7), rel=1e-5)
    # target 1: (-log(1 - 3/7) - log(4/7)) / 2 = -log(4/7) = 0.559616
    assert attention_loss(sim, torch.tensor([1]), "abs").item() == pytest.approx(-math.log(4 / 7), rel=1e-5)
    # softabs: s(1) = sigma(5) + sigma(-15), s(0) = 2 sigma(-5); w0 = s(1) / (s(1) + s(0)); loss = -log(w0) = 0.013386
    s1, s0 = sigmoid(5.0) + sigmoid(-15.0), 2 * sigmoid(-5.0)
    expected = -math.log(s1 / (s1 + s0))
    assert attention_loss(torch.tensor([[1.0, 0.0]]), torch.tensor([0]), "softabs").item() == pytest.approx(
        expected, rel=1e-4
    )
    # a perfect match under abs: w = [1, 0] -> every log term is log 1 = 0
    assert attention_loss(torch.tensor([[0.0, -1.0]]), torch.tensor([1]), "abs").item() == 0.0
    assert attention_loss(torch.zeros(0, 3), torch.zeros(0, dtype=torch.long)).item() == 0.0


def test_balanced_attention_loss_weighs_classes_not_queries():
    # two class-0 queries with sims [0.6, 0.8] (each -log(3/7) under abs) and one perfect class-1 query (0)
    sim = torch.tensor([[0.6, 0.8], [0.6, 0.8], [0.0, 1.0]])
    target = torch.tensor([0, 0, 1])
    # per query: 2 (-log 3/7) + 0 over 3 queries = 0.564865; per class: (-log 3/7 + 0) / 2 = 0.423649
    assert attention_loss(sim, target, "abs").item() == pytest.approx(-2 * math.log(3 / 7) / 3, rel=1e-5)
    assert attention_loss(sim, target, "abs", balanced=True).item() == pytest.approx(-math.log(3 / 7) / 2, rel=1e-5)
    # with one query per class the two agree
    assert attention_loss(sim[1:], target[1:], "abs", balanced=True).item() == pytest.approx(
        attention_loss(sim[1:], target[1:], "abs").item()
    )


def _episode_batch(spatial_dims: int):
    # support (sample 0): class 0 at [1, 0], class 1 at [0, 1], an ignored pixel at [9, 9]
    # query (sample 1): class 0 at [0.6, 0.8], class 1 at [0, 1], class 2 (absent from the support) at [5, 5]
    acts = torch.tensor(
        [[[1.0, 0.0, 9.0], [0.0, 1.0, 9.0]], [[0.6, 0.0, 5.0], [0.8, 1.0, 5.0]]]
    )  # (B=2, d=2, 3 pixels)
    rows = torch.tensor([[0, 1, 255], [0, 1, 2]])
    shape = (1,) * (spatial_dims - 1)
    return acts.reshape(2, 2, *shape, 3).clone().requires_grad_(True), rows.reshape(2, *shape, 3)


@pytest.mark.parametrize("spatial_dims", [2, 3])
def test_episode_loss_bundles_the_support_and_scores_the_query(spatial_dims):
    acts, rows = _episode_batch(spatial_dims)
    loss = episode_loss(acts, rows, "real", "abs")
    # prototypes [1, 0] and [0, 1]; query pixel A: sims [0.6, 0.8], target 0 -> two entries of -log(3/7);
    # pixel B: sims [0, 1], target 1 -> two zero entries; class-2 pixel left out: mean = 2 (-log 3/7) / 4 = 0.423649
    assert loss.item() == pytest.approx(-2 * math.log(3 / 7) / 4, rel=1e-5)
    loss.backward()
    assert torch.count_nonzero(acts.grad[0]) == 0  # support activations are detached
    assert torch.count_nonzero(acts.grad[1]) > 0


def test_episode_loss_edge_cases():
    acts, rows = _episode_batch(2)
    one_class = rows.clone()
    one_class[0] = 0  # the support shows the background only
    zero = episode_loss(acts, one_class, "real", "abs")
    assert zero.item() == 0.0 and zero.requires_grad
    # a batch of one sample is its own support and query: prototypes = its pixels -> a perfect match
    single = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]]).reshape(1, 2, 1, 2)
    assert episode_loss(single, torch.tensor([[[0, 1]]]), "real", "abs").item() == 0.0


# ----------------------------------------------------------------------------- nudging and retraining


def test_nudging_loss_hand_values():
    e = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    total, orth, dev = nudging_loss(e, e)
    assert (total.item(), orth.item(), dev.item()) == (0.0, 0.0, 0.0)  # orthogonal: e^0 + e^0 - 2 = 0
    same = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    # pairs (0,1): cos 1 -> e^4 + e^-4 - 2 = 52.616; (0,2), (1,2): 0 -> mean 52.616 / 3
    _, orth, _ = nudging_loss(same, same)
    assert orth.item() == pytest.approx((math.exp(4) + math.exp(-4) - 2) / 3, rel=1e-5)
    _, orth_exp, _ = nudging_loss(same, same, activation="exp")
    assert orth_exp.item() == pytest.approx((math.exp(4) - 1) / 3, rel=1e-5)
    # masking the (0, 1) pair (entries of one class) leaves only orthogonal pairs
    mask = torch.tensor([0, 0, 1])[:, None] != torch.tensor([0, 0, 1])[None, :]
    assert nudging_loss(same, same, mask)[1].item() == 0.0
    # deviation: tanh[1, 1] vs tanh[1, 0]: cos = 1 / sqrt 2 -> 1 - 0.70711
    _, _, dev = nudging_loss(torch.tensor([[1.0, 1.0]]), torch.tensor([[1.0, 0.0]]))
    assert dev.item() == pytest.approx(1 - 1 / math.sqrt(2), rel=1e-5)


def test_nudging_makes_different_classes_quasi_orthogonal_and_leaves_one_class_alone():
    torch.manual_seed(0)
    protos = 0.5 * (torch.randn(1, 16) + 0.6 * torch.randn(3, 16))  # three correlated prototypes

    def mean_abs_cos(p):
        u = torch.nn.functional.normalize(torch.tanh(p), dim=1)
        return (u @ u.t())[torch.ones(3, 3, dtype=torch.bool).triu(1)].abs().mean().item()

    assert mean_abs_cos(protos) > 0.6
    nudged = nudge_prototypes(protos, torch.tensor([1, 2, 3]), iterations=100)
    assert mean_abs_cos(nudged) < 0.1  # quasi-orthogonal after 100 official nudging steps
    assert nudging_loss(nudged, protos)[2].item() < 0.75  # each stays within cos > 0.25 of where it started
    # one class: only the deviation term, zero (with zero gradient) at the start -> nothing moves
    assert torch.allclose(nudge_prototypes(protos, torch.tensor([1, 1, 1]), iterations=20), protos, atol=1e-6)
    assert torch.equal(nudge_prototypes(protos, None, iterations=0), protos)


def test_retrain_loss_hand_values():
    a = torch.tensor([[3.0, 4.0], [0.0, 1.0]])
    b = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    # real: -(0.6 + 1) / 2 = -0.8
    assert retrain_loss(a, b, "real").item() == pytest.approx(-0.8)
    assert retrain_loss(a, a).item() == pytest.approx(-1.0)


@pytest.mark.parametrize("mode", [1, 2, 3])
def test_align_retrains_the_fcl_by_mode_and_returns_the_refilled_memory(mode):
    torch.manual_seed(0)
    fcl = nn.Linear(3, 16)
    original = {k: v.clone() for k, v in fcl.state_dict().items()}
    gaam = torch.randn(4, 3)
    classes = torch.tensor([0, 1, 2, 1])
    options = CFSCILOptions(mode=mode)
    nudging, retrain, bipolarize = options.schedule()
    assert (nudging, retrain, bipolarize) == {1: (0, 0, False), 2: (0, 10, True), 3: (100, 50, False)}[mode]
    targets = torch.sign(fcl(gaam)).detach()
    before = retrain_loss(fcl(gaam), targets).item()
    memory = align(fcl, gaam, classes, nudging, retrain, bipolarize, options)
    assert torch.allclose(memory, fcl(gaam))  # the memory is refilled with FCL(GAAM) after retraining
    changed = any(not torch.equal(original[k], v) for k, v in fcl.state_dict().items())
    assert changed == (mode > 1)
    if mode == 2:  # retrained towards the bipolarised prototypes
        assert retrain_loss(fcl(gaam), targets).item() < before
    assert not any(p.requires_grad for p in fcl.parameters())


# ----------------------------------------------------------------------------- head and options


@pytest.mark.parametrize("shape", [(1, 2), (1, 2, 1, 1), (1, 2, 1, 1, 1)])
def test_head_scores_each_class_by_its_best_entry(shape):
    fcl = nn.Linear(2, 2)
    with torch.no_grad():
        fcl.weight.copy_(torch.eye(2))
        fcl.bias.zero_()
    protos = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.1]])
    head = CFSCILHead(fcl, protos, torch.tensor([0, 1, 1]), 3, "real", "abs")
    out = head(torch.tensor([1.0, 0.0]).reshape(shape)).reshape(3)
    # |cos| to the entries: 1, 0, 1 / sqrt(1.01) = 0.995037; row 1 takes its best entry; row 2 has none
    assert out[:2].tolist() == pytest.approx([1.0, 1 / math.sqrt(1.01)], rel=1e-5)
    assert out[2].item() == pytest.approx(NO_CLASS_SCORE)
    assert project(fcl, torch.ones(shape)).shape == shape  # per pixel, 2D and 3D


@pytest.mark.parametrize(
    "override,match",
    [
        ("method_args.c-fscil.mode=4", "method_args.c-fscil.mode: must be one of 1, 2, 3"),
        ("method_args.c-fscil.pretrain_fraction=2", r"method_args.c-fscil.pretrain_fraction: must be >= 0 and <= 1"),
        ("method_args.c-fscil.retrain_iter=-1", "method_args.c-fscil.retrain_iter: must be >= 0"),
        ("method_args.c-fscil.representation=bipolar", "method_args.c-fscil.representation: must be one of tanh"),
    ],
)
def test_bad_options_are_one_line_config_errors(override, match):
    with pytest.raises(ConfigError, match=match):
        create_method("c-fscil", resolve_config(overrides=[override]))


def test_explicit_iterations_override_the_mode():
    assert CFSCILOptions(mode=3, nudging_iter=5, retrain_iter=0).schedule() == (5, 0, False)


# ----------------------------------------------------------------------------- end to end


class Snap(Plugin):
    """After C-FSCIL's after_forward: the loss terms per session and the meta term recomputed by the pure function."""

    name = "snap"

    def __init__(self, cfscil):
        self.cfscil = cfscil
        self.terms: dict[int, set] = {}
        self.meta_pairs: list[tuple[float, float]] = []

    def after_forward(self, state):
        self.terms.setdefault(state.session.index, set()).update(state.losses)
        if "cfscil_meta" in state.losses:
            features = state.output.features
            rows = align_labels(state.target, features.shape[2:])
            expected = episode_loss(project(self.cfscil.projection, features).float(), rows)
            self.meta_pairs.append((float(state.losses["cfscil_meta"].detach()), float(expected.detach())))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from conftest import toy_protocol_dict
    from jascl.data.synthetic import load_or_generate
    from jascl.protocols import parse_protocol

    protocol = parse_protocol(toy_protocol_dict(2), source="toy-2d.yaml")
    config = resolve_config(protocol.training, "toy-2d.yaml")
    root = tmp_path_factory.mktemp("cfscil")
    data = load_or_generate(protocol, root / "cache")
    cfscil = CFSCILPlugin()
    snap = Snap(cfscil)
    trainer = ContinualTrainer(protocol, config, Method("c-fscil", [cfscil, snap]), data, progress=False)
    model, store = trainer.new_model(3), PrototypeStore()
    records = [trainer.run_session(0, model, store, root / "s0"), trainer.run_session(1, model, store, root / "s1")]
    return protocol, config, data, root, cfscil, snap, records


def test_base_session_meta_learns_and_incremental_sessions_train_nothing(trained):
    protocol, config, data, root, cfscil, snap, records = trained
    # one base epoch with pretrain_fraction 0.5: meta-learning from epoch 0; DiceCE only in session 1 (lr 0)
    assert snap.terms == {0: {"cfscil_meta"}, 1: {"seg"}}
    assert snap.meta_pairs and all(v == pytest.approx(e, rel=1e-5) for v, e in snap.meta_pairs)
    assert any(v > 0 for v, _ in snap.meta_pairs)
    s0, s1 = load_file(root / "s0" / "model.safetensors"), load_file(root / "s1" / "model.safetensors")
    assert all(torch.equal(s0[k], s1[k]) for k in s0 if k != "classifier.weight")  # frozen backbone
    assert torch.equal(s1["classifier.weight"][:3], s0["classifier.weight"])
    assert not any("projection" in k or "prototypes" in k for k in s1)  # the head was swapped back
    assert all(0.0 <= r["all"] <= 1.0 for r in records)


def test_memory_holds_one_entry_per_session_and_class_and_is_fcl_of_gaam(trained):
    protocol, config, data, root, cfscil, snap, records = trained
    e0, e1 = load_file(root / "s0" / "plugins.safetensors"), load_file(root / "s1" / "plugins.safetensors")
    keys = sorted(k for k in e1 if k.startswith("0.cfscil.memory."))
    assert keys == sorted(f"0.cfscil.memory.s{s}.c{c}" for s, c in [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 3)])
    assert e1["0.cfscil.fcl.weight"].shape == (512, 8)  # d = 512 from the 8 toy feature channels
    fcl = nn.Linear(8, 512)
    fcl.load_state_dict({"weight": e1["0.cfscil.fcl.weight"], "bias": e1["0.cfscil.fcl.bias"]})
    with torch.no_grad():
        refilled = fcl(e1["0.cfscil.gaam.s1.c3"])
    assert torch.allclose(e1["0.cfscil.memory.s1.c3"], refilled, atol=1e-5)
    # mode 3 retrains the FCL in session 1 (nudged targets), so it differs from the base session's
    assert not torch.equal(e0["0.cfscil.fcl.weight"], e1["0.cfscil.fcl.weight"])
    assert torch.equal(e0["0.cfscil.gaam.s0.c2"], e1["0.cfscil.gaam.s0.c2"])  # the frozen FE's GAAM is kept


def test_session_1_prediction_is_the_cfscil_head(trained):
    """Re-evaluating the saved session-1 model with the head built from the saved state gives the record."""
    from jascl.engine.checkpoint import load_tensors
    from jascl.evaluation.evaluator import evaluate

    protocol, config, data, root, cfscil, snap, records = trained
    method = create_method("c-fscil", config)
    trainer = ContinualTrainer(protocol, config, method, data, progress=False)
    model, store, record = trainer.load_session(root / "s1", 1)
    method.load_extra_state(load_tensors(root / "s1" / "plugins.safetensors"))
    state = trainer.loop_state(1, model, store)
    model.classifier = method.plugins[0].head(state)
    result = evaluate(
        model, [d.test for d in data[:2]], state.seen, trainer.device, roi=config.patch_size, batch_size=4
    )
    assert {str(k): v for k, v in result.dice.items()} == pytest.approx(record["dice"], nan_ok=True)
