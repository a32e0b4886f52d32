"""The detection task (jascl.engine.tasks.detection) and PAS on boxes (jascl.methods.detection.pas): background boxes,
the dataset's flip, eq. 2 over box features, the box filter and eq. 5 on hand-made values, records, per-task
method registration, and a tiny end-to-end run that resumes bit-identically."""

import json
import math
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from jascl.data.sessions import load_sessions
from jascl.data.types import DetectionSplit, SessionData
from jascl.engine.config import resolve_config
from jascl.engine.loop import ContinualTrainer
from jascl.engine.plugin import Method, Plugin
from jascl.engine.tasks.detection import DetectionDataset, background_boxes, detection_collate, record_for
from jascl.errors import ConfigError
from jascl.experiments.runner import ensure_base, run_benchmark
from jascl.methods.detection.pas import box_consistency_loss, box_pas_filter, match_counts
from jascl.methods.registry import METHODS, create_method
from jascl.protocols import parse_protocol


def toy_detection_dict() -> dict:
    return {
        "name": "toy-det",
        "task": "detection",
        "seed": 5,
        "spatial_dims": 2,
        "synthetic": {"size": 32, "objects_per_image": [1, 2], "object_radius": [0.2, 0.3], "distractors": 1},
        "classes": [
            {"id": 0, "name": "background"},
            {"id": 1, "name": "disc", "shape": "disc"},
            {"id": 2, "name": "square", "shape": "square"},
            {"id": 3, "name": "cross", "shape": "cross"},
        ],
        "domains": {"a": {"appearance": {"class_intensity": [0.5, 0.9]}}, "b": {"appearance": {"invert": True}}},
        "sessions": [
            {"name": "base", "domains": ["a"], "new_classes": [1, 2], "shots": "all", "train": 8, "test": 4},
            {"name": "inc", "domains": ["b"], "new_classes": [3], "shots": 2, "unlabelled": 4, "test": 4},
        ],
        "training": {
            "backbone": "fasterrcnn-small",
            "epochs_base": 1,
            "epochs_incremental": 2,
            "batch_size": 4,
            "augment": True,
            "pas": {"start_epoch": 0, "every": 1, "tau_conf": 0.0, "tau_sim": 0.0, "weight": 1.0},
        },
    }


@pytest.fixture(scope="module")
def toy_det(tmp_path_factory):
    protocol = parse_protocol(toy_detection_dict(), source="toy-det.yaml")
    config = resolve_config(protocol.training, "toy-det.yaml")
    root = tmp_path_factory.mktemp("toy-det")
    data = load_sessions(protocol, root / "cache", echo=lambda *a: None)
    ensure_base(protocol, config, data, root / "base", progress=False, echo=lambda *a: None)
    return protocol, config, data, root


def test_background_boxes_by_hand():
    # side 4, stride 2 on an 8x8 image: 9 grid boxes; against [0,0,4,4] the IoUs are 1, 1/3, 0 (row 0), 1/3, 1/7, 0, ...
    boxes = background_boxes(8, 8, torch.tensor([[0.0, 0.0, 4.0, 4.0]]), fractions=(0.5,))
    got = {tuple(int(v) for v in b) for b in boxes}
    every = {(x, y, x + 4, y + 4) for y in (0, 2, 4) for x in (0, 2, 4)}
    assert got == every - {(0, 0, 4, 4), (2, 0, 6, 4), (0, 2, 4, 6)}
    assert len(background_boxes(8, 8, torch.zeros(0, 4), fractions=(0.5,))) == 9


