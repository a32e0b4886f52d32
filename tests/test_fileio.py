"""Atomic, durable writes (jascl.fileio): the order of fsyncs and the rename, and what a failure leaves behind; and
load_yaml, the fast reader of the shipped YAML files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import yaml

import jascl.fileio as fileio
from jascl.engine.checkpoint import save_progress, save_tensors
from jascl.engine.prototypes import PrototypeStore


@pytest.fixture
def journal(monkeypatch):
    """Record every fsync (of a file or a folder, by path) and rename jascl.fileio performs, in order."""
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace
    fd_path: dict[int, str] = {}
    real_open = os.open

    def tracked_open(path, flags, *a, **kw):
        fd = real_open(path, flags, *a, **kw)
        fd_path[fd] = str(path)
        return fd

    def tracked_fsync(fd):
        path = fd_path.get(fd, "?")
        events.append(("fsync-dir" if os.path.isdir(path) else "fsync-file", path))
        real_fsync(fd)

    def tracked_replace(src, dst):
        events.append(("replace", f"{src} -> {dst}"))
        real_replace(src, dst)

    monkeypatch.setattr(fileio.os, "open", tracked_open)
    monkeypatch.setattr(fileio.os, "fsync", tracked_fsync)
    monkeypatch.setattr(fileio.os, "replace", tracked_replace)
    return events


def _expected(events, path: Path) -> None:
    """The four steps of jascl.fileio's docstring, in order, for one write of ``path``."""
    kinds = [kind for kind, _ in events]
    assert kinds == ["fsync-file", "fsync-dir", "replace", "fsync-dir"]
    tmp = Path(events[0][1])
    assert tmp.parent == path.parent and tmp.name.startswith(f".{path.name}.") and tmp.name.endswith(".tmp")
    assert events[1][1] == events[3][1] == str(path.parent)
    assert events[2][1] == f"{tmp} -> {path}"


def test_text_is_fsynced_then_the_folder_then_renamed_then_the_folder_again(journal, tmp_path):
    target = tmp_path / "results.json"
    fileio.atomic_write_text(target, '{"all": 0.5}\n')
    _expected(journal, target)
    assert target.read_text() == '{"all": 0.5}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]


@pytest.mark.parametrize("kind", ["tensors", "progress", "prototypes"])
def test_checkpoints_take_the_same_durable_path(journal, tmp_path, kind):
    target = tmp_path / f"{kind}.safetensors"
    if kind == "tensors":
        save_tensors({"w": torch.ones(3)}, target)
    elif kind == "progress":
        save_progress(target, {"session": 1}, {"step": 4, "w": torch.zeros(2)})
    else:
        store = PrototypeStore()
        store.add(0, {1: torch.ones(4)})
        store.save(target)
    _expected(journal, target)


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "model.safetensors"
    target.write_bytes(b"old")

    def half_then_fail(tmp: Path) -> None:
        tmp.write_bytes(b"ne")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        fileio.atomic_write(target, half_then_fail)
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]


def test_a_failed_rename_leaves_the_old_file(monkeypatch, tmp_path):
    target = tmp_path / "run.json"
    target.write_text("old")

    def refuse(src, dst):
        raise PermissionError("read-only")

    monkeypatch.setattr(fileio.os, "replace", refuse)
    with pytest.raises(PermissionError):
        fileio.atomic_write_text(target, "new")
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["run.json"]


def test_text_files_are_readable_as_the_umask_allows(tmp_path):
    umask = os.umask(0o022)
    try:
        fileio.atomic_write_text(tmp_path / "a.txt", "x")
    finally:
        os.umask(umask)
    assert (tmp_path / "a.txt").stat().st_mode & 0o777 == 0o644


def test_load_yaml_reads_what_safe_load_reads_and_fails_as_it_does():
    from jascl.protocols import builtin_protocols

    shipped = [
        *builtin_protocols().values(),
        *sorted((Path(fileio.__file__).parent / "paper" / "tables").glob("*.yaml")),
    ]
    assert len(shipped) > 40
    for path in shipped:
        text = path.read_text(encoding="utf-8")
        assert fileio.load_yaml(text) == yaml.safe_load(text), path.name
    assert fileio._SAFE_LOADER is (yaml.CSafeLoader if yaml.__with_libyaml__ else yaml.SafeLoader)
    with pytest.raises(yaml.YAMLError) as caught:  # PyYAML's own wording and line, not libyaml's
        fileio.load_yaml("a: [1, 2")
    assert caught.value.problem == "expected ',' or ']', but got '<stream end>'"
    assert caught.value.problem_mark.line == 0
