"""Protocol YAML schema: the built-in protocols load, malformed ones fail with one clear line."""

from __future__ import annotations

import copy
import dataclasses
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from jascl.cli import main
from jascl.errors import ConfigError
from jascl.protocols import builtin_protocols, get_protocol, load_protocol, parse_protocol

SYNTHETIC_2D = builtin_protocols()["synthetic-2d"]


def _base() -> dict[str, Any]:
    return yaml.safe_load(SYNTHETIC_2D.read_text())


def _write(tmp_path: Path, data: Any) -> Path:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _assert_one_line(message: str, key: str) -> None:
    assert "\n" not in message, message
    assert message.startswith("bad.yaml:"), message
    assert key in message, message


# --------------------------------------------------------------------------- built-ins


def test_builtin_protocols_are_listed_and_all_load():
    builtins = builtin_protocols()
    assert {"synthetic-2d", "synthetic-3d"} <= set(builtins)
    for name, path in builtins.items():
        assert path.suffix == ".yaml"
        p = load_protocol(path)
        assert p.name == name
        assert p.path == path.name
        assert p.classes[0].id == 0
        assert p.sessions[0].is_base and p.sessions[0].index == 0
        assert [s.index for s in p.sessions] == list(range(len(p.sessions)))
        if p.uses_datasets:  # the paper's benchmarks: public datasets, no generator
            assert p.synthetic is None and all(s.sources for s in p.sessions)
        else:
            assert p.synthetic is not None and len(p.synthetic.size) == p.spatial_dims
        # get_protocol by built-in name gives the same protocol
        assert get_protocol(name) == p


def test_synthetic_2d_facts():
    p = get_protocol("synthetic-2d")
    assert p.spatial_dims == 2
    assert p.in_channels == 1
    assert p.seed == 1024
    assert len(p.sessions) == 4
    assert [c.id for c in p.classes] == list(range(10))
    assert p.classes[0].name == "background" and p.classes[0].shape is None
    assert p.class_name(9) == "frame"
    with pytest.raises(KeyError):
        p.class_name(42)
    assert set(p.domains) == {"ct", "mri", "us", "xray"}
    assert p.domains["xray"].appearance["invert"] is True
    assert p.synthetic.size == (64, 64)

    assert [s.name for s in p.sessions] == ["base", "mri", "us", "xray"]
    assert [s.domains for s in p.sessions] == [("ct",), ("mri",), ("us",), ("xray",)]
    assert [s.shots for s in p.sessions] == [None, 5, 5, 5]
    assert p.sessions[0].train == 160
    assert p.sessions[0].num_labelled == 160
    assert p.sessions[1].new_classes == (5, 6)
    assert p.sessions[1].num_labelled == 10  # 5 shots x 2 classes
    assert p.sessions[3].new_classes == (9,)
    assert p.sessions[3].recurring_classes == (1, 2)
    assert p.sessions[3].classes == (9, 1, 2)
    assert p.sessions[3].num_labelled == 15  # 5 shots x (1 new + 2 recurring)
    assert [s.recurring_classes for s in p.sessions[:3]] == [(), (), ()]
    assert all(s.other_classes == "background" and s.source == "synthetic" for s in p.sessions)

    assert p.base_classes() == [1, 2, 3, 4]
    assert p.seen_classes(0) == [0, 1, 2, 3, 4]
    assert p.seen_classes(2) == [0, 1, 2, 3, 4, 5, 6, 7, 8]
    # recurring classes do not add to the seen set
    assert p.seen_classes(3) == list(range(10))
    assert isinstance(p.training, dict) and p.training["backbone"] == "unet"


def test_synthetic_3d_facts():
    p = get_protocol("synthetic-3d")
    assert p.spatial_dims == 3
    assert p.synthetic.size == (32, 32, 32)
    assert p.sessions[-1].recurring_classes == (1,)


def test_synthetic_3d_trains_its_base_and_weighs_replay_as_measured():
    # docs/method.md, "New classes under prototype replay": with 25 base epochs (base Dice 0.54) and the
    # authors' L_proto weight 0.1, JASCL learned none of session 1's new classes (New 0.001, vanilla 0.126)
    from jascl.engine.config import resolve_config
    from jascl.methods.presets import jascl_options

    p = get_protocol("synthetic-3d")
    config = resolve_config(p.training, p.path)
    assert config.epochs_base == 100
    assert jascl_options(config).replay.weight == 0.03
    # only the L_proto weight is set: reduction and background stay the family's defaults
    assert set(config.method_args) == {"jascl"} and config.method_args["jascl"] == {"replay": {"weight": 0.03}}
    # --preset authors leaves the weight to the protocol (the authors' value differs by benchmark); --set restores 0.1
    assert jascl_options(resolve_config(p.training, p.path, overrides=["preset=authors"])).replay.weight == 0.03
    restored = resolve_config(p.training, p.path, overrides=["method_args.jascl.replay.weight=0.1"])
    assert jascl_options(restored).replay.weight == 0.1


