"""``jascl protocols``, ``methods``, ``backbones``, ``model-info``, ``data check`` and ``data prepare``, and their parsers."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from jascl.cli.common import _console, add_root_arguments
from jascl.cli.getting import add_data_getting_parsers


def cmd_protocols(args: argparse.Namespace) -> int:
    from rich.table import Table

    from jascl.protocols import builtin_protocols, get_protocol

    console = _console()
    if args.name:
        p = get_protocol(args.name)
        table = Table(title=f"{p.name}: {p.description}".strip(": "))
        cols = (
            "session",
            "domains",
            "new classes",
            "recurring",
            "shots K",
            "labelled",
            "unlabelled",
            "val/class",
            "test",
        )
        for col in cols:
            table.add_column(col)
        for s in p.sessions:
            names = lambda ids: ", ".join(f"{c}:{p.class_name(c)}" for c in ids) or "-"  # noqa: E731
            table.add_row(
                f"{s.index} {s.name}",
                ", ".join(s.domains),
                names(s.new_classes),
                names(s.recurring_classes),
                "all" if s.shots is None else str(s.shots),
                "all"
                if s.shots is None and s.train is None
                else (f"<= {s.num_labelled}" if s.sources else str(s.num_labelled)),
                str(s.unlabelled)
                + (f" + {s.unlabelled_per_class}/class" if s.unlabelled_per_class else "")
                + "".join(f" + {u.count} {u.name}" for u in s.unlabelled_sources if u.count),
                str(s.validation),
                "all" if s.test is None else str(s.test),
            )
        console.print(table)
        console.print(f"spatial_dims={p.spatial_dims} metric={p.metric} seed={p.seed} file={p.path}")
        if p.training.get("model_selection"):
            console.print(f"model_selection={p.training['model_selection']} (on the val/class validation samples)")
        for d in p.datasets.values():
            console.print(
                f"dataset {d.name}: layout {d.layout}, domain {d.domain}, root name {d.root} (--root {d.root}=PATH)"
            )
        return 0
    table = Table(title="built-in protocols")
    for col in ("name", "dims", "sessions", "classes", "description"):
        table.add_column(col)
    for name, path in builtin_protocols().items():
        p = get_protocol(path)
        table.add_row(name, f"{p.spatial_dims}D", str(len(p.sessions)), str(len(p.classes) - 1), p.description)
    console.print(table)
    return 0


def _list_registry(registry, title: str) -> int:
    from rich.table import Table

    table = Table(title=title)
    table.add_column("name")
    table.add_column("description")
    for name in registry.list():
        table.add_row(name, registry.describe(name))
    _console().print(table)
    return 0


def cmd_methods(args: argparse.Namespace) -> int:
    """``jascl methods``: the registry; ``jascl methods NAME``: one method's paper, notes and options."""
    from rich.table import Table

    from jascl.methods import METHODS
    from jascl.methods.fidelity import Fidelity
    from jascl.methods.registry import describe_method

    if getattr(args, "paper", False):
        return _paper_methods()
    task = getattr(args, "task", None) or "segmentation"
    if not args.name:
        registry = METHODS.for_task(task)
        title = (
            "methods"
            if task == "segmentation"
            else f"methods on the {task} task (same names and --set method_args.<key> as segmentation)"
        )
        table = Table(title=title)
        for col in ("name", "description", "fidelity"):
            table.add_column(col)
        for name in registry.list():
            summary = registry.summary(name)
            table.add_row(name, summary.doc, Fidelity(summary.fidelity, summary.flags).text())
        _console().print(table)
        return 0
    info = describe_method(args.name)
    console = _console()
    console.print(f"[bold]{info['name']}[/bold]: {info['doc']}", highlight=False)
    if info["paper"]:
        console.print(f"paper: {info['paper']}", highlight=False)
    console.print(f"fidelity: {Fidelity(info['fidelity'], tuple(info['flags'])).text()}", highlight=False)
    if info["notes"]:
        console.print(f"\n{info['notes']}\n", highlight=False)
    if not info["options"]:
        console.print("options: none")
        return 0
    key = f"{info['options_key']}." if info["options_key"] else ""  # a composed method's rows name their part
    if console.width < WIDE_TABLE:  # five columns would wrap every description into a ribbon of words
        return _option_blocks(console, f"options: --set method_args.{key}<option>=VALUE", info["options"])
    table = Table(title=f"options: --set method_args.{key}<option>=VALUE")
    for col in ("option", "type", "default", "allowed", "description"):
        table.add_column(col)
    for row in info["options"]:
        table.add_row(row["name"], row["type"], row["default"], row["allowed"], row["doc"])
    console.print(table)
    return 0


