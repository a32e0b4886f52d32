"""One ``jascl bench`` case, run in its own process (``python -m jascl.experiments.bench_cases CASE SPEC``):
the same model, data, batch and optimiser through jascl's loop or a plain loop, timed per step with the operators
it dispatches counted."""

from __future__ import annotations

import copy
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

from jascl.experiments.bench import EVAL_CASES


class OpCounter:
    """Counts the operators dispatched in this thread (and autograd's backward) while active, outside data loading.

    ``ops``: every ATen operator; ``kernels``: those that are not views (a view
    returns an alias of an input and launches nothing). Data loading
    (``DataLoader`` iteration) is excluded: on a GPU it runs in worker processes.
    """

    def __init__(self) -> None:
        self.ops = self.kernels = 0
        self._mode = None
        self._restore = None

    def __enter__(self) -> OpCounter:
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils.data import dataloader

        counter = self
        paused = [0]

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if not paused[0]:
                    counter.ops += 1
                    if not any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns):
                        counter.kernels += 1
                return func(*args, **(kwargs or {}))

        base = dataloader._BaseDataLoaderIter
        originals = {name: getattr(base, name) for name in ("__init__", "__next__")}

        def uncounted(method):
            def wrapper(*args, **kwargs):
                paused[0] += 1
                try:
                    return method(*args, **kwargs)
                finally:
                    paused[0] -= 1

            return wrapper

        for name, method in originals.items():  # iterators' set-up (base seed) and batches
            setattr(base, name, uncounted(method))
        self._restore = lambda: [setattr(base, name, method) for name, method in originals.items()]
        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        self._restore()

    def per_step(self, steps: int) -> dict:
        steps = max(steps, 1)
        return {"ops_per_step": self.ops / steps, "kernels_per_step": self.kernels / steps}