def test_unmodified_copy_loads_from_a_path(tmp_path):
    path = _write(tmp_path, _base())
    p = load_protocol(path)
    assert p.name == "synthetic-2d"  # the YAML's name wins over the file stem
    assert p.path == "bad.yaml" and p.file == str(path.resolve())
    assert p == dataclasses.replace(get_protocol("synthetic-2d"), path="bad.yaml", file=str(path.resolve()))


def test_defaults_of_optional_keys():
    data = {
        "classes": [{"id": 0, "name": "bg"}, {"id": 1, "name": "a"}, {"id": 2, "name": "b"}],
        "sessions": [
            {"domains": "d", "new_classes": [1], "train": 4, "source": "real"},
            {"domains": ["d"], "new_classes": [2], "recurring_classes": [1], "shots": 2, "source": "real"},
        ],
    }
    p = parse_protocol(data, source="mini.yaml")
    assert p.name == "mini"  # from the source's stem
    assert p.spatial_dims == 2 and p.metric == "iou" and p.seed == 1024
    assert p.synthetic is None and p.domains == {}
    assert [s.name for s in p.sessions] == ["base", "session1"]
    assert p.sessions[0].shots is None and p.sessions[0].num_labelled == 4
    assert p.sessions[1].num_labelled == 4  # 2 shots x 2 classes
    assert p.sessions[0].test == 1 and p.sessions[0].unlabelled == 0


# --------------------------------------------------------------------------- malformed protocols


def _set(path: tuple, value: Any) -> Callable[[dict], None]:
    def mutate(d: dict) -> None:
        node = d
        for part in path[:-1]:
            node = node[part]
        node[path[-1]] = value

    return mutate


def _rename_shots(d: dict) -> None:
    d["sessions"][1]["shot"] = d["sessions"][1].pop("shots")


def _drop_train(d: dict) -> None:
    del d["sessions"][0]["train"]


def _drop_background(d: dict) -> None:
    d["classes"] = [c for c in d["classes"] if c["id"] != 0]


def _extra_class(d: dict) -> None:
    d["classes"].append({"id": 10, "name": "extra", "shape": "disc"})


def _unknown_appearance(d: dict) -> None:
    d["domains"]["mri"]["appearance"]["contrast"] = 0.5


# (case id, mutation, key path that the message must name, a fragment of the reason)
MALFORMED = [
    ("unknown-top-level-key", _set(("sesions",), []), "bad.yaml: sesions:", "unknown key"),
    ("session-key-typo", _rename_shots, "sessions[1].shot:", "unknown key"),
    (
        "class-before-declared",
        _set(("sessions", 1, "new_classes"), [5, 6, 42]),
        "sessions[1].new_classes[2]",
        "class id 42 is used before it is declared",
    ),
    (
        "recurring-not-introduced",
        _set(("sessions", 2, "recurring_classes"), [9]),
        "sessions[2].recurring_classes[0]",
        "recurs before any earlier session introduced it",
    ),
    (
        "recurring-in-base",
        _set(("sessions", 0, "recurring_classes"), [1]),
        "sessions[0].recurring_classes[0]",
        "recurs before",
    ),
    (
        "introduced-twice",
        _set(("sessions", 2, "new_classes"), [7, 8, 5]),
        "sessions[2].new_classes[2]",
        "already introduced",
    ),
    (
        "listed-twice-in-session",
        _set(("sessions", 1, "new_classes"), [5, 6, 6]),
        "sessions[1].new_classes",
        "lists a class twice",
    ),
    (
        "background-as-new-class",
        _set(("sessions", 1, "new_classes"), [0, 5, 6]),
        "sessions[1].new_classes[0]",
        "background",
    ),
    ("shots-negative", _set(("sessions", 2, "shots"), -3), "sessions[2].shots", "(got -3)"),
    ("shots-zero", _set(("sessions", 2, "shots"), 0), "sessions[2].shots", "positive integer"),
    ("shots-string", _set(("sessions", 2, "shots"), "many"), "sessions[2].shots", "'many'"),
    ("shots-missing-incremental", lambda d: d["sessions"][1].pop("shots"), "sessions[1].shots", "is required"),
    ("all-without-train", _drop_train, "sessions[0].train", "is required when shots is 'all'"),
    ("k-shot-with-train", _set(("sessions", 1, "train"), 10), "sessions[1].train", "only applies when shots is 'all'"),
    ("test-zero", _set(("sessions", 3, "test"), 0), "sessions[3].test", ">= 1"),
    ("spatial-dims-4", _set(("spatial_dims",), 4), "spatial_dims", "must be 2 or 3 (got 4)"),
    ("duplicate-class-id", _set(("classes", 5, "id"), 4), "classes[5].id", "duplicate class id 4"),
    ("duplicate-class-name", _set(("classes", 5, "name"), "disc"), "classes[5].name", "duplicate class name"),
    ("missing-background", _drop_background, "bad.yaml: classes:", "class id 0 (background)"),
    ("declared-never-introduced", _extra_class, "bad.yaml: classes:", "[10]"),
    ("undeclared-domain", _set(("sessions", 1, "domains"), ["pet"]), "sessions[1].domains[0]", "'pet' is not declared"),
    ("unknown-appearance-key", _unknown_appearance, "domains.mri.appearance.contrast", "unknown key"),
    (
        "appearance-out-of-range",
        _set(("domains", "ct", "appearance", "noise"), 9.0),
        "domains.ct.appearance.noise",
        "must be in",
    ),
    ("synthetic-size-3-entries", _set(("synthetic", "size"), [64, 64, 64]), "synthetic.size", "list of 2 integers"),
    ("missing-shape", lambda d: d["classes"][3].pop("shape"), "classes[id=3].shape", "shape"),
    (
        "other-classes-choice",
        _set(("sessions", 1, "other_classes"), "keep"),
        "sessions[1].other_classes",
        "background, ignore",
    ),
    ("sessions-empty", _set(("sessions",), []), "bad.yaml: sessions:", "non-empty list"),
]


