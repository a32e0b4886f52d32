"""Meta-learning baselines: MAML, MAML + regulariser, MTL (pure functions with hand-computed values, then each
method end to end on the toy two-session protocol)."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from jascl.engine.config import resolve_config
from jascl.engine.losses import SegmentationLoss
from jascl.errors import ConfigError
from jascl.experiments.runner import run_benchmark
from jascl.methods import Plugin
from jascl.methods.baselines.meta.maml import condition_number, first_order_adapt, support_query_split
from jascl.methods.baselines.meta.mtl import combine_task_losses, prototype_task_losses, task_row_mask, task_target
from jascl.methods.registry import create_method

MINE = ("maml", "maml-reg", "mtl")


# ----------------------------------------------------------------------------- MAML


@pytest.mark.parametrize(
    "batch,fraction,support,query",
    [
        (4, 0.5, [0, 1], [2, 3]),
        (2, 0.5, [0], [1]),
        (5, 0.5, [0, 1], [2, 3, 4]),  # round(2.5) = 2 (round half to even)
        (3, 0.9, [0, 1], [2]),  # round(2.7) = 3, clamped to B - 1 = 2: the query keeps one image
        (3, 0.1, [0], [1, 2]),  # round(0.3) = 0, clamped to 1: the support keeps one image
        (1, 0.5, [0], [0]),  # one image: a degenerate episode, support = query
    ],
)
def test_support_query_split(batch, fraction, support, query):
    s, q = support_query_split(batch, fraction)
    assert s.tolist() == support and q.tolist() == query


def test_support_query_split_refuses_an_empty_batch():
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        support_query_split(0)


def _mse(w, x, y):
    return ((w * x - y) ** 2).sum()


def test_first_order_maml_step_on_a_scalar_linear_model_hand_values():
    # f(x) = w x, L(w) = (w x - y)^2, w = 1; support (x=2, y=0), query (x=1, y=1), alpha = 0.1
    w = torch.tensor(1.0, requires_grad=True)
    # inner: dL_s/dw = 2 (w x - y) x = 2 * 2 * 2 = 8 -> w' = 1 - 0.1 * 8 = 0.2
    adapted = first_order_adapt(lambda p: _mse(p["w"], 2.0, 0.0), {"w": w}, inner_lr=0.1, steps=1)
    assert adapted["w"].item() == pytest.approx(0.2)
    assert w.item() == 1.0  # the model's own weight is untouched
    # outer: L_q(w') = (0.2 - 1)^2 = 0.64; first order: dL_q/dw := dL_q/dw' = 2 (0.2 - 1) = -1.6
    # (second-order MAML would give -1.6 * (1 - alpha * 2 x_s^2) = -1.6 * 0.2 = -0.32)
    query = _mse(adapted["w"], 1.0, 1.0)
    assert query.item() == pytest.approx(0.64)
    query.backward()
    assert w.grad.item() == pytest.approx(-1.6)


def test_first_order_maml_two_inner_steps_and_passthrough_of_frozen_tensors():
    # step 1: w 1 -> 0.2 (as above); step 2: dL_s/dw = 2 (0.2 * 2) 2 = 1.6 -> w'' = 0.2 - 0.16 = 0.04
    w = torch.tensor(1.0, requires_grad=True)
    b = torch.tensor(5.0)  # not trainable: passed through unchanged
    adapted = first_order_adapt(lambda p: _mse(p["w"], 2.0, 0.0) + 0 * p["b"], {"w": w, "b": b}, 0.1, 2)
    assert adapted["w"].item() == pytest.approx(0.04)
    assert adapted["b"] is b
    _mse(adapted["w"], 1.0, 1.0).backward()  # dL_q/dw'' = 2 (0.04 - 1) = -1.92
    assert w.grad.item() == pytest.approx(-1.92)


def test_first_order_adapt_on_a_3d_conv_through_functional_call_is_plain_sgd():
    torch.manual_seed(0)
    conv = torch.nn.Conv3d(2, 3, 1)
    x = torch.randn(2, 2, 2, 3, 2)
    y = torch.randint(0, 3, (2, 2, 3, 2))
    params = dict(conv.named_parameters())

    def loss(p):
        return F.cross_entropy(functional_call(conv, p, (x,)), y)

    adapted = first_order_adapt(loss, params, inner_lr=0.5, steps=1)
    grads = torch.autograd.grad(loss(params), list(params.values()))
    for (name, p), g in zip(params.items(), grads):
        torch.testing.assert_close(adapted[name], p - 0.5 * g)


def test_condition_number_hand_values_and_gradient_on_2x2():
    # W = diag(3, 1): sigma = (3, 1), kappa = 3; d sigma_i / dW = u_i v_i^T = e_i e_i^T, so
    # d kappa / dW = e1 e1^T / sigma_2 - sigma_1 / sigma_2^2 e2 e2^T = [[1, 0], [0, -3]]
    w = torch.tensor([[3.0, 0.0], [0.0, 1.0]], requires_grad=True)
    kappa = condition_number(w, normalize=False)
    assert kappa.item() == pytest.approx(3.0)
    kappa.backward()
    torch.testing.assert_close(w.grad, torch.tensor([[1.0, 0.0], [0.0, -3.0]]))
    # normalised rows of diag(3, 1) are the identity: kappa = 1
    assert condition_number(w.detach(), normalize=True).item() == pytest.approx(1.0)
    # W = [[1, 0], [1, 1]], rows normalised: [[1, 0], [s, s]], s = 1/sqrt2; W W^T = [[1, s], [s, 1]],
    # eigenvalues 1 +- s, kappa = sqrt((1 + s) / (1 - s)) = sqrt((sqrt2 + 1) / (sqrt2 - 1)) = 1 + sqrt2
    assert condition_number(torch.tensor([[1.0, 0.0], [1.0, 1.0]])).item() == pytest.approx(1 + math.sqrt(2))


def test_condition_number_more_rows_than_channels_and_rank_deficiency():
    # (K=3, C=2): the min(K, C) = 2 singular values of [[1, 0], [0, 2], [0, 0]] are (2, 1)
    assert condition_number(torch.tensor([[1.0, 0.0], [0.0, 2.0], [0.0, 0.0]]), normalize=False).item() == 2.0
    # rank one: sigma = (2, 0): finite (sigma_min clamped to eps), large
    value = condition_number(torch.ones(2, 2), normalize=False, eps=1e-6).item()
    assert math.isfinite(value) and value == pytest.approx(2e6, rel=1e-3)


# ----------------------------------------------------------------------------- MTL


def test_task_row_mask_and_task_target_2d_and_3d():
    mask = task_row_mask([[0, 1, 2], [0, 3, 1]], 4)
    assert mask.tolist() == [[True, True, True, False], [True, True, False, True]]
    # head [0, 3, 1]: row 0 -> 0, row 3 -> 1, row 1 -> 2; row 2 (not in the head) and 255 -> 255
    target = torch.tensor([[[0, 3], [1, 255]], [[2, 1], [3, 0]]])
    expected = torch.tensor([[[0, 1], [2, 255]], [[255, 2], [1, 0]]])
    assert torch.equal(task_target(target, [0, 3, 1], 4), expected)
    volume = target.unsqueeze(1).expand(2, 2, 2, 2)  # (B, D, H, W)
    assert torch.equal(task_target(volume, [0, 3, 1], 4), expected.unsqueeze(1).expand(2, 2, 2, 2))


def test_prototype_task_losses_hand_values_and_masked_rows_get_no_gradient():
    # task 0 = rows {0, 1}, task 1 = rows {0, 2}, task 2 = rows {0, 1, 2} (no prototype)
    mask = task_row_mask([[0, 1], [0, 2], [0, 1, 2]], 3)
    logits = torch.tensor(
        [
            [0.0, 0.0, 100.0],  # task 0, target row 1: softmax over (0, 0) -> CE = ln 2 (row 2 masked)
            [math.log(3.0), 0.0, 5.0],  # task 0, target row 0: softmax over (ln 3, 0): p = 3/4 -> ln(4/3)
            [0.0, 7.0, math.log(4.0)],  # task 1, target row 2: softmax over (0, ln 4): p = 4/5 -> ln(5/4)
        ],
        requires_grad=True,
    )
    losses = prototype_task_losses(logits, torch.tensor([1, 0, 2]), torch.tensor([0, 0, 1]), mask)
    expected = torch.tensor([(math.log(2.0) + math.log(4.0 / 3.0)) / 2, math.log(5.0 / 4.0), 0.0])
    torch.testing.assert_close(losses, expected)
    losses.sum().backward()
    assert logits.grad[0, 2] == 0 and logits.grad[1, 2] == 0 and logits.grad[2, 1] == 0
    # d CE / d logit of the target row = p - 1: proto 2 -> (4/5 - 1) = -0.2
    assert logits.grad[2, 2].item() == pytest.approx(-0.2)


def test_combine_task_losses_is_the_uniform_task_average():
    # T = 3 tasks: current 3 -> 3/3 = 1; earlier (1 + 2)/3 = 1; the sum is (3 + 1 + 2)/3 = 2
    current, previous = combine_task_losses(torch.tensor(3.0), torch.tensor([1.0, 2.0]))
    assert (current.item(), previous.item()) == (1.0, 1.0)
    # one task (nothing earlier): the current loss itself, and 0
    current, previous = combine_task_losses(torch.tensor(3.0), torch.zeros(0))
    assert (current.item(), previous.item()) == (3.0, 0.0)


@pytest.mark.parametrize(
    "override,match",
    [
        ("method_args.maml.inner_lr=0", r"method_args.maml.inner_lr: must be > 0 \(got 0"),
        ("method_args.maml.inner_steps=0", "method_args.maml.inner_steps: must be >= 1"),
        ("method_args.maml-reg.support_fraction=1", "method_args.maml-reg.support_fraction: must be > 0 and < 1"),
        ("method_args.maml-reg.reg_weight=-1", "method_args.maml-reg.reg_weight: must be > 0"),
        ("method_args.mtl.freeze=partial", "method_args.mtl.freeze: must be one of config, none, all_but_classifier"),
    ],
)
def test_bad_options_are_one_line_config_errors(override, match):
    name = override.split(".")[1]
    with pytest.raises(ConfigError, match=match):
        create_method(name, resolve_config(overrides=[override]))


# ----------------------------------------------------------------------------- end to end


class Recompute(Plugin):
    """Recomputes each method's session-1 loss terms with the pure functions on the same batch and weights."""

    name = "recompute"

    def __init__(self, method: str):
        self.method = method
        self.terms: dict[int, set] = {}
        self.pairs: list[tuple[str, float, float]] = []  # (term, loop value, recomputed value)

    def before_backward(self, state):
        t = state.session.index
        self.terms.setdefault(t, set()).update(k for k, v in state.losses.items() if float(v.detach()) != 0.0)
        if t == 0:
            return
        loss = SegmentationLoss(state.config.lambda_ce, state.config.lambda_dice)
        model, target = state.model, state.target
        x = state.batch["image"]
        with torch.no_grad():
            logits = model(x)
        if self.method == "mtl":
            rows = [state.seen.index(c) for c in (0, *state.session.classes)]
            current = loss(logits[:, rows], task_target(target, rows, len(state.seen)))
            keys = sorted(state.prototypes.entries)
            protos = torch.stack([state.prototypes.entries[k] for k in keys])
            head = task_row_mask([[state.seen.index(c) for c in (0, 1, 2)]], len(state.seen))
            with torch.no_grad():
                previous = prototype_task_losses(
                    model.classifier(protos),
                    torch.tensor([state.seen.index(k[1]) for k in keys]),
                    torch.zeros(len(keys), dtype=torch.long),
                    head,
                )
            self.pairs.append(("mtl_current", float(state.losses["mtl_current"].detach()), float(current) / 2))
            self.pairs.append(("mtl_previous", float(state.losses["mtl_previous"].detach()), float(previous.sum()) / 2))
            return
        opts = create_method(self.method, state.config).plugins[0].options
        s, q = support_query_split(x.shape[0], opts.support_fraction)
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        adapted = first_order_adapt(
            lambda p: loss(functional_call(model, p, (x[s],)), target[s]), params, opts.inner_lr, opts.inner_steps
        )
        query = loss(functional_call(model, adapted, (x[q],)), target[q])
        self.pairs.append(("maml", float(state.losses["maml"].detach()), float(query.detach())))
        if self.method == "maml-reg":
            kappa = condition_number(adapted["classifier.weight"])
            self.pairs.append(("maml_reg", float(state.losses["maml_reg"].detach()), float(kappa.detach())))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from conftest import toy_protocol_dict
    from jascl.protocols import parse_protocol

    protocol = parse_protocol(toy_protocol_dict(2), source="toy-2d.yaml")
    config = resolve_config(protocol.training, "toy-2d.yaml")
    root = tmp_path_factory.mktemp("meta")
    out = {}
    for name in MINE:
        probe = Recompute(name)
        results = run_benchmark(
            protocol,
            config,
            [name],
            root / "run",
            cache_dir=root / "cache",
            progress=False,
            echo=lambda *a: None,
            extra_plugins=[probe],
        )
        out[name] = (results, probe)
    return protocol, config, root, out


