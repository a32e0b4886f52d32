"""Which on-disk format for the preprocessed store: ``.npz`` vs memory-mapped ``.npy`` vs blosc2 (issue 33).

Preprocesses one CT-like volume of ``benchmarks/data_pipeline.py`` (512 x 512 x 300 int16 -> 274 x 274 x 300
float32 with the med protocols' options), writes it in each format, and reads 60 random 128 x 120 x 120
crops back (from the page cache: the crops are read once before timing). Prints write time, size on disk
and time per crop, wall and CPU (user+sys of this process), as markdown.

blosc2 is not a jascl dependency: ``pip install blosc2`` to include its rows (one blosc2 thread, as a
loader worker would use). Usage::

    python benchmarks/store_formats.py [--dir /scratch]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import data_pipeline as dp  # noqa: E402

from jascl.data.layouts import LAYOUTS  # noqa: E402
from jascl.data.medical import preprocess_volume  # noqa: E402

PATCH = (128, 120, 120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="jascl-store-formats-", dir=args.dir))
    try:
        dp.write_dataset(base / "ct", 1, (512, 512, 300))
        layout = LAYOUTS.create("msd", root=base / "ct")
        image, label = preprocess_volume(layout.read(layout.scan()[0]), dp.PREPROCESS)
        image, label = np.ascontiguousarray(image, np.float32), np.ascontiguousarray(label, np.uint8)
        rng = np.random.default_rng(0)
        boxes = [[int(rng.integers(0, n - p + 1)) for n, p in zip(label.shape, PATCH)] for _ in range(60)]
        out = base / "out"
        out.mkdir()
        print(f"one volume {image.shape}, {image.nbytes / 2**20:.0f} MiB float32; load {os.getloadavg()[0]:.2f}\n")
        print("| storage | write, wall (CPU) | on disk | one crop, wall (CPU) |")
        print("|---|---|---|---|")

        def box(b):
            return tuple(slice(a, a + p) for a, p in zip(b, PATCH))

        def measure(name, write, read, files):
            t0, c0 = time.perf_counter(), time.process_time()
            write()
            tw, cw = time.perf_counter() - t0, time.process_time() - c0
            size = sum(os.path.getsize(f) for f in files) / 2**20
            for b in boxes:
                read(b)  # into the page cache
            t0, c0 = time.perf_counter(), time.process_time()
            for b in boxes:
                got_image, got_label = read(b)
            tr, cr = (time.perf_counter() - t0) / len(boxes), (time.process_time() - c0) / len(boxes)
            assert np.array_equal(got_image[0], image[0][box(b)]) and np.array_equal(got_label, label[box(b)])
            print(f"| {name} | {tw:.2f} s ({cw:.2f} s) | {size:.0f} MiB | {tr * 1e3:.1f} ms ({cr * 1e3:.1f} ms) |")

        def read_npz(b):
            with np.load(out / "a.npz") as z:
                im, la = z["image"], z["label"]
            return im[(slice(None),) + box(b)].copy(), la[box(b)].copy()

        measure(
            "`.npz`, whole-volume read",
            lambda: np.savez(out / "a.npz", image=image, label=label),
            read_npz,
            [out / "a.npz"],
        )

        def write_npy():
            np.save(out / "image.npy", image)
            np.save(out / "label.npy", label)

        def read_npy(b):
            im, la = np.load(out / "image.npy", mmap_mode="r"), np.load(out / "label.npy", mmap_mode="r")
            return np.array(im[(slice(None),) + box(b)]), np.array(la[box(b)])

        measure("memory-mapped `.npy`", write_npy, read_npy, [out / "image.npy", out / "label.npy"])
        try:
            import blosc2
        except ImportError:
            print("\n(blosc2 is not installed: its rows are left out)")
            return
        blosc2.set_nthreads(1)
        for codec, clevel, chunks, blocks in [
            (blosc2.Codec.ZSTD, 8, None, None),
            (blosc2.Codec.LZ4, 5, None, None),
            (blosc2.Codec.ZSTD, 8, (1, 64, 64, 64), (1, 16, 16, 16)),
            (blosc2.Codec.LZ4, 5, (1, 64, 64, 64), (1, 16, 16, 16)),
            (blosc2.Codec.LZ4, 5, (1, 128, 128, 64), (1, 32, 32, 32)),
        ]:
            fi, fl = out / f"i-{codec.name}{clevel}{chunks}.b2nd", out / f"l-{codec.name}{clevel}{chunks}.b2nd"

            def write_b2(codec=codec, clevel=clevel, chunks=chunks, blocks=blocks, fi=fi, fl=fl):
                cp = {"codec": codec, "clevel": clevel}
                blosc2.asarray(image, urlpath=str(fi), mode="w", chunks=chunks, blocks=blocks, cparams=cp)
                spatial = (None, None) if chunks is None else (chunks[1:], blocks[1:])
                blosc2.asarray(label, urlpath=str(fl), mode="w", chunks=spatial[0], blocks=spatial[1], cparams=cp)

            def read_b2(b, fi=fi, fl=fl):
                im, la = blosc2.open(str(fi), mode="r", mmap_mode="r"), blosc2.open(str(fl), mode="r", mmap_mode="r")
                return im[(slice(None),) + box(b)], la[box(b)]

            measure(f"blosc2 {codec.name} level {clevel}, chunks {chunks or 'default'}", write_b2, read_b2, [fi, fl])
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
