"""Train every registered method (or those named) on a built-in paper protocol's fixture copies of its datasets.

A developer's check that each method runs end to end on real dataset layouts (NIfTI volumes of several sizes,
lazy splits, unlabelled pools), which the test suite does for ``vanilla`` and ``jascl`` only: the fixtures are
those of ``tests/test_real_protocols.py`` (written in the datasets' real layouts into a temporary folder), the
configuration its tiny one (one epoch per session, a tiny U-Net), and, unlike the tests, the protocol's own
spacings (on ``med-ss``: BraTS volumes of 48^3, the others 32^3, the patch 32^3). One line per method: OK with
its seconds, or FAIL with the error's first line. Exit status 1 when any method failed. Needs the test extras
(``python -m pip install -e ".[test]"``).

    python tools/every_method_on_fixtures.py --protocol med-ss
    python tools/every_method_on_fixtures.py --protocol med-disjoint --methods plop,ewc

A method takes 8-50 s on a 2-core CPU (``gen-replay``'s diffusion prior in 3D, several minutes per session).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--protocol", default="med-ss", help="a built-in paper protocol (default: med-ss)")
    parser.add_argument("--methods", help="comma-separated names (default: every registered method)")
    parser.add_argument("--skip", default="", help="comma-separated names to leave out")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    from jascl.experiments.runner import run_benchmark
    from jascl.protocols import get_protocol
    from test_real_protocols import (  # the tests' fixture writers and tiny configuration
        shrink_images,
        tiny_config,
        write_medical_roots,
        write_natural_roots,
    )

    names = (
        args.methods.split(",")
        if args.methods
        else list(json.loads((ROOT / "src/jascl/registry_index.json").read_text())["methods"])
    )
    names = [m for m in names if m not in set(args.skip.split(","))]
    protocol = get_protocol(args.protocol)
    failed = 0
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        if protocol.spatial_dims == 3:
            roots, patch = write_medical_roots(tmp / "data", protocol), [32, 32, 32]
        else:
            protocol = shrink_images(protocol)
            shots = max(s.shots or 0 for s in protocol.sessions)
            roots, patch = write_natural_roots(tmp / "data", protocol, per_split=shots + 2), [32, 32]
        config = tiny_config(protocol, patch)
        for method in names:
            start = time.perf_counter()
            try:
                run_benchmark(
                    protocol,
                    config,
                    [method],
                    tmp / f"run-{method}",
                    cache_dir=tmp / "cache",
                    progress=False,
                    echo=lambda *a: None,
                    roots=roots,
                )
                print(f"OK    {method:22s} {time.perf_counter() - start:6.1f} s", flush=True)
            except Exception as exc:  # noqa: BLE001 (every failure is reported, and the next method runs)
                failed += 1
                first = (str(exc).splitlines() or [""])[0][:200]
                print(f"FAIL  {method:22s} {type(exc).__name__}: {first}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
