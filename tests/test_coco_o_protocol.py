"""The built-in ``coco-o`` detection protocol and its sessions assembled from a COCO-O copy
(``jascl.data.detection_real``), on a tiny fixture written in COCO-O's layout (``<root>/<domain>/annotations/
instances_val2017.json`` beside ``<root>/<domain>/val2017/``) with hand-written boxes."""

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from jascl.cli import main
from jascl.data.coco_o import ANNOTATIONS, DOMAINS, IMAGES
from jascl.data.detection_real import draw_per_class, hold_out_test, load_detection_datasets
from jascl.data.real import manifest_dict
from jascl.errors import ConfigError, DataError
from jascl.protocols import builtin_protocols, get_protocol, parse_protocol

W, H = 8, 6
CATEGORIES = {1: "person", 3: "car", 15: "bench", 17: "cat", 18: "dog"}
GLOBAL = {"person": 1, "car": 3, "bench": 14, "cat": 16, "dog": 17}  # the protocol's ids (COCO order, 1..80)

# image id -> [(category name, [x, y, w, h], iscrowd)]
PAINTING = {
    **{i: [("cat", [1, 1, 3, 2], 0)] for i in range(1, 5)},
    **{i: [("dog", [0, 2, 4, 3], 0)] for i in range(5, 9)},
    9: [("cat", [0, 0, 2, 2], 0), ("dog", [4, 3, 4, 3], 0)],
    10: [("person", [2, 0, 3, 6], 0), ("cat", [5, 1, 2, 2], 0)],
    11: [("dog", [6, 4, 2.5, 2.5], 0)],  # half a pixel past the 8 x 6 image (within the check's tolerance): clipped
}
WEATHER = {
    **{i: [("person", [1, 0, 2, 5], 0)] for i in range(101, 109)},
    **{i: [("car", [0, 3, 6, 3], 0)] for i in range(111, 119)},
    **{i: [("bench", [2, 2, 5, 2], 0)] for i in range(121, 127)},
    131: [("person", [0, 0, 2, 4], 0), ("car", [3, 2, 5, 4], 0)],
    132: [("person", [6, 0, 2, 6], 0), ("car", [0, 4, 4, 2], 0)],
    141: [("person", [0, 0, 8, 6], 1), ("car", [1, 1, 2, 2], 0)],  # a crowd person: shows only a car
    151: [("bench", [0, 0, 3, 3], 0), ("cat", [4, 2, 3, 3], 0)],  # a base class in Weather
}
SHOWS = {  # image -> classes it shows (non-crowd), for the per-class checks
    d: {i: {GLOBAL[n] for n, _, crowd in rows if not crowd} for i, rows in boxes.items()}
    for d, boxes in (("painting", PAINTING), ("weather", WEATHER))
}


def write_domain(folder: Path, boxes: dict[int, list]) -> None:
    """One COCO-format domain; image ``i`` is filled with the value ``i % 25 * 10``."""
    (folder / IMAGES).mkdir(parents=True)
    (folder / ANNOTATIONS).parent.mkdir(parents=True)
    images, annotations = [], []
    ids = {n: c for c, n in CATEGORIES.items()}
    for i, rows in boxes.items():
        images.append({"id": i, "file_name": f"{i:012d}.png", "width": W, "height": H})
        Image.fromarray(np.full((H, W, 3), i % 25 * 10, np.uint8)).save(folder / IMAGES / f"{i:012d}.png")
        for name, bbox, crowd in rows:
            annotations.append(
                {"id": len(annotations) + 1, "image_id": i, "category_id": ids[name], "bbox": bbox, "iscrowd": crowd}
            )
    categories = [{"id": c, "name": n} for c, n in CATEGORIES.items()]
    (folder / ANNOTATIONS).write_text(
        json.dumps({"images": images, "annotations": annotations, "categories": categories})
    )


@pytest.fixture
def coco_o_root(tmp_path):
    root = tmp_path / "ood_coco"
    write_domain(root / "painting", PAINTING)
    write_domain(root / "weather", WEATHER)
    for domain in DOMAINS:
        if domain not in ("painting", "weather"):
            write_domain(root / domain, {1: [("cat", [0, 0, 2, 2], 0)]})
    return root


def tiny_mapping(**unlabelled) -> dict:
    """The built-in coco-o with counts that fit the fixture: 2 shots, 1 / 2 / 1 unlabelled, 1 validation image."""
    d = yaml.safe_load(builtin_protocols()["coco-o"].read_text())
    d = copy.deepcopy(d)
    counts = unlabelled or {"person": 1, "car": 2, "bench": 1}
    d["datasets"]["weather"]["options"]["unlabelled"] = counts
    d["sessions"][0]["validation"] = 1
    d["sessions"][1].update(shots=2, unlabelled=sum(counts.values()), validation=1)
    return d