@pytest.mark.parametrize("name", MINE)
def test_each_method_trains_evaluates_with_its_own_terms_only_in_session_1(name, runs):
    protocol, config, root, out = runs
    results, probe = out[name]
    sessions = results["methods"][name]["sessions"]
    assert len(sessions) == 2 and all(0.0 <= s["all"] <= 1.0 for s in sessions)
    (plugin,) = create_method(name, config).plugins
    assert probe.terms[1] == set(plugin.loss_terms)  # every declared term acts; "seg" is replaced
    assert (root / "run" / name / "s1-inc" / "metrics.json").exists()


@pytest.mark.parametrize("name", MINE)
def test_loss_terms_equal_the_pure_functions_on_the_same_batch(name, runs):
    _, _, _, out = runs
    _, probe = out[name]
    assert probe.pairs, "session 1 ran no step"
    for term, got, expected in probe.pairs:
        assert got == pytest.approx(expected, rel=1e-5, abs=1e-6), term


@pytest.mark.parametrize("name", MINE)
def test_shared_base_and_frozen_backbone_with_a_trained_classifier(name, runs):
    from safetensors.torch import load_file

    _, _, root, _ = runs
    assert not (root / "run" / name / "s0-base" / "metrics.json").exists()  # vanilla's base is reused
    base = load_file(root / "run" / "base" / "model.safetensors")
    s1 = load_file(root / "run" / name / "s1-inc" / "model.safetensors")
    assert all(torch.equal(base[k], s1[k]) for k in base if not k.startswith("classifier."))
    assert not torch.equal(s1["classifier.weight"][:3], base["classifier.weight"])  # old rows trained


def test_maml_reg_lowers_the_condition_number_of_the_classifier(runs):
    _, _, root, _ = runs
    from safetensors.torch import load_file

    kappa = {
        n: condition_number(load_file(root / "run" / n / "s1-inc" / "model.safetensors")["classifier.weight"])
        for n in ("maml", "maml-reg")
    }
    assert kappa["maml-reg"] < kappa["maml"]
