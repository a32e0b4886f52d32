"""Is the GPU fed? The paper's 3D U-Net trained by jascl's loop from the crop-readable store (issue 33, item 7).

Writes ``--cases`` CT-like volumes in the MSD layout (int16, 0.8 x 0.8 x 1.5 mm, gzip NIfTI, as
``benchmarks/data_pipeline.py`` does), prepares them with ``jascl data prepare``'s code
(:func:`~jascl.data.prepare.prepare_protocol`, ``--prepare-workers`` processes), then trains session 0 of a
one-session protocol with med-disjoint's training settings (the authors' 3D U-Net ``unet3d-authors``,
128 x 120 x 120 patches, batch 2, the same optimiser, loss and precision) through jascl's own
:class:`~jascl.engine.loop.ContinualTrainer` and ``vanilla`` method: the real loader (store crops,
foreground-biased sampling, flips), pinned memory, the loop's events. The first epoch warms up (worker start,
cuDNN autotuning); the next ``--epochs`` are timed. For each loader worker count in ``--loader-workers``:

* **GPU busy share**: CUDA events recorded at each step's first and last event (``before_iteration``,
  ``after_update``): the sum of the steps' GPU spans over the span from the first timed step's start to the
  last one's end. The time between two steps (waiting for the next batch, the loop's own work between
  steps, the epoch boundaries) counts as idle.
* **NVML utilisation** (``nvidia-smi``'s "GPU-Util": the share of the driver's last sample period, 1/6 s to
  1 s, in which a kernel ran), read every 50 ms over the timed epochs, where ``pynvml`` is importable.
* **steps/s** fed from the store and **steps/s** on one batch kept on the GPU (the same loop's model and
  optimiser, no loader): their ratio is a second estimate of the share.
* the main process's **wait for a batch** (host seconds inside the loader's ``next``) per step.

Usage (a GPU; on a CPU it runs, but the shares mean little)::

    python benchmarks/gpu_feed.py --device cuda [--cases 48] [--shape 320 320 200] [--loader-workers 4,8]

Prints a markdown table; the issue's target is GPU busy >= 90 % of the step time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data_pipeline import protocol_for, write_case, write_meta  # noqa: E402

from jascl.data.prepare import prepare_protocol  # noqa: E402
from jascl.data.sessions import load_sessions  # noqa: E402
from jascl.engine.config import resolve_config  # noqa: E402
from jascl.engine.loop import ContinualTrainer  # noqa: E402
from jascl.engine.plugin import Plugin  # noqa: E402
from jascl.engine.prototypes import PrototypeStore  # noqa: E402
from jascl.methods.registry import create_method  # noqa: E402
from jascl.protocols import get_protocol  # noqa: E402


class Done(Exception):
    """Ends the timed session before its evaluation."""


def write_one(args: tuple[str, int, tuple[int, int, int]]) -> None:
    root, i, shape = args
    write_case(Path(root), f"ct_{i:03d}", shape, np.random.default_rng(i))


def write_dataset(root: Path, cases: int, shape: tuple[int, int, int], processes: int) -> float:
    (root / "imagesTr").mkdir(parents=True)
    (root / "labelsTr").mkdir(parents=True)
    start = time.perf_counter()
    with ProcessPoolExecutor(processes) as pool:
        list(pool.map(write_one, [(str(root), i, shape) for i in range(cases)]))
    write_meta(root, cases)
    return time.perf_counter() - start


class UtilSampler:
    """NVML's GPU utilisation, sampled every 50 ms in a thread while active (None without pynvml or a GPU)."""

    def __init__(self, device: torch.device) -> None:
        self.samples: list[int] = []
        self._handle = None
        if device.type == "cuda":
            try:
                import pynvml

                pynvml.nvmlInit()
                self._nvml = pynvml
                self._handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
            except Exception:  # noqa: BLE001 - NVML is optional: the share from CUDA events stands alone
                self._handle = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._handle is None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.samples.append(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu)

    def stop(self) -> float | None:
        if self._thread is None:
            return None
        self._stop.set()
        self._thread.join()
        return float(np.mean(self.samples)) if self.samples else None


