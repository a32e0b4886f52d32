"""The protocol file reference (docs/protocol-reference.md) cannot drift: it documents exactly the keys the parser
accepts, every example parses in a small protocol, the documented schema defaults are what the parser gives, the
``preprocess`` rows name the keys the preprocessing functions take (and their examples pass them), and the docs
build renders every key."""

import copy
import dataclasses
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import yaml

from jascl.data.preprocess_reference import IMAGE_KEYS, VOLUME_KEYS
from jascl.protocols import parse_protocol
from jascl.protocols.reference import SECTIONS, attribute_docs, key_rows

ROOT = Path(__file__).resolve().parents[1]


def on_datasets() -> dict:
    """Two CT/MR dataset entries; session 1 teaches class 3 new and class 1 again, from mr."""
    return {
        "classes": [
            {"id": 0, "name": "background"},
            {"id": 1, "name": "liver"},
            {"id": 2, "name": "spleen"},
            {"id": 3, "name": "tumour"},
        ],
        "domains": {"ct": {}, "mr": {}},
        "datasets": {
            "ct": {"layout": "msd", "labels": {1: "liver", 2: "spleen"}},
            "mr": {"layout": "msd", "labels": {1: "tumour", 2: "liver"}},
        },
        "sessions": [
            {"domains": ["ct"], "new_classes": [1, 2], "shots": "all", "sources": ["ct"]},
            {"domains": ["mr"], "new_classes": [3], "shots": 2, "sources": ["mr"]},
        ],
    }


def synthetic() -> dict:
    return {
        "synthetic": {"size": 32},
        "classes": [
            {"id": 0, "name": "background"},
            {"id": 1, "name": "liver", "shape": "disc"},
            {"id": 3, "name": "x", "shape": "square"},
        ],
        "domains": {"ct": {}, "mr": {}},
        "sessions": [
            {"domains": ["ct"], "new_classes": [1], "shots": "all", "train": 4},
            {"domains": ["mr"], "new_classes": [3], "shots": 2},
        ],
    }


def placed(section: str, key: str, value) -> dict:
    """A small protocol with ``key: value`` (one documented example) where the section puts it."""
    if section == "":
        p = synthetic() if key == "synthetic" else on_datasets()
        if key == "synthetic":
            p["synthetic"] = value
            p["classes"][2]["shape"] = "square"
        elif key == "sessions":
            p.update(
                classes=p["classes"][:2], datasets={"ct": {"layout": "msd", "labels": {1: "liver"}}}, sessions=value
            )
        elif key == "classes":
            p.update(
                classes=value, datasets={"ct": {"layout": "msd", "labels": {1: "liver"}}}, sessions=p["sessions"][:1]
            )
            p["sessions"][0]["new_classes"] = [1]
        elif key == "datasets":
            p.update(classes=p["classes"][:2], datasets=value, sessions=p["sessions"][:1])
            p["sessions"][0]["new_classes"] = [1]
        else:
            p[key] = value
        return p
    if section == "classes[]":
        p = synthetic()
        p["classes"][1][key] = value
        return p
    if section == "domains.<name>":
        p = synthetic()
        p["domains"]["ct"][key] = value
        return p
    if section == "sessions[]":
        if key in ("train", "source"):  # shots: all on synthetic data / a session without sources
            p = synthetic()
            p["sessions"][0 if key == "train" else 1][key] = value
            return p
        p = on_datasets()
        p["sessions"][1][key] = value
        return p
    if section == "sessions[].sources[]":
        p = on_datasets()
        entry = {"dataset": "mr", "classes": [3]}
        entry[key] = value
        p["sessions"][1]["sources"] = [entry]
        return p
    if section == "sessions[].unlabelled_sources[]":
        p = synthetic() if key == "domain" else on_datasets()
        entry = {"count": 2} if key == "count" else {key: value, "count": 2}
        if key == "count":
            entry["dataset"] = "ct"
            entry["count"] = value
        p["sessions"][1]["unlabelled_sources"] = [entry]
        return p
    if section == "datasets.<name>":
        p = on_datasets()
        p["datasets"]["ct"][key] = value
        if key == "domain":
            p["datasets"]["ct"]["domain"] = value
        return p
    if section == "synthetic":
        p = synthetic()
        p["synthetic"][key] = value
        return p
    raise AssertionError(section)


def test_every_parser_key_is_documented_and_nothing_else():
    for section in SECTIONS:
        assert {k.name for k in section.keys} == set(section.parser_keys), section.path


@pytest.mark.parametrize(
    ("section", "key", "example"),
    [(s.path, k.name, k.example) for s in SECTIONS for k in s.keys],
    ids=[f"{s.path or 'top'}.{k.name}" for s in SECTIONS for k in s.keys],
)
def test_every_example_parses(section, key, example):
    ((name, value),) = yaml.safe_load(example).items()
    assert name == key
    parse_protocol(placed(section, key, copy.deepcopy(value)), source="example.yaml")


def test_schema_defaults_are_the_parsers():
    """Where a key's default is read from the schema's field, a protocol without the key gets exactly that."""
    parsed = {"datasets.<name>": parse_protocol(on_datasets()).datasets["ct"]}
    parsed["sessions[]"] = parse_protocol(on_datasets()).sessions[1]
    parsed["synthetic"] = parse_protocol(synthetic()).synthetic
    parsed["domains.<name>"] = parse_protocol(synthetic()).domains["ct"]
    checked = 0
    for section in SECTIONS:
        for key in section.keys:
            if key.default is not None or section.path not in parsed or section.schema is None:
                continue
            fields = {f.name: f for f in dataclasses.fields(section.schema)}
            f = fields[key.attribute or key.name]
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            assert getattr(parsed[section.path], f.name) == default, (section.path, key.name)
            checked += 1
    assert checked >= 8


def test_descriptions_come_from_the_schema_docstrings():
    from jascl.protocols.schema import SessionSpec

    docs = attribute_docs(SessionSpec)
    assert docs["unlabelled"] == "size of the unlabelled pool drawn from the session's domain (0 = none)."
    assert docs["other_classes"].endswith('"background" (the authors\' convention) or "ignore".')
    assert all(row["doc"] for section in SECTIONS for row in key_rows(section)), "a key without a description"


def test_preprocess_rows_are_the_keys_the_preprocessing_takes():
    from jascl.data import medical, natural
    from jascl.data.layouts.base import Sample

    assert [k[0] for k in VOLUME_KEYS] == list(medical.PREPROCESS_KEYS)
    assert {k[0] for k in IMAGE_KEYS} == set(natural._PREPROCESS_KEYS)
    volume = Sample(np.random.default_rng(0).normal(size=(1, 8, 8, 8)).astype(np.float32), None, np.eye(4), {})
    for *_, example in VOLUME_KEYS:
        medical.preprocess_volume(volume, yaml.safe_load(example))
    image = Sample(np.random.default_rng(0).uniform(0, 255, size=(3, 16, 16)).astype(np.float32), None, None, {})
    for *_, example in IMAGE_KEYS:
        natural.preprocess_image(image, yaml.safe_load(example))


def test_the_docs_page_renders_every_key():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    page = hooks.on_page_markdown((ROOT / "docs" / "protocol-reference.md").read_text())
    assert "<!-- generated" not in page
    for section in SECTIONS:
        for key in section.keys:
            assert f"| `{key.name}` |" in page and f"`{key.example}`" in page
    for key, *_ in (*VOLUME_KEYS, *IMAGE_KEYS):
        assert f"| `{key}` |" in page
    assert "| `patch_size` | `None` |" in page or "| `patch_size` | `null` |" in page
