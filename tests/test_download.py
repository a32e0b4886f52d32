"""``jascl data download`` / ``data list`` / ``weights fetch``: resumable, verified downloads from a local HTTP server.

No test reaches the internet: every archive is served from 127.0.0.1 by a server started and stopped in the test
(stdlib ``http.server`` has no Range support, so the handler below answers ``Range: bytes=N-`` itself), and the
registration-only and listing tests run with outgoing connections refused.
"""

import hashlib
import http.server
import io
import re
import socket
import sys
import tarfile
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fixtures import medical as fxm  # noqa: E402
from jascl.cli import main  # noqa: E402
from jascl.data import catalogue  # noqa: E402
from jascl.data.catalogue import CATALOGUE, DatasetEntry, get_entry, protocol_roots  # noqa: E402
from jascl.data.getting import write_verse_index  # noqa: E402
from jascl.download import PUBLISHED, Archive, fetch  # noqa: E402
from jascl.errors import DataError  # noqa: E402
from jascl.networks import released  # noqa: E402

PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "NO_PROXY", "no_proxy", "ALL_PROXY")


class FileServer:
    """Serves ``files`` (name -> bytes) on 127.0.0.1 with ``Range: bytes=N-`` support.

    ``cut[name] = n`` makes the next response for ``name`` send ``n`` body bytes and close the connection (its
    ``Content-Length`` announces the whole body). ``requests`` records (path, Range header) per request.
    """

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.cut: dict[str, int] = {}
        self.requests: list[tuple[str, str | None]] = []
        state = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep the test output clean
                pass

            def do_GET(self):
                name = self.path.rsplit("/", 1)[-1]
                state.requests.append((self.path, self.headers.get("Range")))
                data = state.files.get(name)
                if data is None:
                    self.send_error(404)
                    return
                start = 0
                wanted = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range") or "")
                if wanted:
                    start = int(wanted.group(1))
                    if start >= len(data):
                        self.send_response(416)
                        self.send_header("Content-Range", f"bytes */{len(data)}")
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                else:
                    self.send_response(200)
                body = data[start:]
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                cut = state.cut.pop(name, None)
                self.wfile.write(body if cut is None else body[:cut])  # HTTP/1.0: the connection closes after it

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def url(self, name: str) -> str:
        return f"{self.base}/files/{name}"


@pytest.fixture
def server(monkeypatch):
    for var in PROXY_VARS:
        monkeypatch.delenv(var, raising=False)
    srv = FileServer()
    srv.thread.start()
    yield srv
    srv.httpd.shutdown()
    srv.httpd.server_close()
    srv.thread.join(timeout=5)


@pytest.fixture
def offline(monkeypatch):
    """Any outgoing connection fails the test."""

    def refuse(self, address):
        raise AssertionError(f"network access to {address}")

    monkeypatch.setattr(socket.socket, "connect", refuse)


def msd_tar(tmp_path: Path, task: str = "Task06_Lung") -> bytes:
    """A Decathlon-style tar (``<task>/dataset.json``, ``imagesTr``, ``labelsTr``) of three tiny CT cases."""
    src = fxm.write_msd(tmp_path / "src" / task, cases=3, shape=(12, 12, 8), labels=(1,), test_cases=0, style="msd")
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        tar.add(src, arcname=task)
    return buffer.getvalue()


def lung_entry(server: FileServer, data: bytes, md5: str | None = "auto") -> DatasetEntry:
    """``msd_lung`` served by the test server (its MD5 taken from the bytes unless given)."""
    server.files["Task06_Lung.tar"] = data
    checksum = hashlib.md5(data).hexdigest() if md5 == "auto" else md5
    return DatasetEntry(
        name="msd_lung",
        title="test copy of Task06_Lung",
        layout="msd",
        licence="CC-BY-SA 4.0",
        source="test",
        archives=(Archive(server.url("Task06_Lung.tar"), "Task06_Lung.tar", md5=checksum, checksum_source=PUBLISHED),),
        marker="dataset.json",
    )


