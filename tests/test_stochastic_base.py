"""JASCL's base session: the classifier with learned weight noise (the authors' ProbabilisticClassifier)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from jascl.engine.config import RunConfig
from jascl.experiments.runner import run_benchmark
from jascl.methods.registry import create_method
from jascl.methods.stochastic_base import attach_learned_noise, detach_learned_noise, learned_noise_weight
from jascl.networks.classifier import PixelClassifier


def test_learned_noise_weight_by_hand():
    w = torch.tensor([[1.0, -2.0]])
    s = torch.tensor([[4.0, 4.0 + math.log(math.e - 1)]])  # softplus(0) = ln 2, softplus(ln(e - 1)) = 1
    noise = torch.tensor([[0.5, -1.0]])
    out = learned_noise_weight(w, s, noise)
    assert out[0].tolist() == pytest.approx([1.0 + 0.5 * math.log(2), -3.0])


def test_noise_in_training_only_and_scale_is_learned():
    torch.manual_seed(0)
    clf = PixelClassifier(4, 3)
    clean = clf.weight.detach().clone()
    noise = attach_learned_noise(clf)
    # authors' initial scale: softplus(s - 4) with s ~ U(-1/sqrt(C), 1/sqrt(C)): between softplus(-4.5) and (-3.5)
    assert F.softplus(torch.tensor(-4.5)) <= noise.scale().min() and noise.scale().max() <= F.softplus(
        torch.tensor(-3.5)
    )
    clf.eval()
    assert torch.equal(clf.weight, clean)
    clf.train()
    assert not torch.equal(clf.weight, clean)
    feats = torch.randn(2, 4, 5, 5)
    loss = F.cross_entropy(clf(feats), torch.randint(0, 3, (2, 5, 5)))
    loss.backward()
    assert noise.s.grad is not None and noise.s.grad.abs().sum() > 0  # the loss tunes the noise scale
    params = dict(clf.named_parameters())
    assert "parametrizations.weight.0.s" in params and "parametrizations.weight.original" in params
    detach_learned_noise(clf)
    assert torch.equal(clf.weight, clean) and [n for n, _ in clf.named_parameters()] == ["weight"]


def test_jascl_family_shares_one_stochastic_base_and_shared_option_uses_vanillas(toy_protocol, toy_config, tmp_path):
    out = tmp_path / "run"
    kw = {"cache_dir": tmp_path / "cache", "progress": False, "echo": lambda *a: None}
    res = run_benchmark(toy_protocol, toy_config, ["vanilla", "jascl-no-unlabelled", "jascl-no-gas"], out, **kw)
    s0 = {m: r["sessions"][0]["all"] for m, r in res["methods"].items()}
    assert s0["jascl-no-unlabelled"] == s0["jascl-no-gas"] != s0["vanilla"]
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("base")) == ["base", "base-stochastic-classifier"]
    base = json.loads((out / "base-stochastic-classifier" / "metrics.json").read_text())
    assert base["all"] == s0["jascl-no-gas"]
    # the saved base holds the clean classifier weight: no noise parameter
    from safetensors import safe_open

    with safe_open(str(out / "base-stochastic-classifier" / "model.safetensors"), "pt") as f:
        assert not any("parametrizations" in k for k in f.keys())
    config = RunConfig(**{**toy_config.__dict__, "method_args": {"jascl": {"base": "shared"}}})
    # base=shared: no session-0 plugin, so the runner gives the method vanilla's base
    assert [p.name for p in create_method("jascl", config).plugins] == ["gas", "proto", "cons"]
    assert create_method("jascl", config).base_key is None and not create_method("jascl", config).changes_base_session