#: the terminal width from which ``jascl methods NAME`` prints its options as a table (narrower: one block each)
WIDE_TABLE = 120


def _option_blocks(console, title: str, rows: list[dict]) -> int:
    """Each option as a heading line (name, type, default, allowed values) and its description wrapped below,
    indented: readable in an 80-column terminal."""
    from rich.padding import Padding
    from rich.text import Text

    console.print(title, highlight=False, markup=False)
    for row in rows:
        facts = [row["type"], f"default {row['default']}", row["allowed"]]
        heading = Text(row["name"], style="bold")
        heading.append(f"  ({'; '.join(f for f in facts if f)})")
        console.print()
        console.print(heading, highlight=False)
        console.print(Padding(Text(row["doc"]), (0, 0, 0, 4), expand=False), highlight=False)
    return 0


def method_family(name: str) -> str:
    """A registered method's family: its folder under ``jascl.methods.baselines`` (e.g. "fewshot"), "jascl" for
    the JASCL presets, "fine-tuning" for vanilla; a composed method's is its first part's. Nothing is imported."""
    from jascl.methods import METHODS
    from jascl.methods.registry import composed_parts

    module = METHODS.summary((composed_parts(name) or [name])[0]).module
    parts = module.split(".")
    if "baselines" in parts and parts.index("baselines") + 1 < len(parts) - 1:
        return parts[parts.index("baselines") + 1]
    return "fine-tuning" if name == "vanilla" else "jascl"


def paper_methods() -> list[dict[str, str]]:
    """Every method of the paper's result tables (``jascl.paper``), by jascl name: the paper's row names, the
    family, the source paper and whether it is registered, registered ones first."""
    from jascl.methods import METHODS
    from jascl.paper.tables import paper_tables
    from jascl.results.fidelity import method_fidelity

    rows: dict[str, set[str]] = {}
    for table in paper_tables().values():
        for cell in table.cells():
            if cell.method:  # a class-wise table's rows are classes: its method is named by the table
                rows.setdefault(cell.method, set()).add(table.caption if table.kind == "classes" else cell.row)
    out = []
    for name, paper_rows in rows.items():
        known = name in METHODS
        fid = method_fidelity(name)
        out.append(
            {
                "name": name,
                "paper_rows": "; ".join(sorted(paper_rows)),
                "family": method_family(name) if known else "—",
                "paper": (METHODS.summary(name).paper or "—") if known else "—",
                "status": "registered" if known else "not registered",
                "fidelity": fid.text() if fid is not None else "—",
            }
        )
    return sorted(out, key=lambda r: (r["status"] != "registered", r["name"]))


def _paper_methods() -> int:
    from rich.table import Table

    rows = paper_methods()
    done = sum(r["status"] == "registered" for r in rows)
    table = Table(title=f"methods of the paper's tables: {done} of {len(rows)} registered")
    for col in ("jascl name", "rows in the paper's tables", "family", "source paper", "status", "fidelity"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["name"], r["paper_rows"], r["family"], r["paper"], r["status"], r["fidelity"])
    _console().print(table)
    return 0


def cmd_backbones(args: argparse.Namespace) -> int:
    from jascl.networks import BACKBONES

    return _list_registry(BACKBONES, "backbones")


def cmd_model_info(args: argparse.Namespace) -> int:
    from jascl.experiments.model_info import cmd_model_info as run

    return run(args)