def test_dataset_keeps_the_taught_boxes_and_flips_them_with_the_image():
    image = np.arange(24, dtype=np.float32).reshape(1, 4, 6)
    target = {"boxes": np.array([[1, 0, 3, 2], [0, 0, 6, 4]], np.float32), "labels": np.array([2, 1], np.int64)}
    split = DetectionSplit(np.stack([image] * 8), [target] * 8, [f"s{i}" for i in range(8)])
    plain = DetectionDataset(split, taught=[2])[0]
    assert plain["labels"].tolist() == [2] and plain["boxes"].tolist() == [[1, 0, 3, 2]]
    flips = 0
    for i in range(8):
        item = DetectionDataset(split, taught=[2], augment=True, seed=1)[(0, i)]
        if torch.equal(item["image"], torch.from_numpy(image).flip(-1)):
            flips += 1
            assert item["boxes"].tolist() == [[3, 0, 5, 2]]  # x -> 6 - x
        else:
            assert torch.equal(item["image"], torch.from_numpy(image)) and item["boxes"].tolist() == [[1, 0, 3, 2]]
    assert 0 < flips < 8
    batch = detection_collate([plain, plain])
    assert len(batch["image"]) == 2 and batch["targets"][1]["labels"].tolist() == [2]


class BoxSizeFeatures(nn.Module):
    """A stand-in detector whose box feature is (width, height, 1)."""

    feature_channels = 3

    def box_features(self, images, boxes):
        return [torch.stack([b[:, 2] - b[:, 0], b[:, 3] - b[:, 1], torch.ones(len(b))], dim=1) for b in boxes]


def test_prototypes_are_eq2_over_box_features(toy_det):
    protocol, config, data, _ = toy_det
    trainer = ContinualTrainer(protocol, config, Method("vanilla"), data, progress=False)
    targets = [
        {"boxes": np.array([[0, 0, 4, 2], [8, 8, 16, 16]], np.float32), "labels": np.array([1, 2], np.int64)},
        {"boxes": np.array([[0, 0, 2, 2]], np.float32), "labels": np.array([1], np.int64)},
    ]
    split = DetectionSplit(np.zeros((2, 1, 16, 16), np.float32), targets, ["a", "b"])
    trainer.data[0] = SessionData(protocol.sessions[0], split, split)  # the task sees the same list
    protos = trainer.compute_prototypes(BoxSizeFeatures(), 0, [1, 2])
    # eq. 2: per image the mean feature of its class-c boxes, unit-normalised, then averaged over the images
    a = torch.tensor([4.0, 2.0, 1.0]) / math.sqrt(21)
    b = torch.tensor([2.0, 2.0, 1.0]) / 3
    assert torch.allclose(protos[1], (a + b) / 2, atol=1e-6)
    assert torch.allclose(protos[2], torch.tensor([8.0, 8.0, 1.0]) / math.sqrt(129), atol=1e-6)
    # the complement of class 2: its image's other boxes (the class-1 box and the background boxes), one sample
    bg = background_boxes(16, 16, torch.tensor(targets[0]["boxes"]))
    others = torch.cat([torch.tensor([[4.0, 2.0, 1.0]]), BoxSizeFeatures().box_features(None, [bg])[0]])
    complement = trainer.compute_prototypes(BoxSizeFeatures(), 0, [2], complement=True)
    assert torch.allclose(complement[2], F.normalize(others.mean(0), dim=0), atol=1e-6)


def test_box_pas_filter_by_hand():
    scores = torch.tensor([0.9, 0.9, 0.5])
    labels = torch.tensor([1, 2, 1])
    features = torch.tensor([[2.0, 0.0], [1.0, 0.0], [1.0, 0.0]])
    prototypes = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.0, 1.0]])  # rows: background, class row 1, class row 2
    f = box_pas_filter(scores, labels, features, prototypes, tau_conf=0.7, tau_sim=0.7)
    assert f.sim.tolist() == [1.0, 0.0, 1.0]
    assert f.keep.tolist() == [True, False, False]  # box 1: dissimilar to its class; box 2: not confident
    assert f.confident.tolist() == [True, True, False]
    conf_only = box_pas_filter(scores, labels, features, None, tau_conf=0.7, tau_sim=0.7)
    assert conf_only.keep.tolist() == [True, True, False]