def tiny(seed: int = 1024):
    d = tiny_mapping()
    d["seed"] = seed
    return parse_protocol(d, "coco-o.yaml", "coco-o")


def expected_target(domain: str, image_id: int, measured: set[int] | None) -> dict[str, list]:
    """The hand-written boxes as xyxy clipped to the image; ``measured`` given: with iscrowd (ignore regions)."""
    rows = [(n, b, c) for n, b, c in (PAINTING if domain == "painting" else WEATHER)[image_id]]
    if measured is None:
        rows = [r for r in rows if not r[2]]
    out = {
        "boxes": [[b[0], b[1], min(b[0] + b[2], W), min(b[1] + b[3], H)] for _, b, _ in rows],
        "labels": [GLOBAL[n] for n, _, _ in rows],
    }
    if measured is not None:
        out["iscrowd"] = [int(c or GLOBAL[n] not in measured) for n, _, c in rows]
    return out


def load(protocol, root, messages=None, **kw):
    return load_detection_datasets(
        protocol, {"coco_o": root}, echo=(messages.append if messages is not None else lambda m: None), **kw
    )


def test_builtin_coco_o_protocol():
    p = get_protocol("coco-o")
    assert p.task == "detection" and p.metric == "map" and p.in_channels == 3 and p.spatial_dims == 2
    assert [c.id for c in p.classes] == list(range(81)) and p.classes[0].name == "background"
    assert (p.class_name(1), p.class_name(3), p.class_name(14), p.class_name(80)) == (
        "person",
        "car",
        "bench",
        "toothbrush",
    )
    base, weather = p.sessions
    assert len(base.new_classes) == 77 and not {1, 3, 14} & set(base.new_classes)
    assert set(base.new_classes) | {1, 3, 14} == set(range(1, 81))
    assert base.domains == ("painting",) and base.shots is None
    assert weather.domains == ("weather",) and weather.new_classes == (1, 3, 14) and weather.shots == 30
    assert weather.unlabelled == 41 + 224 + 174 and weather.validation == 10
    assert dict(p.datasets["weather"].options["unlabelled"]) == {"bench": 41, "car": 224, "person": 174}
    assert {s.layout for s in p.datasets.values()} == {"coco-o"} and {s.root for s in p.datasets.values()} == {"coco_o"}
    assert p.datasets["painting"].labels["bench"] == 14  # labels by category name, filled in for COCO layouts
    # 1000 iterations x 16 images x 1/5 labelled / 90 labelled images = 35.6 passes
    assert p.training["epochs_incremental"] == 36 and p.training["lr_incremental"] == 0.01
    assert p.training["backbone"] == "fasterrcnn-resnet50-fpn"


def test_per_class_unlabelled_counts_are_checked_on_load():
    d = tiny_mapping()
    d["sessions"][1]["unlabelled"] = 5
    with pytest.raises(ConfigError, match=r"^coco-o.yaml: sessions\[1\]\.unlabelled: must be 4, the sum"):
        parse_protocol(d, "coco-o.yaml")
    d = tiny_mapping()
    d["datasets"]["weather"]["options"]["unlabelled"]["cat"] = 3  # not taught from weather
    with pytest.raises(ConfigError, match=r"datasets\.weather\.options\.unlabelled\.cat: is not a class"):
        parse_protocol(d, "coco-o.yaml")
    d = tiny_mapping()
    d["datasets"]["weather"]["layout"] = "idd"  # not a COCO layout: labels stay required
    with pytest.raises(ConfigError, match=r"datasets\.weather\.labels: is required"):
        parse_protocol(d, "coco-o.yaml")


def test_selection_helpers_by_hand():
    shows = {"a": {1}, "b": {1, 2}, "c": {2}, "d": {2}, "e": {1}}.__getitem__
    # class 1: a, b, e (3 -> round(0.6) = 1); class 2: b, c, d (3 -> 1); rarest first (tie: id 1): a, then 2 takes b
    assert hold_out_test(list("abcde"), shows, 0.2) == ["a", "b"]
    # 0.9: round(2.7) = 3 capped at n_c - 1 = 2: class 1 holds a, b; class 2 has b already, adds c
    assert hold_out_test(list("abcde"), shows, 0.9) == ["a", "b", "c"]
    # an image held for class 1 would take class 2's only image: passed over (class 1 takes its next image)
    lone = {"a": {1, 2}, "b": {1}, "c": {1}, "d": {1}}.__getitem__
    assert hold_out_test(list("abcd"), lone, 0.5) == ["b", "c"]
    taken = {"a"}
    drawn, short = draw_per_class(list("abcde"), shows, {1: 2, 2: 2}, taken)
    # both classes have 3 candidates not taken... class 1: b, e (a taken); class 2 then c, d (b drawn for 1)
    assert drawn == {1: ["b", "e"], 2: ["c", "d"]} and short == {1: 0, 2: 0} and taken == set("abcde")
    drawn, short = draw_per_class(list("abcde"), shows, {2: 1}, {"b", "c", "d"})
    assert drawn == {2: []} and short == {2: 1}