def cmd_data_check(args: argparse.Namespace) -> int:
    """``jascl data check``: one line per problem and exit 2, or a per-session summary and exit 0."""
    from jascl.data.real import parse_root_args
    from jascl.protocols import get_protocol

    if args.coco or args.coco_o:
        return cmd_data_check_coco(args)
    if args.protocol is None:
        print(
            "jascl data check: error: give --protocol (or --coco JSON --images DIR, or --coco-o ROOT)", file=sys.stderr
        )
        return 2
    protocol = get_protocol(args.protocol)
    if args.seed is not None:
        protocol = dataclasses.replace(protocol, seed=args.seed)
    roots = parse_root_args(args.root)
    if protocol.task == "detection" and protocol.uses_datasets:  # COCO-format copies (coco-o)
        from jascl.data.detection_real import check_detection_protocol

        print(f"jascl data check: protocol {protocol.name} (seed {protocol.seed}, file {protocol.path})")
        problems = check_detection_protocol(protocol, roots, args.roots, args.cache_dir, echo=print)
        for line in problems:
            print(f"error: {line}")
        print(f"{len(problems)} problem(s) found" if problems else "no problems found")
        return 2 if problems else 0
    from jascl.data.check import check_protocol
    from jascl.data.heap import freed_memory_kept
    from jascl.engine.config import resolve_config
    from jascl.experiments.preflight import backbone_problem

    overrides = list(args.set or []) + ([f"backbone={args.backbone}"] if args.backbone else [])
    config = resolve_config(protocol.training, protocol.path, None, overrides)
    print(f"jascl data check: protocol {protocol.name} (seed {protocol.seed}, file {protocol.path})")
    with freed_memory_kept():  # each volume's arrays reuse the last one's pages (jascl.data.heap)
        report = check_protocol(
            protocol,
            roots,
            args.roots,
            args.cache_dir,
            echo=print,
            patch_size=config.patch_size,
            split_manifest=args.split_manifest,
        )
    if protocol.task == "segmentation":  # what the backbone needs of the patch every volume is padded to
        problem = backbone_problem(protocol, config)
        if problem is not None:
            report.problems.append(problem)
    for line in report.lines():
        print(line)
    return 0 if report.ok else 2


def cmd_data_prepare(args: argparse.Namespace) -> int:
    """``jascl data prepare``: fill the preprocessed store; exit 2 if any sample could not be prepared, 130 on Ctrl-C."""
    from jascl.data.prepare import prepare_protocol
    from jascl.data.real import parse_root_args
    from jascl.protocols import get_protocol

    protocol = get_protocol(args.protocol)
    print(f"jascl data prepare: protocol {protocol.name} (file {protocol.path})")
    progress = False if args.no_progress else None
    try:
        report = prepare_protocol(
            protocol,
            parse_root_args(args.root),
            args.roots,
            args.cache_dir,
            args.workers,
            echo=print,
            progress=progress,
            remove_outdated=args.remove_outdated,
        )
    except KeyboardInterrupt:  # Ctrl-C: the workers are ended and prepare said what is kept
        return 130
    for line in report.problems:
        print(f"error: {line}")
    rate = f" ({report.built / report.seconds:.2f} per second)" if report.built and report.seconds else ""
    print(
        f"prepared {report.built} sample(s) in {report.seconds:.1f} s{rate}, {report.complete} were complete; "
        f"{report.indexed} label file(s) indexed; worker peak memory {report.worker_peak_rss_mib:.0f} MiB; "
        f"store {report.store}"
    )
    print(f"{len(report.problems)} problem(s) found" if report.problems else "every sample is prepared")
    return 2 if report.problems else 0


def cmd_data_check_coco(args: argparse.Namespace) -> int:
    """``jascl data check --coco JSON --images DIR`` / ``--coco-o ROOT``: one line per defect and exit 2."""
    from jascl.data.coco import check_coco
    from jascl.data.coco_o import check_coco_o

    if args.protocol is not None or (args.coco is None) == (args.coco_o is None) or (args.coco and not args.images):
        print(
            "jascl data check: error: give --coco JSON with --images DIR, or --coco-o ROOT, and no --protocol",
            file=sys.stderr,
        )
        return 2
    expect = not args.allow_unannotated
    if args.coco_o:
        print(f"jascl data check: COCO-O copy at {args.coco_o}")
        problems = check_coco_o(args.coco_o, expect_annotations=expect)
    else:
        print(f"jascl data check: COCO-format split {args.coco} with images in {args.images}")
        problems = check_coco(args.coco, args.images, expect_annotations=expect)
    for line in problems:
        print(f"error: {line}")
    print(f"{len(problems)} problem(s) found" if problems else "no problems found")
    return 2 if problems else 0


def cmd_data_coco_o_classes(args: argparse.Namespace) -> int:
    """``jascl data coco-o-classes --root ROOT``: the base session's classes, their count, a warning if not 77."""
    from jascl.data.coco_o import BASE_CLASS_COUNT, COCO_CLASSES, base_classes

    names = base_classes(args.root)
    for name in names:
        print(name)
    print(f"{len(names)} base classes")
    foreign = [n for n in names if n not in COCO_CLASSES.values()]
    if foreign:
        print(f"warning: not COCO class names: {', '.join(foreign)}")
    if len(names) != BASE_CLASS_COUNT:
        print(f"warning: the paper's base session has {BASE_CLASS_COUNT} classes, this copy gives {len(names)}")
    return 0