def test_box_consistency_loss_by_hand():
    student = torch.zeros(1, 2, requires_grad=True)
    teacher = torch.tensor([[math.log(3.0), 0.0]])  # softmax (0.75, 0.25) against the student's (0.5, 0.5)
    loss = box_consistency_loss(student, teacher)
    assert loss.item() == pytest.approx(0.25**2 + 0.25**2)
    loss.backward()
    assert student.grad is not None and student.grad[0, 0] < 0  # pulled towards the teacher's class
    empty = box_consistency_loss(torch.zeros(0, 2, requires_grad=True), torch.zeros(0, 2))
    assert empty.item() == 0.0 and empty.requires_grad


def test_match_counts_by_hand():
    truth = torch.tensor([[0.0, 0.0, 10.0, 10.0]]), torch.tensor([3])
    boxes = torch.tensor([[0.0, 0.0, 10.0, 8.0], [0.0, 0.0, 10.0, 10.0], [20.0, 20.0, 30.0, 30.0]])
    assert match_counts(boxes, torch.tensor([3, 1, 3]), *truth) == (1, 3)  # IoU 0.8 same class; wrong class; miss
    assert match_counts(boxes, torch.tensor([3, 1, 3]), torch.zeros(0, 4), torch.zeros(0, dtype=torch.long)) == (0, 0)


def test_record_means_over_the_seen_classes(toy_det):
    protocol = toy_det[0]
    result = {"map": 0.3, "map_50": 0.6, "per_class": {1: 0.5, 2: math.nan, 3: 0.2}}
    record = record_for(protocol, 1, [0, 1, 2, 3], result, {"boxes": {1: 4, 3: 2}, "images": {1: 3, 3: 2}})
    assert record["old"] == 0.5 and record["new"] == 0.2 and record["all"] == pytest.approx(0.35)
    assert record["base"] == 0.5 and record["hm"] == pytest.approx(2 * 0.5 * 0.2 / 0.7)
    assert record["support"] == {"1": 4, "2": 0, "3": 2} and record["map_50"] == 0.6


def test_methods_without_a_detection_implementation_are_refused_in_one_line():
    config = resolve_config({}, "x.yaml")
    assert {"vanilla", "jascl", "jascl-no-gas", "jascl-no-pas"} <= set(METHODS.task_methods("detection"))
    with pytest.raises(ConfigError, match=r"method 'plop' has no detection implementation.*detection methods: "):
        create_method("plop", config, "detection")
    with pytest.raises(ConfigError, match="'gaps' has no detection"):
        create_method("jascl+gaps", config, "detection")
    assert [type(p).__name__ for p in create_method("jascl", config, "detection").plugins] == [
        "StochasticBasePlugin",
        "GASPlugin",
        "PrototypeReplayPlugin",
        "DetectionMeanTeacherPlugin",
    ]


class Losses(Plugin):
    """Records each session-1 step's loss terms."""

    name = "losses"

    def __init__(self):
        self.seen: dict[str, float] = {}

    def after_forward(self, state):
        if state.session.index == 1:
            for key, value in state.losses.items():
                self.seen[key] = max(self.seen.get(key, 0.0), float(value.detach()))


class Stop(Exception):
    pass


class StopBefore(Plugin):
    name = "stop"

    def before_epoch(self, state):
        if state.session.index == 1 and state.epoch == 1:
            raise Stop


def _run(protocol, config, method, out, root, *plugins):
    return run_benchmark(
        protocol, config, [method], out, cache_dir=root / "cache", progress=False, echo=lambda *a: None,
        extra_plugins=plugins,
    )  # fmt: skip