class FeedClock(Plugin):
    """Per training step: CUDA events (or host clocks on a CPU) at the step's first and last event; the host's
    wait for the batch (from the previous step's end to this step's start)."""

    name = "feed-clock"

    def __init__(self, device: torch.device, epochs: int, sampler: UtilSampler) -> None:
        self.device, self.epochs, self.sampler = device, epochs, sampler
        self.cuda = device.type == "cuda"
        self.marks: list[tuple] = []  # (start, end) per timed step
        self.waits: list[float] = []
        self._start = None
        self._host_end: float | None = None
        self.wall = 0.0
        self.batch: dict | None = None  # the first timed step's batch (for the resident-batch comparison)

    def _mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def before_epoch(self, state) -> None:
        if state.epoch == 1:
            if self.cuda:
                torch.cuda.synchronize()
            self.sampler.start()
            self._t0 = time.perf_counter()
            self._host_end = time.perf_counter()

    def before_iteration(self, state) -> None:
        if state.epoch >= 1:
            now = time.perf_counter()
            if self._host_end is not None:
                self.waits.append(now - self._host_end)
            self._start = self._mark()
            if self.batch is None:
                self.batch = state.batch

    def after_update(self, state) -> None:
        if state.epoch >= 1:
            self.marks.append((self._start, self._mark()))
            self._host_end = time.perf_counter()

    def after_epoch(self, state) -> None:
        if state.epoch == self.epochs:
            if self.cuda:
                torch.cuda.synchronize()
            self.wall = time.perf_counter() - self._t0
            self.util = self.sampler.stop()
            raise Done

    def busy_share(self) -> tuple[float, float]:
        """(sum of the steps' spans / span from the first start to the last end, that span in seconds)."""
        if self.cuda:
            spans = sum(s.elapsed_time(e) for s, e in self.marks) / 1000.0
            whole = self.marks[0][0].elapsed_time(self.marks[-1][1]) / 1000.0
        else:
            spans = sum(e - s for s, e in self.marks)
            whole = self.marks[-1][1] - self.marks[0][0]
        return spans / whole, whole


def resident_steps_per_s(trainer: ContinualTrainer, model, batch: dict, steps: int) -> float:
    """The loop's model and a fresh optimiser stepping on one batch kept on the device (no loader)."""
    from monai.losses import DiceCELoss

    from jascl.engine.optim import make_optimizer

    cfg = trainer.config
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(cfg, params, cfg.lr_base)
    loss_fn = DiceCELoss(to_onehot_y=True, softmax=True)
    image = batch["image"].to(trainer.device)
    label = batch["label"].to(trainer.device).long().unsqueeze(1)
    label = torch.where(label == 255, 0, label)  # the loop ignores padding (255); the same work here
    model.train()
    amp = trainer.amp_dtype

    def step() -> None:
        with torch.autocast(trainer.device.type, dtype=amp, enabled=amp is not None):
            loss = loss_fn(model(image), label)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(5):
        step()
    if trainer.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    if trainer.device.type == "cuda":
        torch.cuda.synchronize()
    return steps / (time.perf_counter() - t0)