def test_sessions_counts_disjoint_and_boxes_equal_the_fixture(coco_o_root):
    messages: list[str] = []
    p = tiny()
    data = load(p, coco_o_root, messages)
    base, weather = data
    # one warning listing the base classes Painting does not annotate (all but cat and dog)
    warnings = [m for m in messages if m.startswith("warning: ")]
    assert len(warnings) == 1 and "have no annotation in dataset painting" in warnings[0]
    assert "bicycle" in warnings[0] and "toothbrush" in warnings[0] and "cat," not in warnings[0]
    # weather: 2 shots x 3 classes, pools 1 / 2 / 1, 1 validation image per class; test held out per class
    assert (len(weather.train), len(weather.unlabelled), len(weather.validation)) == (6, 4, 3)
    # held out per class, rarest first: bench (7 images) round(1.4) = 1, person (10) 2, car (11: 141's crowd
    # person does not count) 2 -- images held for one class count for the others they show
    held = [SHOWS["weather"][int(r.split("/")[1])] for r in weather.test.ids]
    assert sum(14 in s for s in held) == 1 and sum(1 in s for s in held) >= 2 and sum(3 in s for s in held) >= 2
    assert len(held) <= 5 and all(s & {1, 3, 14} for s in held)
    ids = lambda split: [int(r.split("/")[1]) for r in split.ids]  # noqa: E731
    for k, c in enumerate((1, 3, 14)):  # drawn per class in the session's order: person, car, bench
        assert all(c in SHOWS["weather"][i] for i in ids(weather.train)[2 * k : 2 * k + 2])
        assert all(c in SHOWS["weather"][i] for i in ids(weather.validation)[k : k + 1])
    pool = ids(weather.unlabelled)
    assert 1 in SHOWS["weather"][pool[0]] and {3} <= SHOWS["weather"][pool[1]] & SHOWS["weather"][pool[2]]
    assert 14 in SHOWS["weather"][pool[3]]
    # base: every painting image is test, validation or training; 1 test image per class of 5-6 images
    assert sorted(ids(base.train) + ids(base.validation) + ids(base.test)) == list(range(1, 12))
    # cat (6 images) and dog (6) each round(1.2) = 1 test image (image 9 shows both)
    held = [SHOWS["painting"][int(r.split("/")[1])] for r in base.test.ids]
    assert base.unlabelled is None and len(held) <= 2 and any(16 in s for s in held) and any(17 in s for s in held)
    # no image in two splits of any session
    every = [r for d in data for s in (d.train, d.test, d.unlabelled, d.validation) if s is not None for r in s.ids]
    assert len(every) == len(set(every))
    # boxes and labels: the hand-written ones; evaluation splits mark other classes and crowds as ignore
    for d, domain, measured in ((base, "painting", set(p.sessions[0].new_classes)), (weather, "weather", {1, 3, 14})):
        for name in ("train", "unlabelled", "validation", "test"):
            split = getattr(d, name)
            if split is None:
                continue
            for i, target in zip(ids(split), split.targets):
                want = expected_target(domain, i, measured if name in ("test", "validation") else None)
                assert {k: v.tolist() for k, v in target.items()} == want, (name, i)
                assert target["boxes"].dtype == np.float32 and target["labels"].dtype == np.int64
    image = weather.train.images[0]
    assert image.shape == (3, H, W) and image.dtype == np.float32
    assert np.allclose(image, ids(weather.train)[0] % 25 * 10 / 255)
    assert len(weather.train.images[0:2]) == 2


