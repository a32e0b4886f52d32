"""Throughput of the data pipeline on paper-sized CT volumes (issue 20, item 6; issue 33, items 1-3).

Writes an MSD-layout dataset of ``--cases`` CT-like volumes (default 512 x 512 x 300 voxels, int16,
0.8 x 0.8 x 1.5 mm, gzip-compressed NIfTI as the public releases ship them) with a label of three organs,
then measures, through jascl's own code path:

* **first pass** (``jascl data prepare``'s :func:`~jascl.data.prepare.prepare_protocol`: NIfTI decode, value
  check, MONAI preprocessing with the med protocols' options (RAS, 1.5 mm isotropic, CT window), store write
  and label index) with 1 worker process and with ``--workers``, each into an empty cache: seconds per volume,
  the speed-up, and each worker's peak RSS; with ``--stages``, also the serial stage-by-stage split;
* **whole-sample reads** of every preprocessed volume from the store (what evaluation and prototypes read);
* **patches**: training items of the paper's patch size (128 x 120 x 120, ``med-disjoint``) from the real
  ``LabelledDataset`` (pad, foreground-biased crop, flips) through a ``DataLoader`` with 0 and ``--workers``
  worker processes: read by crops from the store (what runs do), and, as the *before*, through the
  whole-volume path (each patch reads its whole volume, maps and scans the whole label: what runs did
  before the crop-readable store, less the old cache's zip CRC); each loader runs in a fresh process (so its
  workers are forked from a process holding only the loader, as in a run) and reports its workers' peak RSS.

Usage::

    python benchmarks/data_pipeline.py [--cases 6] [--shape 512 512 300] [--workers 2] [--dir /scratch]

Prints markdown tables with the targets of issue 33 (>= 100 patches/s with 2 workers, first pass 2 workers
>= 1.7 x one, peak RSS per worker <= 1 GiB). The dataset and the caches go to a temporary folder (``--dir``:
somewhere else, e.g. the disk a real run would read), removed afterwards unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nibabel as nib
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler

from jascl.data.datasets import LabelledDataset, collate_items
from jascl.data.layouts import LAYOUTS
from jascl.data.medical import preprocess_volume
from jascl.data.prepare import prepare_protocol
from jascl.data.real.storage import check_sample_values
from jascl.data.sessions import load_sessions
from jascl.data.types import LazySequence, Split
from jascl.data.workers import worker_context
from jascl.protocols import parse_protocol

SPACING = (0.8, 0.8, 1.5)
PATCH = (128, 120, 120)  # med-disjoint's training patch_size
PREPROCESS = {"spacing": [1.5, 1.5, 1.5], "intensity": "ct", "window": [-175, 250]}


def write_case(root: Path, case: str, shape: tuple[int, int, int], rng: np.random.Generator) -> None:
    """A CT-like int16 volume (air outside a body ellipse, soft tissue, three brighter organs, noise) + label."""
    x, y, z = (np.linspace(-1, 1, n, dtype=np.float32) for n in shape)
    body = (x[:, None, None] ** 2 / 0.8 + y[None, :, None] ** 2 / 0.6) <= 1.0
    body = np.broadcast_to(body, shape)
    label = np.zeros(shape, np.uint8)
    for value, (cx, cy, r) in enumerate([(-0.3, 0.1, 0.25), (0.35, 0.0, 0.2), (0.0, -0.35, 0.15)], start=1):
        organ = ((x[:, None, None] - cx) ** 2 + (y[None, :, None] - cy) ** 2 + (z[None, None, :] * 0.6) ** 2) <= r**2
        label[organ] = value
    hu = np.where(body, 40.0, -1000.0).astype(np.float32) + 30.0 * label
    hu += rng.normal(0.0, 15.0, shape).astype(np.float32)
    affine = np.diag([*SPACING, 1.0])
    nib.save(nib.Nifti1Image(np.round(hu).astype(np.int16), affine), str(root / "imagesTr" / f"{case}_0000.nii.gz"))
    nib.save(nib.Nifti1Image(label, affine), str(root / "labelsTr" / f"{case}.nii.gz"))


def write_dataset(root: Path, cases: int, shape: tuple[int, int, int]) -> float:
    (root / "imagesTr").mkdir(parents=True)
    (root / "labelsTr").mkdir(parents=True)
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    for i in range(cases):
        write_case(root, f"ct_{i:03d}", shape, rng)
    write_meta(root, cases)
    return time.perf_counter() - start


def kept_dataset(base: Path, cases: int, shape: tuple[int, int, int]) -> Path:
    """The dataset of ``cases`` volumes of ``shape`` under ``base``, written by :func:`write_dataset` the first time
    and kept (what the one-setting-per-process benchmarks reuse across their calls)."""
    root = base / f"msd-{cases}-{'x'.join(map(str, shape))}"
    if not (root / "dataset.json").exists():
        shutil.rmtree(root, ignore_errors=True)
        print(f"wrote {cases} volumes in {write_dataset(root, cases, shape):.1f} s")
    return root


def write_meta(root: Path, cases: int) -> None:
    """The MSD ``dataset.json`` of the ``cases`` volumes :func:`write_case` wrote as ``ct_000``, ``ct_001``, ..."""
    meta = {
        "name": "bench",
        "modality": {"0": "CT"},
        "labels": {"0": "background", "1": "liver", "2": "spleen", "3": "kidney"},
        "numTraining": cases,
        "training": [
            {"image": f"./imagesTr/ct_{i:03d}.nii.gz", "label": f"./labelsTr/ct_{i:03d}.nii.gz"} for i in range(cases)
        ],
    }
    (root / "dataset.json").write_text(json.dumps(meta))


def protocol_for(cases: int):
    return parse_protocol(
        {
            "name": "bench-data",
            "seed": 1,
            "spatial_dims": 3,
            "in_channels": 1,
            "classes": [
                {"id": 0, "name": "background"},
                {"id": 1, "name": "liver"},
                {"id": 2, "name": "spleen"},
                {"id": 3, "name": "kidney"},
            ],
            "domains": {"ct": {}},
            "datasets": {
                "ct": {
                    "layout": "msd",
                    "domain": "ct",
                    "root": "bench",
                    "labels": {1: "liver", 2: "spleen", 3: "kidney"},
                    "preprocess": PREPROCESS,
                    "test_fraction": 1 / cases,
                }
            },
            "sessions": [
                {"name": "base", "domains": ["ct"], "new_classes": [1, 2, 3], "shots": "all", "sources": ["ct"]}
            ],
            "training": {"patch_size": list(PATCH)},
        },
        source="bench-data.yaml",
    )


def huge_pages() -> str:
    """The kernel's transparent huge page mode and numpy's request for them (``NUMPY_MADVISE_HUGEPAGE``; numpy asks
    for huge pages for arrays of 4 MiB and more unless it is 0), which change the first pass's system time a lot on
    some virtual machines (docs/performance.md)."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
        mode = text[text.index("[") + 1 : text.index("]")]
    except (OSError, ValueError):
        mode = "unknown"
    return f"transparent huge pages {mode}, NUMPY_MADVISE_HUGEPAGE={os.environ.get('NUMPY_MADVISE_HUGEPAGE', 'unset')}"