class _Done(Exception):
    """Ends a timed jascl session before its evaluation and checkpoint."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Clock:
    """Times the training steps of epochs >= 1 (epoch 0 warms up and counts operators); seconds between epochs apart."""

    def __init__(self, device: torch.device, count_ops: bool = True) -> None:
        self.device = device
        self.step_seconds = 0.0
        self.steps = 0
        self.between_seconds = 0.0
        self._t = None
        self._end = None
        self._counter = OpCounter() if count_ops else None
        self.op_counts: dict = {}

    def start_epoch(self, epoch: int) -> None:
        _sync(self.device)
        if epoch == 0 and self._counter is not None:
            self._counter.__enter__()
        now = time.perf_counter()
        if epoch >= 1 and self._end is not None:
            self.between_seconds += now - self._end
        if epoch == 1 and self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._t = now

    def end_epoch(self, epoch: int, steps: int) -> None:
        _sync(self.device)
        if epoch == 0 and self._counter is not None:
            self._counter.__exit__(None, None, None)
            self.op_counts = self._counter.per_step(steps)
        self._end = time.perf_counter()
        if epoch >= 1:
            self.step_seconds += self._end - self._t
            self.steps += steps


def _clock_plugin(clock: _Clock, epochs: int):
    from jascl.engine.plugin import Plugin

    class ClockPlugin(Plugin):
        name = "bench-clock"

        def __init__(self) -> None:
            self.steps = 0

        def before_epoch(self, state) -> None:  # last plugin: the others' epoch set-up is "between epochs"
            self.steps = 0
            clock.start_epoch(state.epoch)

        def after_update(self, state) -> None:
            self.steps += 1

        def after_epoch(self, state) -> None:
            clock.end_epoch(state.epoch, self.steps)
            if state.epoch == epochs - 1:
                raise _Done

    return ClockPlugin()


def _setup(spec: dict):
    from jascl.data.sessions import load_sessions
    from jascl.engine.config import resolve_config
    from jascl.protocols import get_protocol

    protocol = get_protocol(spec["protocol"])
    overrides = [f"epochs_incremental={spec['epochs']}", "checkpoint_every=0", "checkpoint_steps=0", *spec["overrides"]]
    config = resolve_config(protocol.training, protocol.path, None, overrides)
    data = load_sessions(protocol, spec.get("cache_dir"), echo=lambda *a: None, patch_size=config.patch_size)
    return protocol, config, data


def _session_model(trainer, t: int):
    """A model at the start of session t (grown to its classes) and the prototypes of sessions before t."""
    from jascl.engine.prototypes import PrototypeStore

    store = PrototypeStore()
    model = trainer.new_model(len(trainer.protocol.seen_classes(0)))
    for s in range(t):
        store.add(s, trainer.compute_prototypes(model, s, [0, *trainer.protocol.sessions[s].classes]))
        if s + 1 < t:
            trainer.setup_model(model, s + 1)
    return model, store


def _grown_model(spec: dict):
    """(protocol, config, data, trainer, model at the start of session t grown to its classes, t) for the plain cases."""
    from jascl.engine.loop import ContinualTrainer
    from jascl.engine.plugin import Method

    protocol, config, data = _setup(spec)
    trainer = ContinualTrainer(protocol, config, Method("plain"), data, progress=False)
    t = spec["session"]
    model, _ = _session_model(trainer, t)
    trainer.setup_model(model, t)
    return protocol, config, data, trainer, model, t


def _jascl_case(case: str, spec: dict, device: torch.device) -> dict:
    from jascl.engine.loop import ContinualTrainer
    from jascl.methods.registry import create_method

    protocol, config, data = _setup(spec)
    name = {"vanilla": "vanilla", "gas+replay": "jascl-no-unlabelled", "pas": "jascl"}[case]
    method = create_method(name, config)
    clock = _Clock(device, count_ops=not config.compile)  # a dispatch mode would change what is compiled
    trainer = ContinualTrainer(
        protocol, config, method, data, progress=False, extra_plugins=[_clock_plugin(clock, spec["epochs"])]
    )
    t = spec["session"]
    model, store = _session_model(trainer, t)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            trainer.run_session(t, model, store, Path(tmp))
        except _Done:
            pass
    return {
        "steps": clock.steps,
        "seconds": clock.step_seconds,
        "between_epoch_seconds": clock.between_seconds / max(spec["epochs"] - 1, 1),
        **clock.op_counts,
    }


def _plain_case(case: str, spec: dict, device: torch.device) -> dict:
    """The loops a user would write by hand around the same model, data and batch."""
    from monai.losses import DiceCELoss
    from torch.utils.data import DataLoader

    from jascl.data.datasets import LabelledDataset
    from jascl.engine.optim import make_optimizer, resolve_precision
    from jascl.methods.mean_teacher import UnlabelledDataset, view_transform
    from jascl.methods.presets import jascl_options

    protocol, config, data, trainer, model, t = _grown_model(spec)
    pas = jascl_options(config).pas  # the plain mean teacher uses JASCL's weight and EMA decay
    session = protocol.sessions[t]
    if config.freeze_incremental == "all_but_classifier":
        model.backbone.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(config, params, config.lr_incremental)  # the run configuration's, as jascl's loop
    loss_fn = DiceCELoss(to_onehot_y=True, softmax=True, lambda_ce=config.lambda_ce, lambda_dice=config.lambda_dice)
    lut = torch.zeros(256, dtype=torch.long)
    lut[torch.tensor(protocol.seen_classes(t))] = torch.arange(len(protocol.seen_classes(t)))
    lut = lut.to(device)
    dataset = LabelledDataset(
        data[t].train,
        session.classes,
        session.other_classes,
        augment=config.augment,
        patch_size=config.patch_size,
        seed=0,
    )
    opts = trainer.loader_options
    loader = DataLoader(dataset, batch_size=config.batch_size, shuffle=True, **opts)
    amp = resolve_precision(config.precision, device)
    mean_teacher = case == "plain-mt"
    if mean_teacher:
        teacher = copy.deepcopy(model).eval().requires_grad_(False)
        views = (view_transform(1), view_transform(2))
        unlabelled = DataLoader(
            UnlabelledDataset(data[t].unlabelled, views, seed=0), batch_size=config.batch_size, shuffle=True, **opts
        )
        student_params, teacher_params = list(model.parameters()), list(teacher.parameters())

    clock = _Clock(device, count_ops=not config.compile)  # a dispatch mode would change what is compiled
    unlabelled_iter = None
    for epoch in range(spec["epochs"]):
        model.train()
        model.backbone.train(config.freeze_incremental != "all_but_classifier")
        clock.start_epoch(epoch)
        steps = 0
        n_steps = max(len(loader), len(unlabelled)) if mean_teacher else len(loader)
        batches = iter(loader)
        while steps < n_steps:
            batch = next(batches, None)
            if batch is None:
                batches = iter(loader)
                batch = next(batches)
            x = batch["image"].to(device, non_blocking=True)
            y = lut[batch["label"].to(device, non_blocking=True)]
            with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
                loss = loss_fn(model(x), y.unsqueeze(1))
                if mean_teacher:
                    u = next(unlabelled_iter, None) if unlabelled_iter is not None else None
                    if u is None:
                        unlabelled_iter = iter(unlabelled)
                        u = next(unlabelled_iter)
                    views_u = u["views"].to(device, non_blocking=True)
                    student = torch.softmax(model(views_u[:, 0]).float(), 1)
                    with torch.no_grad():
                        target = torch.softmax(teacher(views_u[:, 1]).float(), 1)
                    loss = loss + pas.weight * ((student - target) ** 2).sum(1).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if mean_teacher:
                with torch.no_grad():
                    torch._foreach_lerp_(teacher_params, student_params, 1.0 - pas.ema_decay)
            steps += 1
        clock.end_epoch(epoch, steps)
    return {"steps": clock.steps, "seconds": clock.step_seconds, "between_epoch_seconds": None, **clock.op_counts}


def _eval_case(case: str, spec: dict, device: torch.device) -> dict:
    from monai.inferers import sliding_window_inference

    from jascl.evaluation.evaluator import evaluate

    protocol, config, data, trainer, model, t = _grown_model(spec)
    model.eval()
    splits = [d.test for d in data[: t + 1]]
    spatial = splits[0].images.shape[2:]
    roi = list(config.patch_size) if config.patch_size else [max(s // 2, 1) for s in spatial]
    samples = sum(len(s) for s in splits)
    seconds = []
    for _ in range(spec["eval_repeats"] + 1):  # the first pass warms up
        _sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        with trainer.autocast():
            if case == "eval":
                evaluate(
                    model,
                    splits,
                    protocol.seen_classes(t),
                    device,
                    roi=roi,
                    sw_batch_size=config.sw_batch_size,
                    overlap=config.sw_overlap,
                )
            else:
                with torch.no_grad():
                    for split in splits:
                        for i in range(len(split)):
                            x = torch.from_numpy(split.images[i][None]).float().to(device)
                            logits = sliding_window_inference(
                                x, roi, config.sw_batch_size, model, overlap=config.sw_overlap
                            )
                            logits.argmax(1).cpu()
        _sync(device)
        seconds.append(time.perf_counter() - start)
    return {"steps": samples * spec["eval_repeats"], "seconds": sum(seconds[1:]), "between_epoch_seconds": None}


def run_case(case: str, spec: dict) -> dict:
    """One case in this process; returns steps, seconds and peak memory."""
    from jascl.engine.optim import resolve_device

    torch.manual_seed(0)
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    device = resolve_device(spec["device"])
    spec = {**spec, "overrides": [*spec["overrides"], f"device={device}"]}
    if case in ("plain", "plain-mt"):
        out = _plain_case(case, spec, device)
    elif case in EVAL_CASES:
        out = _eval_case(case, spec, device)
    else:
        out = _jascl_case(case, spec, device)
    if device.type == "cuda":
        out["peak_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
        out["memory"] = "CUDA allocator peak"
    else:
        out["peak_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        out["memory"] = "process peak RSS"
    out["device"] = (
        torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    )
    return out


def _main(argv: list[str]) -> int:
    from jascl.errors import JasclError

    case, spec = argv[0], json.loads(argv[1])
    try:
        result = run_case(case, spec)
    except JasclError as exc:
        print(f"jascl: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, default=float))
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
