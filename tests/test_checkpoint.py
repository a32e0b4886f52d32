"""Checkpoints: safetensors only, atomic, and clear errors for files that do not fit or are unsafe."""

import pickle

import pytest
import torch

from jascl.engine.checkpoint import load_model, read_meta, save_model
from jascl.engine.prototypes import PrototypeStore
from jascl.errors import CheckpointError
from jascl.networks import create_segmenter


def _model(k=3, last=6):
    return create_segmenter("unet", 2, 1, k, features=(4, 4, 8, 8, 8, last))


def test_roundtrip_and_no_temp_files_left(tmp_path):
    a, b = _model(), _model()
    save_model(a, tmp_path / "m.safetensors", {"session": 2, "seen": [0, 4, 7]})
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]
    assert load_model(b, tmp_path / "m.safetensors") == {"session": 2, "seen": [0, 4, 7]}
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)


def test_mismatched_checkpoint_names_the_keys(tmp_path):
    save_model(_model(k=3), tmp_path / "m.safetensors", {})
    with pytest.raises(CheckpointError, match=r"classifier.weight: checkpoint \(3, 6\) vs model \(5, 6\)"):
        load_model(_model(k=5), tmp_path / "m.safetensors")


class _Evil:
    def __reduce__(self):
        import os

        return (os.system, ("echo pwned > /dev/null",))


def test_pickle_that_would_run_code_is_refused(tmp_path):
    path = tmp_path / "m.safetensors"
    path.write_bytes(pickle.dumps({"classifier.weight": _Evil()}))
    with pytest.raises(CheckpointError, match="not a readable jascl checkpoint"):
        read_meta(path)
    with pytest.raises(CheckpointError):
        load_model(_model(), path)
    bad = tmp_path / "p.safetensors"
    bad.write_bytes(b"\x00garbage")
    with pytest.raises(CheckpointError, match="cannot read prototypes"):
        PrototypeStore.load(bad)


def test_checkpoint_of_another_protocol_or_backbone_is_refused_with_the_reason(tmp_path):
    save_model(
        _model(), tmp_path / "m.safetensors", {"protocol": "med-disjoint", "backbone": "unet", "seen": [0, 1, 2]}
    )
    with pytest.raises(CheckpointError, match="made for protocol 'med-disjoint', but this run has protocol 'natural'"):
        load_model(_model(), tmp_path / "m.safetensors", {"protocol": "natural", "backbone": "unet"})
    with pytest.raises(CheckpointError, match="made for backbone 'unet', but this run has backbone 'swinunetr'"):
        load_model(_model(), tmp_path / "m.safetensors", {"protocol": "med-disjoint", "backbone": "swinunetr"})
    assert (
        load_model(_model(), tmp_path / "m.safetensors", {"protocol": "med-disjoint", "seen": (0, 1, 2)})["backbone"]
        == "unet"
    )
