"""A reused session's prototype passes are kept in its folder: the next method that restores it reads them instead of
making the pass again, with the tensors the pass gives (jascl.engine.prototype_cache)."""

import torch

from jascl.data.synthetic import load_or_generate
from jascl.engine import prototype_cache
from jascl.engine.checkpoint import load_tensors
from jascl.engine.loop import ContinualTrainer
from jascl.engine.prototypes import PrototypeRequest, PrototypeStore
from jascl.experiments.runner import run_benchmark
from jascl.methods import Method
from jascl.methods.replay import PrototypeReplayPlugin

ASKED = [PrototypeRequest((1, 2), complement=True), PrototypeRequest((1, 2), per_sample=True, form="authors")]


class Counting:
    """A stand-in pass: answers every request with a fixed tensor per class and counts the passes."""

    def __init__(self) -> None:
        self.passes: list[list[PrototypeRequest]] = []

    def __call__(self, requests):
        self.passes.append(list(requests))
        return [{c: torch.full((4,), float(10 * i + c)) for c in r.classes} for i, r in enumerate(requests)]


def test_a_pass_is_made_once_and_served_from_the_folder_while_nothing_that_decides_it_changes(tmp_path):
    # (BatchNorm: a 0-d int64 counter among the buffers)
    model, other = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2)), torch.nn.Linear(3, 2)
    setting = {"session": 0, "batch_size": 4}
    compute = Counting()
    first = prototype_cache.serve(tmp_path, ASKED, setting, model, compute)
    again = prototype_cache.serve(tmp_path, ASKED, setting, model, compute)
    assert len(compute.passes) == 1 and len(list((tmp_path / "prototype-cache").iterdir())) == 2
    for a, b in zip(first, again):
        assert a.keys() == b.keys() == {1, 2} and all(torch.equal(a[c], b[c]) for c in a)
    assert torch.equal(again[1][2], torch.full((4,), 12.0))
    # another setting, other weights, the same weights changed in place, another request: a pass each
    prototype_cache.serve(tmp_path, ASKED, {**setting, "batch_size": 8}, model, compute)
    prototype_cache.serve(tmp_path, ASKED, setting, other, compute)
    with torch.no_grad():
        model[0].weight[0, 0] += 1.0
    prototype_cache.serve(tmp_path, ASKED, setting, model, compute)
    prototype_cache.serve(tmp_path, [PrototypeRequest((1,))], setting, model, compute)
    assert len(compute.passes) == 5
    # an answer with no class is kept too; a damaged file is computed again and rewritten
    assert prototype_cache.serve(tmp_path, [PrototypeRequest(())], setting, model, compute) == [{}]
    assert prototype_cache.serve(tmp_path, [PrototypeRequest(())], setting, model, compute) == [{}]
    assert len(compute.passes) == 6
    for path in (tmp_path / "prototype-cache").iterdir():
        path.write_bytes(b"not safetensors")
    prototype_cache.serve(tmp_path, [PrototypeRequest((1,))], setting, model, compute)
    prototype_cache.serve(tmp_path, [PrototypeRequest((1,))], setting, model, compute)
    assert len(compute.passes) == 7
    # a folder that cannot be written to: the answer is computed and returned, nothing is kept
    (tmp_path / "read-only").write_text("a file where the cache's folder would be")
    got = prototype_cache.serve(tmp_path / "read-only", [PrototypeRequest((2,))], setting, model, compute)
    assert torch.equal(got[0][2], torch.full((4,), 2.0)) and len(compute.passes) == 8


def test_a_restored_session_serves_the_next_restore_with_the_tensors_of_the_pass(
    toy_protocol, toy_config, tmp_path, monkeypatch
):
    data = load_or_generate(toy_protocol, tmp_path / "cache")
    base = ContinualTrainer(toy_protocol, toy_config, Method("b", []), data, progress=False)
    model, store = base.initial_model(3), PrototypeStore()
    base.run_session(0, model, store, tmp_path / "s0")
    plugins = [PrototypeReplayPlugin(values="authors"), PrototypeReplayPlugin(values="authors")]
    trainers = [ContinualTrainer(toy_protocol, toy_config, Method("r", [p]), data, progress=False) for p in plugins]
    passes = [0]
    compute = trainers[0].task.compute_prototype_requests

    def counted(*args):
        passes[0] += 1
        return compute(*args)

    for trainer in trainers:
        monkeypatch.setattr(trainer.task, "compute_prototype_requests", counted)
    trainers[0].restore_session(0, tmp_path / "s0", model, store)
    trainers[1].restore_session(0, tmp_path / "s0", model, store)
    assert passes[0] == 1  # the second restore read the first's answers
    assert plugins[0].own.keys() == plugins[1].own.keys() == {(0, 1), (0, 2)}
    for c in (1, 2):
        assert torch.equal(plugins[1].own[(0, c)], plugins[0].own[(0, c)])
        assert torch.equal(plugins[1].complements[(0, c)], plugins[0].complements[(0, c)])
    # what was read is what a pass makes now; a call outside session_restored is never served from the cache
    samples = trainers[1].compute_prototypes(model, 0, [1, 2], per_sample=True, form="authors")
    assert passes[0] == 2 and all(torch.equal(plugins[1].own[(0, c)], samples[c].mean(0)) for c in (1, 2))


def test_jascl_variants_on_one_keyed_base_make_its_pass_once_or_never_with_the_same_results(
    toy_protocol, toy_config, tmp_path, monkeypatch
):
    """The base's own run answers the variants' restores ahead (``Plugin.restore_requests``); without that, the first
    restore makes the pass and the second reads it; without the cache, each makes it. The results are the same."""
    methods = ["jascl-no-unlabelled", "jascl-no-gas"]
    kw = {"cache_dir": tmp_path / "cache", "progress": False, "echo": lambda *a: None}
    served = []
    serve = prototype_cache.serve

    def recorded(folder, requests, setting, model, compute):
        hit = [False]

        def passed(rs):
            hit[0] = True
            return compute(rs)

        out = serve(folder, requests, setting, model, passed)
        served.append((folder.name, not hit[0]))
        return out

    with monkeypatch.context() as m:  # the cache off: every restore makes its pass
        m.setattr(prototype_cache, "serve", lambda folder, requests, setting, model, compute: compute(requests))
        m.setattr(PrototypeReplayPlugin, "restore_requests", lambda self, state: [])
        off = run_benchmark(toy_protocol, toy_config, methods, tmp_path / "off", **kw)
    monkeypatch.setattr(prototype_cache, "serve", recorded)
    with monkeypatch.context() as m:  # nothing answered ahead: the first variant made the pass, the second read it
        m.setattr(PrototypeReplayPlugin, "restore_requests", lambda self, state: [])
        late = run_benchmark(toy_protocol, toy_config, methods, tmp_path / "late", **kw)
    base = "base-stochastic-classifier"
    assert served == [(base, False), (base, True)]
    served.clear()
    ahead = run_benchmark(toy_protocol, toy_config, methods, tmp_path / "ahead", **kw)
    assert served == [(base, True), (base, True)]  # neither restore made a pass
    assert ahead["methods"] == late["methods"] == off["methods"]
    # what the base's pass kept is, bit for bit and under the same key, what the first restore's pass computed
    kept, computed = (
        {p.name: load_tensors(p) for p in (tmp_path / run / base / "prototype-cache").iterdir()}
        for run in ("ahead", "late")
    )
    assert len(kept) == 1 and kept.keys() == computed.keys()
    for name, tensors in kept.items():
        assert tensors.keys() == computed[name].keys() and all(
            torch.equal(v, computed[name][k]) for k, v in tensors.items()
        )