def lung_protocol(tmp_path: Path) -> Path:
    """A one-session protocol reading root ``msd_lung`` (label 1 = lung tumour)."""
    data = {
        "name": "lung-only",
        "seed": 1024,
        "spatial_dims": 3,
        "in_channels": 1,
        "metric": "dice",
        "classes": [{"id": 0, "name": "background"}, {"id": 1, "name": "lung_tumour"}],
        "domains": {"ct": {}},
        "datasets": {
            "lung": {
                "layout": "msd",
                "root": "msd_lung",
                "domain": "ct",
                "labels": {1: "lung_tumour"},
                "preprocess": {"intensity": "ct"},
            }
        },
        "sessions": [{"name": "base", "domains": ["ct"], "new_classes": [1], "shots": "all", "sources": ["lung"]}],
        "training": {"patch_size": [32, 32, 32]},  # the smallest the default U-Net takes; volumes are padded
    }
    path = tmp_path / "lung-only.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_full_download_unpacks_into_the_layout_prints_the_root_line_and_data_check_passes(
    tmp_path, capsys, server, monkeypatch
):
    data = msd_tar(tmp_path)
    monkeypatch.setitem(CATALOGUE, "msd_lung", lung_entry(server, data))
    to = tmp_path / "data"
    assert main(["data", "download", "msd_lung", "--to", str(to), "--no-progress"]) == 0
    out = capsys.readouterr().out.splitlines()
    root = to / "msd_lung" / "Task06_Lung"
    assert f"--root msd_lung={root}" in out
    assert any(line.startswith("Task06_Lung.tar: MD5 verified (published)") for line in out), out
    assert (to / "msd_lung" / "Task06_Lung.tar").read_bytes() == data  # kept, under its final name
    assert not (to / "msd_lung" / "Task06_Lung.tar.part").exists()
    assert sorted(p.name for p in (root / "imagesTr").iterdir()) == [f"case_00{i}.nii.gz" for i in range(3)]
    assert server.requests == [("/files/Task06_Lung.tar", None)]  # one plain GET, no range

    code = main(["data", "check", "--protocol", str(lung_protocol(tmp_path)), "--root", f"msd_lung={root}",
                 "--cache-dir", str(tmp_path / "cache")])  # fmt: skip
    check = capsys.readouterr().out.splitlines()
    assert code == 0 and check[-1] == "no problems found", check

    # a rerun touches no network and prints the same root line; with JASCL_DATA set a run finds the root itself
    assert main(["data", "download", "msd_lung", "--to", str(to)]) == 0
    assert f"--root msd_lung={root}" in capsys.readouterr().out.splitlines()
    assert len(server.requests) == 1
    monkeypatch.setenv("JASCL_DATA", str(to))
    monkeypatch.delenv("JASCL_ROOT_MSD_LUNG", raising=False)
    code = main(["data", "check", "--protocol", str(lung_protocol(tmp_path)), "--cache-dir", str(tmp_path / "cache")])
    assert code == 0, capsys.readouterr().out
    assert any(
        line.startswith("  lung (msd) at ") and str(root) in line for line in capsys.readouterr().out.splitlines()
    )