@pytest.mark.parametrize("mutate, key, reason", [c[1:] for c in MALFORMED], ids=[c[0] for c in MALFORMED])
def test_malformed_protocol_is_one_line_naming_the_key(tmp_path, mutate, key, reason):
    data = _base()
    mutate(data)
    path = _write(tmp_path, data)
    with pytest.raises(ConfigError) as info:
        load_protocol(path)
    message = str(info.value)
    _assert_one_line(message, key)
    assert reason in message, message


def test_mutations_do_not_leak_between_cases():
    # every case starts from a fresh copy of the built-in file
    original = _base()
    for _, mutate, _, _ in MALFORMED:
        data = copy.deepcopy(original)
        mutate(data)
    assert _base() == original
    assert load_protocol(SYNTHETIC_2D).sessions[2].shots == 5


def _invalid_yaml(tmp_path: Path) -> tuple[Path, int]:
    lines = SYNTHETIC_2D.read_text().splitlines()
    index = next(i for i, line in enumerate(lines) if line.startswith("seed:"))
    lines[index] = "seed: 1024: 7"  # "mapping values are not allowed here"
    path = tmp_path / "bad.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path, index + 1


def test_invalid_yaml_names_file_and_line(tmp_path):
    path, line = _invalid_yaml(tmp_path)
    with pytest.raises(ConfigError) as info:
        load_protocol(path)
    message = str(info.value)
    _assert_one_line(message, f"line {line}:")
    assert message.startswith(f"bad.yaml: line {line}: not valid YAML"), message


@pytest.mark.parametrize("text", ["", "- just\n- a list\n"], ids=["empty", "list"])
def test_top_level_not_a_mapping(tmp_path, text):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_protocol(path)
    message = str(info.value)
    _assert_one_line(message, "must be a mapping")
    assert "bad.yaml: :" not in message


def test_missing_file_and_unknown_name(tmp_path):
    with pytest.raises(ConfigError, match="protocol file not found"):
        load_protocol(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not a built-in"):
        get_protocol("no-such-protocol")


# --------------------------------------------------------------------------- through the CLI


def _typo_file(tmp_path: Path) -> Path:
    data = _base()
    _rename_shots(data)
    return _write(tmp_path, data)


def test_cli_reports_malformed_protocol_in_one_line(tmp_path, capsys):
    path = _typo_file(tmp_path)
    code = main(["run", "--protocol", str(path), "--out", str(tmp_path / "o")])
    assert code == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("jascl: error: bad.yaml:")
    assert "sessions[1].shot" in lines[0]
    assert "Traceback" not in captured.err
    assert captured.out == ""
    assert not (tmp_path / "o").exists()


def test_cli_reports_invalid_yaml_in_one_line(tmp_path, capsys):
    path, line = _invalid_yaml(tmp_path)
    assert main(["run", "--protocol", str(path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [err.rstrip("\n")]
    assert err.startswith(f"jascl: error: bad.yaml: line {line}:")


def test_cli_protocols_command_reports_malformed_file(tmp_path, capsys):
    path = _typo_file(tmp_path)
    assert main(["protocols", str(path)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("jascl: error: bad.yaml: sessions[1].shot:")


def test_cli_subprocess_exit_code_and_single_line(tmp_path):
    path = _typo_file(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "jascl", "run", "--protocol", str(path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("jascl: error: bad.yaml: sessions[1].shot:")
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists()