def add_data_parser(subparsers) -> argparse.ArgumentParser:
    """``jascl data check|prepare --protocol NAME --root NAME=PATH ...``, ``data download`` and ``data list``."""
    data = subparsers.add_parser(
        "data",
        help="get the public datasets (download, list), check local copies against a protocol, or preprocess them",
    )
    data_sub = data.add_subparsers(dest="data_command", required=True)
    check = data_sub.add_parser(
        "check",
        help="open every file, check shapes / affines / label values, K-shot "
        "availability and unlabelled pools; exit 2 on any problem",
    )
    check.add_argument("--protocol", default=None, help="built-in protocol name or YAML path")
    add_root_arguments(check)
    check.add_argument("--seed", type=int, default=None, help="seed of the K-shot selection (default: the protocol's)")
    check.add_argument("--cache-dir", default=None, help="label-index cache (default $JASCL_CACHE or ~/.cache/jascl)")
    check.add_argument(
        "--split-manifest",
        default=None,
        metavar="FILE",
        help="check the samples of a run's manifest.json (as run --split-manifest uses them) instead of a new selection",
    )
    check.add_argument(
        "--backbone", default=None, help="the backbone the run will use (default: the protocol's), for its input sizes"
    )
    check.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="a run configuration key the check depends on, e.g. --set patch_size=[64,64,64]",
    )
    check.add_argument("--coco", default=None, metavar="JSON", help="check a COCO-format instances JSON instead")
    check.add_argument("--images", default=None, metavar="DIR", help="with --coco: the folder of its images")
    check.add_argument("--coco-o", default=None, metavar="ROOT", help="check every domain of a COCO-O copy instead")
    check.add_argument(
        "--allow-unannotated", action="store_true", help="with --coco / --coco-o: images without boxes are no defect"
    )
    check.set_defaults(func=cmd_data_check)
    prepare = data_sub.add_parser(
        "prepare",
        help="preprocess every sample of a protocol's datasets into the store that runs read, in parallel; resumable",
    )
    prepare.add_argument("--protocol", required=True, help="built-in protocol name or YAML path")
    add_root_arguments(prepare)
    prepare.add_argument(
        "--workers",
        type=int,
        default=None,
        metavar="N",
        help="worker processes (default: one per core, at most one per 3 GiB of memory)",
    )
    prepare.add_argument(
        "--cache-dir", default=None, help="cache folder runs read (default $JASCL_CACHE or ~/.cache/jascl)"
    )
    prepare.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    prepare.add_argument(
        "--remove-outdated",
        action="store_true",
        help="delete the store's entries made by an earlier version of the preprocessing (no run reads them; "
        "without this flag they are counted in a note)",
    )
    prepare.set_defaults(func=cmd_data_prepare)
    classes = data_sub.add_parser(
        "coco-o-classes", help="the COCO-O base session's classes (annotated in Painting, less person / car / bench)"
    )
    classes.add_argument("--root", required=True, help="the COCO-O root (the folder holding the six domains)")
    classes.set_defaults(func=cmd_data_coco_o_classes)
    add_data_getting_parsers(data_sub)
    return data


def add_model_info_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``model-info`` (kept here, free of torch imports, so the CLI starts fast)."""
    p = subparsers.add_parser(
        "model-info", help="parameters, FLOPs and training-step memory of backbones, with and without JASCL"
    )
    p.add_argument("backbone", help="registered backbone name, or 'all'")
    p.add_argument("--spatial-dims", type=int, default=None, help="2 or 3 (default: the backbone's paper-like setting)")
    p.add_argument(
        "--spatial-size", default=None, help="input size, e.g. 128x120x120 or 512 (repeated); default per backbone"
    )
    p.add_argument("--in-channels", type=int, default=None)
    p.add_argument("--num-classes", type=int, default=None, help="classifier rows incl. background")
    p.add_argument("--batch-size", type=int, default=2, help="images per training step for the memory figure")
    p.add_argument("--backbone-args", default=None, help='YAML/JSON mapping, e.g. "{encoder_name: resnet18}"')
    p.add_argument(
        "--device",
        default=None,
        choices=["cuda", "meta"],
        help="cuda: measured memory; meta: estimate (default: cuda if available)",
    )
    p.add_argument(
        "--time",
        type=int,
        default=0,
        metavar="N",
        help="also time N training steps (median, after 2 warm-up steps) with and without JASCL: the compute "
        "table's time column",
    )
    p.add_argument(
        "--time-device", default=None, help="where --time runs: cuda or cpu (default: cuda if available, else cpu)"
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_model_info)
    return p
