"""Several prototype calls in one pass over a session's data: the same values as separate calls, fewer passes."""

import torch

from jascl.data.synthetic import load_or_generate
from jascl.engine.loop import ContinualTrainer
from jascl.engine.prototypes import PrototypeRequest, PrototypeStore
from jascl.methods import Method, Plugin
from jascl.methods.replay import PrototypeReplayPlugin

REQUESTS = [
    PrototypeRequest((0, 1, 2)),
    PrototypeRequest((1, 2), complement=True),
    PrototypeRequest((1, 2), normalize_pixels=True),
    PrototypeRequest((1, 2), per_sample=True, form="authors"),
    PrototypeRequest((1, 2), per_sample=True, complement=True, form="authors"),
]


def _trainer(toy_protocol, toy_config, tmp_path, *plugins):
    data = load_or_generate(toy_protocol, tmp_path / "cache")
    return ContinualTrainer(toy_protocol, toy_config, Method("t", list(plugins)), data, progress=False)


def _count_passes(trainer, monkeypatch) -> list[int]:
    """Counts the passes over whole labelled samples (what every prototype pass starts with)."""
    passes = [0]
    task = trainer.task
    labelled = task.labelled_dataset

    def counted(t, augment, crop):
        passes[0] += not crop
        return labelled(t, augment, crop)

    monkeypatch.setattr(task, "labelled_dataset", counted)
    return passes


def test_one_pass_serves_every_request_as_its_own_call_would(toy_protocol, toy_config, tmp_path, monkeypatch):
    trainer = _trainer(toy_protocol, toy_config, tmp_path)
    model = trainer.initial_model(3)
    passes = _count_passes(trainer, monkeypatch)
    together = trainer.task.compute_prototype_requests(model, 0, REQUESTS)
    assert passes[0] == 1
    for request, got in zip(REQUESTS, together):
        alone = trainer.task.compute_prototypes(
            model,
            0,
            list(request.classes),
            request.normalize_pixels,
            request.per_sample,
            request.complement,
            request.form,
        )
        assert got.keys() == alone.keys() and got  # (every request found its classes in the toy base session)
        assert all(torch.equal(got[c], alone[c]) for c in got)
    assert passes[0] == 1 + len(REQUESTS)
    # the forms differ, so the test compares different things: per-sample rows, unit or not, complements
    assert together[3][1].dim() == 2 and not torch.equal(together[2][1], together[0][1])


def test_the_store_and_the_replay_share_one_pass_in_before_eval(toy_protocol, toy_config, tmp_path, monkeypatch):
    plugin = PrototypeReplayPlugin()  # eq. 2 values, per-class backgrounds: the complements of classes 1 and 2
    trainer = _trainer(toy_protocol, toy_config, tmp_path, plugin)
    model, store = trainer.initial_model(3), PrototypeStore()
    passes = _count_passes(trainer, monkeypatch)
    trainer.run_session(0, model, store, tmp_path / "s0")
    assert passes[0] == 1  # session 0: no new rows to imprint; the store's and the replay's prototypes in one pass
    # the values are those of separate calls on the trained model
    assert torch.equal(store.entries[(0, 1)], trainer.compute_prototypes(model, 0, [0, 1, 2])[1])
    complements = trainer.compute_prototypes(model, 0, [1, 2], complement=True)
    assert all(torch.equal(plugin.complements[(0, c)], complements[c]) for c in (1, 2))
    assert passes[0] == 3  # (those two checks), and nothing is left over for them to be served from


class ChangesTheModel(Plugin):
    """Scales the first convolution in ``before_eval``, before the plugin below asks for prototypes."""

    name = "changes"

    def before_eval(self, state):
        with torch.no_grad():
            next(state.model.backbone.parameters()).mul_(3.0)


class Asks(Plugin):
    """Declares one prototype call and makes it twice in ``before_eval``."""

    name = "asks"

    def __init__(self):
        self.got: list[dict] = []
        self.trained: dict = {}

    def after_training(self, state):  # the model as training left it (an undeclared call: a pass of its own)
        self.trained = state.compute_prototypes([1])

    def prototype_requests(self, state):
        return [PrototypeRequest((1,))]

    def before_eval(self, state):
        self.got += [state.compute_prototypes([1]), state.compute_prototypes([1])]


def test_a_declared_call_gets_the_model_as_training_left_it_once(toy_protocol, toy_config, tmp_path, monkeypatch):
    asks = Asks()
    trainer = _trainer(toy_protocol, toy_config, tmp_path, ChangesTheModel(), asks)
    model = trainer.initial_model(3)
    passes = _count_passes(trainer, monkeypatch)
    trainer.run_session(0, model, PrototypeStore(), tmp_path / "s0")
    # after_training's call; one pass for the declared calls (the store's and this plugin's); the repeat
    assert passes[0] == 3
    first, second = asks.got
    # the declared call: the model as training left it; the repeat, undeclared: the model as it is then
    assert torch.equal(first[1], asks.trained[1])
    assert torch.equal(second[1], trainer.task.compute_prototypes(model, 0, [1])[1])
    assert not torch.allclose(second[1], first[1])  # (the scaling changed the features)


def test_a_reused_session_takes_one_pass_for_the_authors_values(toy_protocol, toy_config, tmp_path, monkeypatch):
    """values=authors at ``session_restored`` (a JASCL variant starting from the shared base): the per-sample
    prototypes and their complements in one pass, as separate calls would give them."""
    base = _trainer(toy_protocol, toy_config, tmp_path)
    model, store = base.initial_model(3), PrototypeStore()
    base.run_session(0, model, store, tmp_path / "s0")
    plugin = PrototypeReplayPlugin(values="authors")
    trainer = _trainer(toy_protocol, toy_config, tmp_path, plugin)
    passes = _count_passes(trainer, monkeypatch)
    trainer.restore_session(0, tmp_path / "s0", model, store)
    assert passes[0] == 1
    samples = trainer.compute_prototypes(model, 0, [1, 2], per_sample=True, form="authors")
    complements = trainer.compute_prototypes(model, 0, [1, 2], per_sample=True, complement=True, form="authors")
    for c in (1, 2):  # base_samples=0: every sample
        assert torch.equal(plugin.own[(0, c)], samples[c].mean(0))
        assert torch.equal(plugin.complements[(0, c)], complements[c].mean(0))
