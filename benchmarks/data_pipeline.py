"""Throughput of the data pipeline on paper-sized CT volumes (issue 20, item 6).

Writes an MSD-layout dataset of ``--cases`` CT-like volumes (default 512 x 512 x 300 voxels, int16,
0.8 x 0.8 x 1.5 mm, gzip-compressed NIfTI as the public releases ship them) with a label of three organs,
then measures, through jascl's own code path:

* **first pass** (a cold cache), per stage: NIfTI decode (``MSDLayout.read``), the value check every
  loaded sample gets (``check_sample_values``), MONAI preprocessing with the med protocols' options
  (RAS, 1.5 mm isotropic, CT window) and the cache write (``jascl.data.cache.cached``);
* **cached pass**: loading every preprocessed volume back from the cache (a new store, so no memo);
* **patches**: training items of the paper's patch size (128 x 120 x 120, ``med-disjoint``) from the
  real ``LabelledDataset`` (pad, foreground-biased crop, flips), through a ``DataLoader`` with 0 and
  ``--workers`` worker processes;
* peak RSS of the process (and of the worker processes, as the OS reports children).

Usage::

    python benchmarks/data_pipeline.py [--cases 3] [--shape 512 512 300] [--workers 2] [--dir /scratch]

Prints a markdown table. The dataset and the cache go to a temporary folder (``--dir``: somewhere else,
e.g. the disk a real run would read), removed afterwards unless ``--keep``.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import tempfile
import time
from pathlib import Path

import nibabel as nib
import numpy as np
import torch
from torch.utils.data import DataLoader, RandomSampler

from jascl.data.cache import cached
from jascl.data.datasets import LabelledDataset
from jascl.data.layouts import LAYOUTS
from jascl.data.medical import preprocess_volume
from jascl.data.real.storage import check_sample_values
from jascl.data.sessions import load_sessions
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
    meta = {
        "name": "bench",
        "modality": {"0": "CT"},
        "labels": {"0": "background", "1": "liver", "2": "spleen", "3": "kidney"},
        "numTraining": cases,
        "training": [
            {"image": f"./imagesTr/ct_{i:03d}.nii.gz", "label": f"./labelsTr/ct_{i:03d}.nii.gz"} for i in range(cases)
        ],
    }
    import json

    (root / "dataset.json").write_text(json.dumps(meta))
    return time.perf_counter() - start


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


def rss_mib(who: int = resource.RUSAGE_SELF) -> float:
    return resource.getrusage(who).ru_maxrss / 1024.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=3)
    parser.add_argument("--shape", type=int, nargs=3, default=(512, 512, 300))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--patches", type=int, default=24, help="patches timed per loader setting")
    parser.add_argument("--dir", default=None)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    base = Path(tempfile.mkdtemp(prefix="jascl-data-bench-", dir=args.dir))
    try:
        root, cache = base / "ct", base / "cache"
        shape = tuple(args.shape)
        written = write_dataset(root, args.cases, shape)  # type: ignore[arg-type]
        size = sum(p.stat().st_size for p in root.rglob("*.nii.gz")) / 2**20
        layout = LAYOUTS.create("msd", root=root)
        records = [r for r in layout.scan() if r.split == "train"]

        # first pass, stage by stage, as SampleStore.load does it on a cache miss
        stages = {"decode": 0.0, "check": 0.0, "preprocess": 0.0, "cache write": 0.0}
        out_shape = None
        for record in records:
            t0 = time.perf_counter()
            sample = layout.read(record)
            t1 = time.perf_counter()
            check_sample_values(record, sample.image)
            t2 = time.perf_counter()
            image, label = preprocess_volume(sample, PREPROCESS)
            t3 = time.perf_counter()
            arrays = (np.ascontiguousarray(image, np.float32), np.ascontiguousarray(label, np.int32))
            cached([record.id, "bench"], lambda a=arrays: a, cache / "stages")
            t4 = time.perf_counter()
            out_shape = image.shape
            for key, dt in zip(stages, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                stages[key] += dt
            del sample, image, label, arrays

        # the real path: selection (reads every label once), then the store's cold and warm loads
        protocol = protocol_for(args.cases)
        t0 = time.perf_counter()
        data = load_sessions(protocol, cache, echo=lambda m: None, roots={"bench": root}, patch_size=PATCH)
        index_s = time.perf_counter() - t0
        split = data[0].train
        t0 = time.perf_counter()
        for i in range(len(split)):
            split.images[i]
        cold = time.perf_counter() - t0
        data = load_sessions(protocol, cache, echo=lambda m: None, roots={"bench": root}, patch_size=PATCH)
        split = data[0].train
        t0 = time.perf_counter()
        for i in range(len(split)):
            split.images[i]
        warm = time.perf_counter() - t0
        n = len(split)

        patches = {}
        for workers in sorted({0, args.workers}):
            dataset = LabelledDataset(split, [0, 1, 2, 3], augment=True, patch_size=PATCH, seed=1)
            # patches drawn at random, with replacement, over the training volumes (one pass of --patches
            # items: worker start-up is counted once, as in a long epoch)
            sampler = RandomSampler(
                dataset, replacement=True, num_samples=args.patches, generator=torch.Generator().manual_seed(0)
            )
            loader = DataLoader(dataset, batch_size=2, sampler=sampler, num_workers=workers)
            got, t0 = 0, time.perf_counter()
            for batch in loader:
                got += batch["image"].shape[0]
            patches[workers] = got / (time.perf_counter() - t0)

        vox = np.prod(shape) / 1e6
        print(
            f"data pipeline · {args.cases} CT volumes {shape[0]}x{shape[1]}x{shape[2]} int16 "
            f"({vox:.0f} M voxels each, {size:.0f} MiB gzip on disk, written in {written:.1f} s) · "
            f"preprocessed to {tuple(out_shape[1:]) if out_shape else '?'} · torch threads {torch.get_num_threads()}\n"
        )
        print("| stage | seconds per volume | volumes/s |")
        print("|---|---|---|")
        for key, total in stages.items():
            per = total / len(records)
            print(f"| first pass: {key} | {per:.2f} | {1 / per if per else float('inf'):.2f} |")
        first = sum(stages.values()) / len(records)
        print(f"| first pass: all four | {first:.2f} | {1 / first:.2f} |")
        print(
            f"| label indexing (every label read once, cached) | {index_s / args.cases:.2f} | {args.cases / index_s:.2f} |"
        )
        print(f"| store, cold cache (the run's first epoch) | {cold / n:.2f} | {n / cold:.2f} |")
        print(f"| store, cached pass | {warm / n:.2f} | {n / warm:.2f} |")
        print()
        print(
            f"| training patches {PATCH[0]}x{PATCH[1]}x{PATCH[2]} (pad, foreground crop, flips; {n} training volumes, "
            f"the store keeps 2 decoded per process) | patches/s |"
        )
        print("|---|---|")
        for workers, rate in patches.items():
            print(f"| DataLoader, {workers} worker process(es), batch 2 | {rate:.2f} |")
        print()
        print(
            f"peak RSS: this process {rss_mib():.0f} MiB; worker processes {rss_mib(resource.RUSAGE_CHILDREN):.0f} MiB"
        )
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
        else:
            print(f"kept {base}")


if __name__ == "__main__":
    main()