def test_jascl_trains_every_term_on_boxes_and_resumes_bit_identically(toy_det, tmp_path):
    protocol, config, _, root = toy_det
    reference, broken = tmp_path / "reference", tmp_path / "broken"
    for out in (reference, broken):
        shutil.copytree(root / "base", out / "base")
    probe = Losses()
    config = resolve_config(protocol.training, "toy-det.yaml", overrides=["method_args.jascl.base=shared"])
    expected = _run(protocol, config, "jascl", reference, root, probe)
    assert set(probe.seen) == {"det", "proto", "cons"} and all(v > 0 for v in probe.seen.values())
    session = expected["methods"]["jascl"]["sessions"][1]
    assert session["pseudo_labels"]["teacher_boxes"] > 0 and session["pseudo_labels"]["filter"] == "pas"
    assert set(session["per_class"]) == {"1", "2", "3"} and math.isfinite(session["map"])
    with pytest.raises(Stop):
        _run(protocol, config, "jascl", broken, root, StopBefore())
    assert (broken / "jascl" / "s1-inc" / "progress.safetensors").exists()
    resumed = _run(protocol, config, "jascl", broken, root)
    assert json.dumps(resumed, sort_keys=True) == json.dumps(expected, sort_keys=True)
    a = load_file(reference / "jascl" / "s1-inc" / "model.safetensors")
    b = load_file(broken / "jascl" / "s1-inc" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert a["roi_heads.box_predictor.classifier.weight"].shape[0] == 4  # background + 3 classes, no GAS leftovers


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"task": "boxes"}, r"toy-det.yaml: task: must be one of segmentation, detection \(got 'boxes'\)"),
        ({"metric": "dice"}, r"toy-det.yaml: task: detection protocols are 2D and scored with metric 'map'"),
        ({"unlabelled_noise": "heavy"}, r"toy-det.yaml: unlabelled_noise: degrades dense labels' boundaries"),
        ({"task": "segmentation", "metric": "map"}, r"toy-det.yaml: metric: 'map' scores boxes: set task: detection"),
    ],
)
def test_the_task_key_is_checked_in_one_line(change, message):
    spec = {**toy_detection_dict(), **change}
    with pytest.raises(ConfigError, match=message):
        parse_protocol(spec, source="toy-det.yaml")
    assert parse_protocol(toy_detection_dict(), source="toy-det.yaml").metric == "map"


def test_a_detection_sessions_model_and_tables_read_back_from_its_folder(toy_det):
    from jascl.engine.checkpoint import read_session_model
    from jascl.networks.detector import Detector
    from jascl.results.report import session_detail_table

    protocol, config, data, root = toy_det
    model = read_session_model(root / "base", protocol, config, 0)
    trainer = ContinualTrainer(protocol, config, Method("vanilla"), data, progress=False)
    loaded, _, record = trainer.load_session(root / "base", 0)
    assert isinstance(model, Detector) and not model.training and model.num_classes == 3
    own, other = model.state_dict(), loaded.state_dict()
    assert own.keys() == other.keys() and all(torch.equal(own[k], other[k].cpu()) for k in own)
    bad = resolve_config(protocol.training, "toy-det.yaml", overrides=["backbone=unet"])
    with pytest.raises(ConfigError, match=r"^backbone='unet': a detection protocol trains a detector; choose one of"):
        read_session_model(root / "base", protocol, bad, 0)
    results = {"metric": "map", "protocol": "toy-det", "methods": {"base": {"sessions": [record], "total_drop": 0.0}}}
    header, rows = session_detail_table(results, "base")
    assert header[-1] == "Base" and len(rows[0]) == len(header)  # no background column for a detector


def test_a_box_without_area_is_a_one_line_error_naming_the_sample():
    from jascl.errors import DataError

    target = {"boxes": np.array([[3, 1, 3, 4]], np.float32), "labels": np.array([1], np.int64)}
    split = DetectionSplit(np.zeros((1, 1, 6, 6), np.float32), [target], ["mine/0007"])
    with pytest.raises(DataError, match=r"^sample mine/0007: box \[3.0, 1.0, 3.0, 4.0\] has no area") as info:
        DetectionDataset(split, taught=[1])[0]
    assert "\n" not in str(info.value)


def test_per_sample_anchors_are_refused_on_boxes():
    config = resolve_config({}, "x.yaml", overrides=["method_args.jascl.pas.anchors=per-sample"])
    with pytest.raises(ConfigError, match=r"^method_args.jascl.pas.anchors=per-sample: PAS on boxes compares"):
        create_method("jascl", config, "detection")
    assert create_method("jascl-no-pas", config, "detection").name == "jascl-no-pas"  # no teacher: nothing refused
