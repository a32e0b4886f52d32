"""CLIP text embeddings of class names: the embeddings file and a local (tiny, random) CLIP text tower."""

import json
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from jascl.errors import CheckpointError, ConfigError
from jascl.networks.text_embeddings import encode_class_names, load_text_embeddings, write_text_embeddings

# a CLIP small enough to build in milliseconds; the vocabulary is open_clip's bundled BPE one
TINY_CLIP = {
    "embed_dim": 6,
    "vision_cfg": {"image_size": 8, "layers": 1, "width": 8, "patch_size": 4, "head_width": 8},
    "text_cfg": {"context_length": 12, "vocab_size": 49408, "width": 8, "heads": 2, "layers": 1},
}


def _one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text
    return text


def test_roundtrip_in_the_order_asked(tmp_path):
    path = tmp_path / "emb.safetensors"
    write_text_embeddings(
        path,
        {"liver": torch.tensor([1.0, 2.0, 3.0]), "spleen": torch.tensor([4.0, 5.0, 6.0], dtype=torch.float64)},
        metadata={"template": "A computerized tomography of a {}."},
    )
    got = load_text_embeddings(path, ["spleen", "liver"])
    assert got.dtype == torch.float32
    assert torch.equal(got, torch.tensor([[4.0, 5.0, 6.0], [1.0, 2.0, 3.0]]))
    assert torch.equal(load_text_embeddings(path, ["liver"], dim=3), torch.tensor([[1.0, 2.0, 3.0]]))
    with safe_open(str(path), framework="pt") as fh:
        assert fh.metadata() == {"template": "A computerized tomography of a {}."}


def test_missing_names_name_the_file_and_the_names(tmp_path):
    path = tmp_path / "emb.safetensors"
    write_text_embeddings(path, {"liver": torch.ones(3)})
    with pytest.raises(ConfigError) as exc:
        load_text_embeddings(path, ["liver", "pancreas", "kidney"])
    text = _one_line(exc)
    assert str(path) in text and "'pancreas', 'kidney'" in text and "2 of 3 names missing" in text


def test_mismatched_dimension_names_the_file(tmp_path):
    path = tmp_path / "emb.safetensors"
    write_text_embeddings(path, {"liver": torch.ones(3)})
    with pytest.raises(ConfigError) as exc:
        load_text_embeddings(path, ["liver"], dim=512)
    text = _one_line(exc)
    assert str(path) in text and "dimension 3, expected 512" in text


def test_missing_or_unreadable_file(tmp_path):
    with pytest.raises(ConfigError) as exc:
        load_text_embeddings(tmp_path / "absent.safetensors", ["liver"])
    assert f"{tmp_path / 'absent.safetensors'}: text embeddings file not found" in _one_line(exc)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not safetensors")
    with pytest.raises(ConfigError) as exc:
        load_text_embeddings(bad, ["liver"])
    assert str(bad) in _one_line(exc)


def test_write_refuses_vectors_of_different_lengths(tmp_path):
    with pytest.raises(ConfigError, match="different lengths \\[2, 3\\]"):
        write_text_embeddings(tmp_path / "e.safetensors", {"a": torch.ones(2), "b": torch.ones(3)})
    assert not (tmp_path / "e.safetensors").exists()


def _tiny_clip_folder(tmp_path):
    open_clip = pytest.importorskip("open_clip")
    torch.manual_seed(0)
    model = open_clip.CLIP(**TINY_CLIP)
    folder = tmp_path / "clip"
    folder.mkdir()
    (folder / "open_clip_config.json").write_text(json.dumps({"model_cfg": TINY_CLIP}))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    return open_clip, model.eval(), folder


def test_encode_with_a_local_tiny_text_tower(tmp_path):
    open_clip, model, folder = _tiny_clip_folder(tmp_path)
    got = encode_class_names(["liver", "left_kidney"], folder)
    tokenizer = open_clip.get_tokenizer("ViT-B-32", context_length=12)
    prompts = ["A computerized tomography of a liver.", "A computerized tomography of a left kidney."]
    with torch.no_grad():
        expected = model.encode_text(tokenizer(prompts))
    assert got.shape == (2, 6)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert not torch.equal(got[0], got[1])  # the name reaches the vector


def test_encode_errors_name_the_weights(tmp_path, monkeypatch):
    open_clip, _, folder = _tiny_clip_folder(tmp_path)
    with pytest.raises(CheckpointError) as exc:
        encode_class_names(["liver"], tmp_path / "absent.pt")
    assert f"{tmp_path / 'absent.pt'}: CLIP weights not found" in _one_line(exc)
    wrong = folder / "model.safetensors"
    save_file({"positional_embedding": torch.zeros(3, 3)}, str(wrong))  # not the tiny CLIP's tensors
    with pytest.raises(CheckpointError) as exc:
        encode_class_names(["liver"], folder)
    assert f"{wrong}: does not fit CLIP model 'local-dir:{folder}'" in _one_line(exc)
    with pytest.raises(ConfigError, match="unknown open_clip architecture 'no-such-net'"):
        encode_class_names(["liver"], wrong, model="no-such-net")
    with pytest.raises(ConfigError, match="exactly one"):
        encode_class_names(["liver"], folder, template="no slot")
    monkeypatch.setitem(sys.modules, "open_clip", None)  # as if not installed
    with pytest.raises(ConfigError, match="pip install open_clip_torch"):
        encode_class_names(["liver"], folder)


def test_command_writes_the_protocols_rows(tmp_path):
    import yaml

    from conftest import toy_protocol_dict
    from jascl.cli import main
    from jascl.networks.clip_driven import ClipDrivenBackbone

    _, _, folder = _tiny_clip_folder(tmp_path)
    protocol = tmp_path / "toy.yaml"
    protocol.write_text(yaml.safe_dump(toy_protocol_dict(2)))
    out = tmp_path / "toy.safetensors"
    assert main(["text-embeddings", "--weights", str(folder), "--protocol", str(protocol), "--out", str(out)]) == 0
    expected = encode_class_names(["disc", "square", "cross"], folder)
    torch.testing.assert_close(load_text_embeddings(out, ["disc", "square", "cross"]), expected, rtol=0, atol=0)
    with safe_open(str(out), framework="pt") as fh:
        meta = fh.metadata()
    assert json.loads(meta["rows"]) == ["background", "disc", "square", "cross"] and meta["protocol"] == "toy-2d"
    backbone = ClipDrivenBackbone(2, 1, embeddings=str(out), features=[4, 4, 8, 8, 8, 8])
    assert torch.equal(backbone.make_classifier(4).weight[1:], expected)