def test_selection_is_deterministic_and_the_manifest_round_trips(coco_o_root, tmp_path):
    p = tiny()
    first, again = load(p, coco_o_root), load(p, coco_o_root)
    splits = ("train", "test", "unlabelled", "validation")
    ids = lambda data: [[getattr(d, s).ids if getattr(d, s) else None for s in splits] for d in data]  # noqa: E731
    assert ids(first) == ids(again)
    other = load(tiny(seed=7), coco_o_root)
    assert [d.test.ids for d in other] == [d.test.ids for d in first]  # the test hold-out ignores the seed
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(manifest_dict(p, first, {"coco_o": coco_o_root})))
    assert ids(load(tiny(seed=7), coco_o_root, split_manifest=path)) == ids(first)
    # a manifest chooses the images: move three with ignore regions into the tests
    m = json.loads(path.read_text())
    for t, ref in ((0, "painting/10"), (1, "weather/141"), (1, "weather/151")):
        for split in ("train", "unlabelled", "validation", "test"):
            if ref in (m["sessions"][t].get(split) or []):
                m["sessions"][t][split].remove(ref)
        m["sessions"][t]["test"].append(ref)
    path.write_text(json.dumps(m))
    base, weather = load(p, coco_o_root, split_manifest=path)
    tests = {r: t for d in (base, weather) for r, t in zip(d.test.ids, d.test.targets)}
    simple = {r: {k: v.tolist() for k, v in tests[r].items()} for r in ("painting/10", "weather/141", "weather/151")}
    assert simple["painting/10"] == {"boxes": [[2, 0, 5, 6], [5, 1, 7, 3]], "labels": [1, 16], "iscrowd": [1, 0]}
    assert simple["weather/141"] == {"boxes": [[0, 0, 8, 6], [1, 1, 3, 3]], "labels": [1, 3], "iscrowd": [1, 0]}
    assert simple["weather/151"] == {"boxes": [[0, 0, 3, 3], [4, 2, 7, 5]], "labels": [14, 16], "iscrowd": [0, 1]}
    # a manifest from another copy: an image this copy lacks is one line naming the --root fix
    m = json.loads(path.read_text())
    m["sessions"][1]["train"][0] = "weather/999"
    path.write_text(json.dumps(m))
    with pytest.raises(DataError) as info:
        load(p, coco_o_root, split_manifest=path)
    message = str(info.value)
    assert "\n" not in message and "sessions[1].train: image weather/999 is not in" in message
    assert "--root coco_o" in message


def test_missing_root_is_one_line(coco_o_root, tmp_path, monkeypatch):
    monkeypatch.delenv("JASCL_ROOT_COCO_O", raising=False)
    p = tiny()
    with pytest.raises(DataError) as info:
        load_detection_datasets(p, None, echo=lambda m: None)
    message = str(info.value)
    assert "\n" not in message and "dataset root 'coco_o'" in message and "--root coco_o=PATH" in message
    with pytest.raises(DataError, match=r"is not a folder; pass --root coco_o=PATH") as info:
        load(p, tmp_path / "nowhere")
    assert "\n" not in str(info.value)


def test_shots_beyond_the_data_are_one_line(coco_o_root):
    d = tiny_mapping()
    d["sessions"][1]["shots"] = 7  # bench: 7 images, 1 held out for the test
    with pytest.raises(DataError, match=r"class bench is shown by only 6 training image\(s\) of dataset weather"):
        load(parse_protocol(d, "coco-o.yaml"), coco_o_root)


def test_cli_data_check_on_the_protocol(coco_o_root, tmp_path, capsys):
    path = tmp_path / "coco-o.yaml"
    path.write_text(yaml.safe_dump(tiny_mapping()))
    assert main(["data", "check", "--protocol", str(path), "--root", f"coco_o={coco_o_root}"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "no problems found" and any("session 1 (weather): 6 train, 4 unlabelled" in line for line in out)
    (coco_o_root / "weather" / IMAGES / f"{101:012d}.png").unlink()
    assert main(["data", "check", "--protocol", str(path), "--root", f"coco_o={coco_o_root}"]) == 2
    errors = [line for line in capsys.readouterr().out.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "image file missing" in errors[0]


def test_jascl_run_on_the_coco_o_layout_end_to_end(coco_o_root, tmp_path):
    """``jascl run --protocol coco-o`` on the fixture, one epoch per session, the small detector: every method of
    the paper's detection table trains both sessions and is scored with mAP; JASCL's teacher reports its boxes."""
    path = tmp_path / "coco-o.yaml"
    path.write_text(yaml.safe_dump(tiny_mapping()))
    out = tmp_path / "run"
    sets = ["epochs_base=1", "epochs_incremental=1", "backbone=fasterrcnn-small", "batch_size=4", "threads=1"]
    argv = ["run", "--protocol", str(path), "--root", f"coco_o={coco_o_root}", "--out", str(out), "--no-progress"]
    argv += ["--methods", "vanilla,jascl,jascl-no-gas,jascl-no-pas"] + [a for s in sets for a in ("--set", s)]
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["metric"] == "map" and set(results["methods"]) == {
        "vanilla",
        "jascl",
        "jascl-no-gas",
        "jascl-no-pas",
    }
    for method in results["methods"].values():
        s0, s1 = method["sessions"]
        assert set(s0["per_class"]) == {str(c) for c in range(1, 81) if c not in (1, 3, 14)}  # the 77 base classes
        assert set(s1["per_class"]) == {str(c) for c in range(1, 81)} and s1["selection"]["mode"] == "best_val_new"
    assert results["methods"]["jascl"]["sessions"][1]["pseudo_labels"]["filter"] == "pas"
    assert "pseudo_labels" not in results["methods"]["jascl-no-pas"]["sessions"][1]