def rss_mib(who: int = resource.RUSAGE_SELF) -> float:
    return resource.getrusage(who).ru_maxrss / 1024.0


class WholeSamples(LazySequence):
    """A lazy split's images or labels, offered without a crop reader: ``LabelledDataset`` then reads each
    patch's whole sample (the loader path before the crop-readable store)."""

    def __init__(self, samples) -> None:
        self.samples = samples
        self.ndim, self.shape, self.dtype = samples.ndim, samples.shape, samples.dtype

    def __len__(self) -> int:
        return len(self.samples)

    def _one(self, index: int) -> np.ndarray:
        return self.samples[index]


class WithWorkerMemory(Dataset):
    """Items of ``dataset`` with the peak RSS (MiB) of the process that made them."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> dict:
        return {**self.dataset[index], "rss": rss_mib()}

    def __getitems__(self, indices: list) -> list[dict]:
        items = self.dataset.__getitems__(indices)  # type: ignore[attr-defined]
        return [{**item, "rss": rss_mib()} for item in items]


def measure_loader(root: Path, cache: Path, cases: int, workers: int, patches: int, whole: bool) -> dict:
    """Patches/s and the workers' peak RSS of one loader setting (run in a fresh process by :func:`main`)."""
    protocol = protocol_for(cases)
    data = load_sessions(protocol, cache, echo=lambda m: None, roots={"bench": root}, patch_size=PATCH)
    split = data[0].train
    if whole:
        split = Split(WholeSamples(split.images), WholeSamples(split.labels), split.ids)
    # uint8 labels and the collate of the training loop's loader (SegmentationTask.labelled_dataset, .collate)
    dataset = WithWorkerMemory(
        LabelledDataset(split, [0, 1, 2, 3], augment=True, patch_size=PATCH, seed=1, label_dtype=torch.uint8)
    )
    # patches drawn at random, with replacement, over the training volumes (one pass of `patches` items:
    # worker start-up is counted once, as in a long epoch)
    sampler = RandomSampler(dataset, replacement=True, num_samples=patches, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(dataset, batch_size=2, sampler=sampler, num_workers=workers, collate_fn=collate_items)
    got, worker_rss = 0, 0.0
    t0, c0 = time.perf_counter(), time.process_time()
    for batch in loader:
        got += batch["image"].shape[0]
        worker_rss = max(worker_rss, float(batch["rss"].max()))
    wall = time.perf_counter() - t0
    main_cpu = time.process_time() - c0
    del loader, batch  # the workers exit and are waited for: their CPU time is counted below
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = main_cpu + children.ru_utime + children.ru_stime
    return {
        "patches_s": got / wall,
        "wall_s": wall,
        "cpu_ms": 1000 * cpu / got,
        "main_ms": 1000 * main_cpu / got,
        "worker_rss": worker_rss,
    }


def first_pass_stages(root: Path, cache: Path) -> dict[str, tuple[float, float, float]]:
    """Seconds per volume of each first-pass stage, one volume after another in this process: (wall, user CPU,
    system CPU). System time is where a machine's memory handling shows: first touches of memory the kernel has
    to supply (new heap pages, the page cache of a write)."""
    layout = LAYOUTS.create("msd", root=root)
    records = [r for r in layout.scan() if r.split == "train"]
    keys = ("decode", "check", "preprocess", "store write")
    stages = {key: (0.0, 0.0, 0.0) for key in keys}
    from jascl.data.real.store import write_entry

    def now() -> tuple[float, float, float]:
        used = resource.getrusage(resource.RUSAGE_SELF)
        return time.perf_counter(), used.ru_utime, used.ru_stime

    for i, record in enumerate(records):
        marks = [now()]
        sample = layout.read(record)
        marks.append(now())
        check_sample_values(record, sample.image)
        marks.append(now())
        image, label = preprocess_volume(sample, PREPROCESS)
        marks.append(now())
        write_entry(cache / "stages" / str(i), np.ascontiguousarray(image, np.float32), label.astype(np.uint8), {})
        marks.append(now())
        for key, start, end in zip(keys, marks, marks[1:]):
            stages[key] = tuple(t + (b - a) / len(records) for t, a, b in zip(stages[key], start, end))  # type: ignore[assignment]
        del sample, image, label
    return stages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=6)
    parser.add_argument("--shape", type=int, nargs=3, default=(512, 512, 300))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--patches", type=int, default=400, help="patches timed per loader setting (store crops)")
    parser.add_argument("--whole-patches", type=int, default=24, help="patches timed on the whole-volume path")
    parser.add_argument("--stages", action="store_true", help="also time the first pass stage by stage")
    parser.add_argument("--dir", default=None)
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--loader", nargs=2, metavar=("ROOT", "CACHE"), help=argparse.SUPPRESS)
    parser.add_argument("--whole", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.loader:  # the child process of one loader measurement
        result = measure_loader(
            Path(args.loader[0]), Path(args.loader[1]), args.cases, args.workers, args.patches, args.whole
        )
        print(json.dumps(result))
        return
    load_start, cpu_start = os.getloadavg(), resource.getrusage(resource.RUSAGE_SELF)
    t_start = time.perf_counter()
    if args.dir is not None:
        Path(args.dir).mkdir(parents=True, exist_ok=True)  # a folder to write into, made if missing
    base = Path(tempfile.mkdtemp(prefix="jascl-data-bench-", dir=args.dir))
    try:
        root = base / "ct"
        shape = tuple(args.shape)
        written = write_dataset(root, args.cases, shape)  # type: ignore[arg-type]
        size = sum(p.stat().st_size for p in root.rglob("*.nii.gz")) / 2**20
        protocol = protocol_for(args.cases)

        stages = first_pass_stages(root, base / "stages") if args.stages else None
        # the fork server that prepare's workers come from imports torch and MONAI once per process: start it
        # before timing, so the 1-worker pass does not carry that cost alone
        warm = worker_context().Process(target=os.getpid)
        warm.start()
        warm.join()
        first = {}
        for workers in sorted({1, args.workers}):
            report = prepare_protocol(
                protocol,
                {"bench": root},
                cache_dir=base / f"cache-{workers}",
                workers=workers,
                echo=lambda m: None,
                progress=False,
            )
            assert not report.problems and report.built == args.cases, report.problems
            first[workers] = (report.seconds / args.cases, report.worker_peak_rss_mib)
        cache = base / f"cache-{args.workers}"
        store_mib = sum(p.stat().st_size for p in (cache / "real" / "store").rglob("*") if p.is_file()) / 2**20

        data = load_sessions(protocol, cache, echo=lambda m: None, roots={"bench": root}, patch_size=PATCH)
        split = data[0].train
        n = len(split)
        t0 = time.perf_counter()
        for i in range(n):
            split.images[i], split.labels[i]
        whole_read = (time.perf_counter() - t0) / n
        out_shape = split.images[0].shape
        del data, split

        loaders = {}
        for whole, patches in ((False, args.patches), (True, args.whole_patches)):
            for workers in sorted({0, args.workers}):
                command = [sys.executable, __file__, "--loader", str(root), str(cache), "--cases", str(args.cases)]
                command += ["--workers", str(workers), "--patches", str(patches)] + (["--whole"] if whole else [])
                done = subprocess.run(command, capture_output=True, text=True, check=True)
                loaders[(whole, workers)] = json.loads(done.stdout.strip().splitlines()[-1])

        cpu_end = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = sum(r.ru_utime + r.ru_stime for r in cpu_end) - (cpu_start.ru_utime + cpu_start.ru_stime)
        vox = np.prod(shape) / 1e6
        print(
            f"data pipeline · {args.cases} CT volumes {shape[0]}x{shape[1]}x{shape[2]} int16 "
            f"({vox:.0f} M voxels each, {size:.0f} MiB gzip on disk, written in {written:.1f} s) · "
            f"preprocessed to {tuple(out_shape[1:])} · store {store_mib / args.cases:.0f} MiB per volume · "
            f"{os.cpu_count()} CPUs · {huge_pages()} · "
            f"load average {load_start[0]:.2f} at the start, {os.getloadavg()[0]:.2f} at the end · "
            f"{time.perf_counter() - t_start:.0f} s wall, {cpu:.0f} s CPU (user+sys, children included)\n"
        )
        if stages is not None:
            print(
                "| first pass, one volume after another in one process | seconds per volume | user CPU | system CPU |"
            )
            print("|---|---|---|---|")
            for key, (wall, user, system) in stages.items():
                print(f"| {key} | {wall:.2f} | {user:.2f} | {system:.2f} |")
            total = [sum(v[k] for v in stages.values()) for k in range(3)]
            print(f"| all four | {total[0]:.2f} | {total[1]:.2f} | {total[2]:.2f} |\n")
        w = args.workers
        speedup = first[1][0] / first[w][0]
        crops, wholes = loaders[(False, w)], loaders[(True, w)]
        worker_rss = max(first[w][1], crops["worker_rss"])
        print("| measure | value | target | met |")
        print("|---|---|---|---|")
        for k, (per, _) in first.items():
            print(f"| first pass (jascl data prepare), {k} worker(s): s per volume | {per:.2f} | | |")
        if w != 1:
            print(
                f"| first pass speed-up, {w} workers / 1 | {speedup:.2f} x | >= 1.7 x | {'yes' if speedup >= 1.7 else 'NO'} |"
            )
        print(f"| whole-sample read from the store (evaluation): s per volume | {whole_read:.3f} | | |")
        for (whole, k), r in sorted(loaders.items()):
            path = "whole-volume reads (before)" if whole else "store crops"
            target = (
                "| >= 100 |" + (" yes |" if r["patches_s"] >= 100 else " NO |") if (k == w and not whole) else "| | |"
            )
            print(f"| patches/s, {path}, {k} loader worker(s), batch 2 | {r['patches_s']:.2f} {target}")
            print(
                f"| CPU per patch (user+sys, workers included), {path}, {k} loader worker(s): ms | {r['cpu_ms']:.1f} | | |"
            )
            if k:
                print(f"| of which the main process (receiving the batches): ms | {r['main_ms']:.1f} | | |")
        print(
            f"| peak RSS per loader worker, store crops, {w} workers (MiB) | {crops['worker_rss']:.0f} | <= 1024 | "
            f"{'yes' if crops['worker_rss'] <= 1024 else 'NO'} |"
        )
        print(f"| peak RSS per loader worker, whole-volume reads, {w} workers (MiB) | {wholes['worker_rss']:.0f} | | |")
        for k, (_, rss) in first.items():
            print(f"| peak RSS per prepare worker, {k} worker(s) (MiB) | {rss:.0f} | | |")
        print(f"\npeak RSS of this process {rss_mib():.0f} MiB (largest across everything: {worker_rss:.0f} MiB)")
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
        else:
            print(f"kept {base}")


if __name__ == "__main__":
    main()