def feed_run(protocol, cache: Path, root: Path, args, workers: int) -> dict:
    """One timed session-0 training of the paper's U-Net through jascl's loop with ``workers`` loader workers."""
    training = dict(get_protocol("med-disjoint").training)
    overrides = [
        f"epochs_base={args.epochs + 1}",
        f"num_workers={workers}",
        f"device={args.device}",
        "checkpoint_every=0",
        "checkpoint_steps=0",
        *args.set,
    ]
    config = resolve_config(training, "med-disjoint.yaml", None, overrides)
    data = load_sessions(protocol, cache, echo=lambda m: None, roots={"bench": root}, patch_size=config.patch_size)
    sampler = UtilSampler(torch.device(args.device))
    clock = FeedClock(torch.device(args.device), args.epochs, sampler)
    trainer = ContinualTrainer(protocol, config, create_method("vanilla", config), data, False, [clock])
    model = trainer.new_model(len(protocol.seen_classes(0)))
    with tempfile.TemporaryDirectory() as tmp:
        try:
            trainer.run_session(0, model, PrototypeStore(), Path(tmp))
        except Done:
            pass
    share, span = clock.busy_share()
    steps = len(clock.marks)
    assert clock.batch is not None
    resident = resident_steps_per_s(trainer, model, clock.batch, min(steps, 60))
    row = {
        "workers": workers,
        "steps": steps,
        "steps_s": steps / clock.wall,
        "busy": share,
        "span_s": span,
        "util": clock.util,
        "resident_steps_s": resident,
        "wait_ms": 1000 * float(np.mean(clock.waits)) if clock.waits else 0.0,
        "wait_max_ms": 1000 * float(np.max(clock.waits)) if clock.waits else 0.0,
        "backbone": config.backbone,
        "precision": "fp32" if trainer.amp_dtype is None else str(trainer.amp_dtype).replace("torch.", ""),
        "patch": list(config.patch_size),
        "batch": config.batch_size,
        "optimizer": config.optimizer,
    }
    print(f"[gpu_feed] {json.dumps(row)}", file=sys.stderr, flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=48)
    parser.add_argument("--shape", type=int, nargs=3, default=(320, 320, 200))
    parser.add_argument("--prepare-workers", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    parser.add_argument("--loader-workers", default="4,8", help="comma-separated loader worker counts to time")
    parser.add_argument("--epochs", type=int, default=3, help="timed epochs after the warm-up epoch")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dir", default=None)
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="run configuration key (a quick CPU check: --set patch_size=[32,32,32]); the default is med-disjoint's",
    )
    parser.add_argument("--keep", action="store_true", help="keep the dataset and the store")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({os.cpu_count()} cores)"
    base = Path(tempfile.mkdtemp(prefix="jascl-gpu-feed-", dir=args.dir))
    shape = tuple(args.shape)
    say = lambda m: print(f"[gpu_feed {time.strftime('%H:%M:%S')}] {m}", file=sys.stderr, flush=True)  # noqa: E731
    say(f"writing {args.cases} volumes to {base}")
    written = write_dataset(base / "ct", args.cases, shape, args.prepare_workers)  # type: ignore[arg-type]
    protocol = protocol_for(args.cases)
    say(f"written in {written:.0f} s; preparing the store with {args.prepare_workers} workers")
    report = prepare_protocol(  # what `jascl data prepare` runs
        protocol, {"bench": base / "ct"}, cache_dir=base / "cache", workers=args.prepare_workers, progress=False
    )
    assert not report.problems and report.built == args.cases, report.problems
    say(f"prepared in {report.seconds:.0f} s; training")
    try:
        rows = [feed_run(protocol, base / "cache", base / "ct", args, int(w)) for w in args.loader_workers.split(",")]
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    print(
        f"gpu feed · {name} · torch {torch.__version__} · {args.cases} CT volumes {shape[0]}x{shape[1]}x{shape[2]} "
        f"(written in {written:.0f} s, prepared in {report.seconds:.0f} s with {args.prepare_workers} workers) · "
        f"{rows[0]['backbone']}, patches {rows[0]['patch']}, batch {rows[0]['batch']}, {rows[0]['optimizer']}, "
        f"{rows[0]['precision']} · {args.epochs} timed epochs of {rows[0]['steps'] // args.epochs} steps\n"
    )
    print(
        "| loader workers | steps/s fed from the store | steps/s on one resident batch | fed / resident "
        "| GPU busy share (CUDA events) | NVML utilisation (%) | wait for a batch, mean / max (ms) | target busy >= 90 % |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        util = "-" if r["util"] is None else f"{r['util']:.0f}"
        print(
            f"| {r['workers']} | {r['steps_s']:.2f} | {r['resident_steps_s']:.2f} | "
            f"{r['steps_s'] / r['resident_steps_s']:.3f} | {100 * r['busy']:.1f} % | {util} | "
            f"{r['wait_ms']:.1f} / {r['wait_max_ms']:.1f} | {'yes' if r['busy'] >= 0.9 else 'NO'} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"device": name, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