def test_interrupted_download_resumes_with_a_range_request(tmp_path, capsys, server, monkeypatch):
    data = msd_tar(tmp_path)
    monkeypatch.setitem(CATALOGUE, "msd_lung", lung_entry(server, data))
    server.cut["Task06_Lung.tar"] = 7000  # the first response drops the connection after 7000 bytes
    to = tmp_path / "data"
    assert main(["data", "download", "msd_lung", "--to", str(to), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    part = to / "msd_lung" / "Task06_Lung.tar.part"
    assert len(err) == 1 and f"interrupted after 7,000 of {len(data):,} bytes" in err[0], err
    assert f"kept in {part}: rerun the same command to resume" in err[0]
    assert part.read_bytes() == data[:7000]

    assert main(["data", "download", "msd_lung", "--to", str(to), "--no-progress"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert server.requests[-1] == ("/files/Task06_Lung.tar", "bytes=7000-")  # only the rest was asked for
    assert (to / "msd_lung" / "Task06_Lung.tar").read_bytes() == data
    assert any(line.startswith("Task06_Lung.tar: MD5 verified") for line in out)
    assert f"--root msd_lung={to / 'msd_lung' / 'Task06_Lung'}" in out


def test_checksum_mismatch_is_one_line_exit_2_and_keeps_the_file(tmp_path, capsys, server, monkeypatch):
    data = msd_tar(tmp_path)
    monkeypatch.setitem(CATALOGUE, "msd_lung", lung_entry(server, data, md5="0" * 32))
    to = tmp_path / "data"
    assert main(["data", "download", "msd_lung", "--to", str(to), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    got = hashlib.md5(data).hexdigest()
    assert len(err) == 1, err
    assert f"MD5 checksum mismatch for Task06_Lung.tar (expected {'0' * 32}, got {got})" in err[0]
    part = to / "msd_lung" / "Task06_Lung.tar.part"
    assert part.read_bytes() == data  # kept for a resume (or for the user to inspect)
    assert not (to / "msd_lung" / "Task06_Lung.tar").exists() and not (to / "msd_lung" / "Task06_Lung").exists()


def test_no_recorded_checksum_refuses_until_no_verify_and_prints_the_sha256(tmp_path, capsys, server):
    payload = bytes(range(256)) * 40
    server.files["blob.bin"] = payload
    archive = Archive(server.url("blob.bin"), "blob.bin")
    sha = hashlib.sha256(payload).hexdigest()
    with pytest.raises(DataError, match=f"no checksum is recorded for blob.bin.*its SHA-256 is {sha}.*--no-verify"):
        fetch(archive, tmp_path, progress=False)
    assert (tmp_path / "blob.bin.part").stat().st_size == len(payload)
    lines = []
    result = fetch(archive, tmp_path, accept_unverified=True, progress=False, echo=lines.append)
    assert result.status == "accepted unverified" and result.sha256 == sha
    assert lines == [f"blob.bin: no checksum is recorded; accepted unverified (--no-verify); SHA-256 {sha}"]
    # the whole part was kept: the second call asked for the bytes after it and got 416, no body again
    assert server.requests[-1] == ("/files/blob.bin", f"bytes={len(payload)}-")
    assert (tmp_path / "blob.bin").read_bytes() == payload


def test_downloads_go_through_the_proxy_variables(tmp_path, server, monkeypatch):
    payload = b"jascl" * 1000
    server.files["via-proxy.bin"] = payload
    monkeypatch.setenv("HTTP_PROXY", server.base)  # the test server plays the proxy: it sees absolute URLs
    archive = Archive("http://files.invalid/x/via-proxy.bin", "via-proxy.bin",
                      sha256=hashlib.sha256(payload).hexdigest())  # fmt: skip
    assert fetch(archive, tmp_path, progress=False, echo=lambda _: None).status == "verified"
    assert server.requests == [("http://files.invalid/x/via-proxy.bin", None)]


def test_registration_only_dataset_prints_the_steps_without_network(tmp_path, capsys, offline):
    assert main(["data", "download", "brats", "--to", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "nothing was fetched" in out
    assert "1. register: register for BraTS 2021 on Synapse" in out
    assert "2. fetch: the Task 1 training archive (BraTS2021_Training_Data.tar)" in out
    assert f"3. unpack into {tmp_path / 'brats'}: untar it" in out
    assert "--root brats=ROOT" in out and "JASCL_ROOT_BRATS=ROOT" in out
    assert "jascl data check --protocol med-disjoint --root brats=PATH" in out
    assert list(tmp_path.iterdir()) == []  # nothing written either


def test_data_list_names_every_protocol_root_and_where_it_is_set(tmp_path, capsys, offline, monkeypatch):
    monkeypatch.setenv("JASCL_ROOT_AMOS", str(tmp_path))
    monkeypatch.delenv("JASCL_DATA", raising=False)
    for name in CATALOGUE:
        if name != "amos":
            monkeypatch.delenv(f"JASCL_ROOT_{name.upper()}", raising=False)
    assert main(["data", "list", "--root", f"ts={tmp_path}"]) == 0
    out = capsys.readouterr().out.splitlines()
    blocks = {line.split(":")[0]: i for i, line in enumerate(out) if not line.startswith(" ")}
    for name in protocol_roots():
        assert name in blocks, name
    assert "root set: JASCL_ROOT_AMOS" in out[blocks["amos"] + 1]
    assert "root set: --root" in out[blocks["ts"] + 1]
    assert "root set: no" in out[blocks["brats"] + 1]
    assert "get it: download, checksum MD5 (published: MONAI's Decathlon table)" in out[blocks["msd_lung"] + 2]
    assert "get it: download, checksum none recorded: --no-verify" in out[blocks["verse"] + 2]
    assert "get it: manual: registration on Synapse" in out[blocks["bcv"] + 2]


def test_catalogue_covers_every_builtin_protocol_root_with_its_layout():
    for root, users in protocol_roots().items():
        entry = get_entry(root)
        assert set(users.values()) == {entry.layout}, (root, users)
    for entry in CATALOGUE.values():
        assert entry.downloadable or (entry.register and entry.fetch and entry.unpack and entry.access), entry.name
        for archive in entry.archives:
            assert archive.url.startswith(("http://", "https://")) and archive.filename == archive.url.rsplit("/")[-1]


def test_decathlon_archives_are_monais_table():
    from monai.apps.datasets import DecathlonDataset

    for name, task in (("msd_lung", "Task06_Lung"), ("msd_colon", "Task10_Colon"),
                       ("msd_hepaticvessel", "Task08_HepaticVessel")):  # fmt: skip
        (archive,) = CATALOGUE[name].resolved_archives()
        assert archive.url == DecathlonDataset.resource[task] and archive.md5 == DecathlonDataset.md5[task]
        assert archive.filename == f"{task}.tar"


def test_clip_entry_is_open_clips_openai_url_with_its_published_sha256():
    open_clip = pytest.importorskip("open_clip")
    entry = released.WEIGHTS["clip-vit-b-32"]
    url = open_clip.pretrained.get_pretrained_url("ViT-B-32", "openai")
    assert entry.archive.url == url
    assert entry.archive.sha256 == url.split("/")[-2]  # OpenAI's URL carries the file's SHA-256


def test_detector_entry_is_torchvisions_coco_weights_checked_by_their_sha256_prefix(tmp_path, server):
    from torchvision.models.detection import FasterRCNN_ResNet50_FPN_Weights

    archive = released.WEIGHTS["fasterrcnn-resnet50-fpn-coco"].archive
    assert archive.url == FasterRCNN_ResNet50_FPN_Weights.COCO_V1.url
    assert archive.filename.endswith(f"-{archive.sha256}.pth") and archive.checksum_kind == "SHA-256 prefix"
    payload = b"weights" * 999
    server.files["w.pth"] = payload
    prefix = hashlib.sha256(payload).hexdigest()[:8]
    good = Archive(server.url("w.pth"), "w.pth", sha256=prefix, checksum_source=PUBLISHED)
    assert fetch(good, tmp_path / "a", progress=False, echo=lambda _: None).status == "verified"
    bad = Archive(server.url("w.pth"), "w.pth", sha256="00000000", checksum_source=PUBLISHED)
    with pytest.raises(
        DataError, match=f"SHA-256 prefix checksum mismatch for w.pth \\(expected 00000000, got {prefix}\\)"
    ):
        fetch(bad, tmp_path / "b", progress=False)


def test_weights_fetch_converts_a_verified_torchscript_file(tmp_path, capsys, server, monkeypatch):
    import torch
    from safetensors.torch import load_file

    torch.manual_seed(0)
    linear = torch.nn.Linear(3, 2)
    buffer = io.BytesIO()
    with warnings.catch_warnings():  # torch.jit is deprecated in favour of torch.export; OpenAI's CLIP is TorchScript
        warnings.simplefilter("ignore", FutureWarning)
        torch.jit.save(torch.jit.script(linear), buffer)
    data = buffer.getvalue()
    server.files["tower.pt"] = data
    entry = released.WeightsEntry(
        name="tiny-clip",
        title="a scripted Linear",
        archive=Archive(
            server.url("tower.pt"), "tower.pt", sha256=hashlib.sha256(data).hexdigest(), checksum_source=PUBLISHED
        ),  # fmt: skip
        licence="test",
        source="test",
        use="--weights {path}",
        convert="torchscript-to-safetensors",
        converted="tower.safetensors",
    )
    monkeypatch.setitem(released.WEIGHTS, "tiny-clip", entry)
    assert main(["weights", "fetch", "tiny-clip", "--to", str(tmp_path), "--no-progress"]) == 0
    out = capsys.readouterr().out.splitlines()
    target = tmp_path / "tower.safetensors"
    assert out[-1] == f"use it: --weights {target}"
    tensors = load_file(str(target))
    assert sorted(tensors) == ["bias", "weight"]
    assert torch.equal(tensors["weight"], linear.weight.detach()) and torch.equal(tensors["bias"], linear.bias.detach())


def test_verse_index_pairs_scans_with_masks_for_the_msd_layout(tmp_path):
    from jascl.data.layouts import LAYOUTS

    shape = (10, 10, 6)
    affine = fxm.fixture_affine(shape)
    split = tmp_path / "verse" / "dataset-verse20training"
    for scan in ("sub-verse500_ct", "sub-gl003_dir-ax_ct", "sub-verse501_ct"):
        subject = scan.split("_")[0]
        image = np.linspace(-500, 900, num=int(np.prod(shape)), dtype=np.float32).reshape(shape)
        fxm._save(image, split / "rawdata" / subject / f"{scan}.nii.gz", affine)
        if scan != "sub-verse501_ct":  # one scan without a mask
            mask = np.zeros(shape, np.uint8)
            mask[2:5, 2:5, 1:3] = 8  # T1
            fxm._save(mask, split / "derivatives" / subject / f"{scan[:-3]}_seg-vert_msk.nii.gz", affine)
    lines = []
    write_verse_index(tmp_path / "verse", lines.append)
    assert lines == [f"{tmp_path / 'verse' / 'dataset.json'}: indexed 2 VerSe scans (1 without a mask left out)"]
    layout = LAYOUTS.get("msd")(tmp_path / "verse")
    records = layout.scan()
    assert [r.id for r in records] == ["sub-gl003_dir-ax", "sub-verse500"]
    assert records[1].label == split / "derivatives" / "sub-verse500" / "sub-verse500_seg-vert_msk.nii.gz"
    assert layout.label_names()[8] == "T1" and layout.label_names()[28] == "T13"
    assert all(layout.check(r) == [] for r in records)


def test_default_root_needs_a_finished_download(tmp_path, monkeypatch):
    folder = tmp_path / "msd_colon" / "Task10_Colon"
    folder.mkdir(parents=True)
    (folder / "dataset.json").write_text("{}")
    env = {"JASCL_DATA": str(tmp_path)}
    assert catalogue.default_root("msd_colon", env) is None  # unpacked, but not marked ready
    (tmp_path / "msd_colon" / ".jascl-ready").write_text(f"{folder}\n")
    assert catalogue.default_root("msd_colon", env) == folder
    assert catalogue.default_root("msd_colon", {}) is None


def test_an_archive_member_outside_the_folder_is_refused(tmp_path):
    from jascl.download import extract

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        info = tarfile.TarInfo("../evil.txt")
        info.size = 4
        tar.addfile(info, io.BytesIO(b"evil"))
    archive = tmp_path / "bad.tar"
    archive.write_bytes(buffer.getvalue())
    into = tmp_path / "into"
    into.mkdir()
    with pytest.raises(DataError, match="bad.tar: cannot unpack .*Unsafe path"):
        extract(archive, into)
    assert not (tmp_path / "evil.txt").exists() and list(into.iterdir()) == []


def test_only_the_download_module_opens_urls():
    """Runs never reach the network: no module but jascl.download calls urllib / requests / a hub downloader."""
    src = Path(__file__).resolve().parents[1] / "src" / "jascl"
    pattern = re.compile(
        r"urlopen\(|urlretrieve\(|build_opener\(|requests\.(get|head|post|Session)|download_url\(|hf_hub_download\(|"
        r"torch\.hub\.|load_state_dict_from_url\(|download=True|create_connection\(|socket\.socket\("
    )
    offenders = [
        f"{path.relative_to(src)}:{n}"
        for path in sorted(src.rglob("*.py"))
        if path.name != "download.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line.split("#")[0])
    ]
    assert offenders == []
