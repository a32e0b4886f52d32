"""Released checkpoints the backbones and methods can start from: the table behind ``jascl weights fetch NAME`` and
``jascl weights list`` (and the "Getting the data" page).

jascl never downloads weights on its own (``--weights`` and ``backbone_args`` take local files only,
:mod:`jascl.networks.weights`); ``jascl weights fetch NAME --to DIR`` (``DIR`` defaults to ``$JASCL_DATA/weights``)
fetches one file with :func:`jascl.download.fetch` (resumable, verified) and prints how to use it.

Checksums: OpenAI publishes each CLIP checkpoint's SHA-256 as a segment of its URL (the URLs are open_clip's,
``open_clip.pretrained``; OpenAI's ``clip`` package and open_clip check the download against it); torchvision
publishes the first 8 hex digits of each checkpoint's SHA-256 in its file name (``torch.hub`` checks that prefix). Meta publishes no
checksum for SAM; the SHA-256 recorded here is the one several public projects pin for ``sam_vit_b_01ec64.pth``.
The CLIP-driven universal model's authors publish none and none is recorded: fetching it needs ``--no-verify``.

OpenAI's CLIP file is a TorchScript archive, which jascl's readers refuse (``torch.load(weights_only=True)``): once
its SHA-256 matches OpenAI's, :func:`torchscript_to_safetensors` writes its tensors to a ``.safetensors`` file next to
it, the file ``jascl text-embeddings --weights`` then reads.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from jascl.download import PUBLISHED, RECORDED, Archive, download_folder, fetch, file_digests
from jascl.errors import CheckpointError, ConfigError
from jascl.fileio import atomic_write

_OPENAI_SHA = "40d365715913c9da98579312b702a82c18be219cc2a73407c4526f58eba950af"
_UNIVERSAL = "https://huggingface.co/ljwztc/CLIP-Driven-Universal-Model/resolve/main/"
_UNIVERSAL_NOTE = "the CLIP-driven universal model (Liu et al., ICCV 2023), as its README links it"
#: keys of OpenAI's TorchScript CLIP that are not tensors of the model (open_clip drops them too)
_CLIP_EXTRA_KEYS = ("input_resolution", "context_length", "vocab_size")


@dataclass(frozen=True)
class WeightsEntry:
    """One released checkpoint.

    Attributes:
        name: what ``jascl weights fetch`` calls it.
        title: the model in words.
        archive: URL, file name and checksum.
        licence: the weights' licence, as their source states it.
        source: the official page.
        use: how to point jascl at the file; ``{path}`` is replaced by the file jascl reads.
        convert: ``torchscript-to-safetensors`` for OpenAI's CLIP (see the module docstring).
        converted: the converted file's name.
    """

    name: str
    title: str
    archive: Archive
    licence: str
    source: str
    use: str
    convert: str | None = None
    converted: str = ""

    @property
    def verification(self) -> str:
        a = self.archive
        return f"{a.checksum_kind} ({a.checksum_source})" if a.verified else "none recorded: --no-verify"


WEIGHTS: dict[str, WeightsEntry] = {
    w.name: w
    for w in (
        WeightsEntry(
            name="sam-vit-b",
            title="Segment Anything ViT-B (sam_vit_b_01ec64.pth; the image encoder of the sam-vitb backbone)",
            archive=Archive(
                "https://dl.fbaipublicfiles.com/segment_anything/sam_vit_b_01ec64.pth",
                "sam_vit_b_01ec64.pth",
                sha256="ec2df62732614e57411cdcf32a23ffdf28910380d03139ee0f4fcbe91eb8c912",
                checksum_source=RECORDED,
                checksum_note="SHA-256 pinned by several public projects (Meta publishes none)",
            ),
            licence="Apache-2.0 (github.com/facebookresearch/segment-anything)",
            source="github.com/facebookresearch/segment-anything#model-checkpoints",
            use="jascl run --backbone sam-vitb --weights {path} ...",
        ),
        WeightsEntry(
            name="clip-vit-b-32",
            title="OpenAI CLIP ViT-B/32 (its text tower encodes the class names for clip-driven and clip-ct)",
            archive=Archive(
                f"https://openaipublic.azureedge.net/clip/models/{_OPENAI_SHA}/ViT-B-32.pt",
                "ViT-B-32.pt",
                sha256=_OPENAI_SHA,
                checksum_source=PUBLISHED,
                checksum_note="SHA-256 published by OpenAI in the URL (URL from open_clip's pretrained table)",
            ),
            licence="MIT (github.com/openai/CLIP)",
            source="github.com/openai/CLIP",
            use="jascl text-embeddings --weights {path} --model ViT-B-32-quickgelu --protocol med-mixed "
            "--out med-mixed-clip.safetensors, then jascl run --methods clip-driven "
            "--set method_args.clip-driven.embeddings=med-mixed-clip.safetensors",
            convert="torchscript-to-safetensors",
            converted="ViT-B-32-openai.safetensors",
        ),
        WeightsEntry(
            name="fasterrcnn-resnet50-fpn-coco",
            title="torchvision's COCO-trained Faster R-CNN ResNet-50 FPN (the fasterrcnn-resnet50-fpn detector)",
            archive=Archive(
                "https://download.pytorch.org/models/fasterrcnn_resnet50_fpn_coco-258fb6c6.pth",
                "fasterrcnn_resnet50_fpn_coco-258fb6c6.pth",
                sha256="258fb6c6",
                checksum_source=PUBLISHED,
                checksum_note="SHA-256 prefix in the file name (torchvision's FasterRCNN_ResNet50_FPN_Weights.COCO_V1, "
                "checked as torch.hub checks it)",
            ),
            licence="torchvision's BSD-3-Clause; its README notes that pretrained weights may carry terms of their "
            "training data (COCO)",
            source="pytorch.org/vision (torchvision.models.detection)",
            use="jascl run --protocol coco-o --weights {path} ... (the box predictor is not loaded)",
        ),
        WeightsEntry(
            name="clip-driven-swin-unetr",
            title="CLIP-driven universal model, Swin UNETR (the authors' released checkpoint)",
            archive=Archive(
                _UNIVERSAL + "clip_driven_universal_swin_unetr.pth",
                "clip_driven_universal_swin_unetr.pth",
                checksum_note=_UNIVERSAL_NOTE,
            ),
            licence="CC BY-NC-ND 4.0 (the repository's LICENSE)",
            source="github.com/ljwztc/CLIP-Driven-Universal-Model",
            use="jascl run --methods clip-driven --backbone swinunetr --weights {path}: loads the Swin UNETR body (the "
            "universal head and the body's output block are skipped; the layout is tested on a file built like this one, "
            "the file itself was not checked here: a key that does not fit is named in one line)",
        ),
        WeightsEntry(
            name="clip-driven-unet",
            title="CLIP-driven universal model, U-Net (the authors' released checkpoint)",
            archive=Archive(
                _UNIVERSAL + "clip_driven_universal_unet.pth",
                "clip_driven_universal_unet.pth",
                checksum_note=_UNIVERSAL_NOTE,
            ),
            licence="CC BY-NC-ND 4.0 (the repository's LICENSE)",
            source="github.com/ljwztc/CLIP-Driven-Universal-Model",
            use="a reference checkpoint: its U-Net is the authors' own, not one of jascl's backbones; --weights loads "
            "it only into a backbone whose keys it fits",
        ),
    )
}


def get_weights_entry(name: str) -> WeightsEntry:
    """The entry of a checkpoint name.

    Raises:
        ConfigError: an unknown name (one line listing the known ones).
    """
    if name not in WEIGHTS:
        raise ConfigError(f"weights {name!r}: not known; choose one of {', '.join(WEIGHTS)} (see 'jascl weights list')")
    return WEIGHTS[name]


def fetch_weights(
    name: str,
    to: str | Path | None = None,
    *,
    no_verify: bool = False,
    progress: bool = True,
    echo: Callable[[str], None] = print,
) -> Path:
    """Fetch checkpoint ``name`` into ``to`` (default ``$JASCL_DATA/weights``), verify it, convert it where needed,
    and print how to use it.

    Returns:
        the file jascl reads (the converted one for OpenAI's CLIP).

    Raises:
        ConfigError: an unknown name or no folder.
        DataError: a failed, interrupted or unverifiable download (see :func:`jascl.download.fetch`).
        CheckpointError: a TorchScript file to convert whose SHA-256 is not OpenAI's (never loaded).
    """
    entry = get_weights_entry(name)
    folder = download_folder(to, "weights")
    echo(f"{entry.name}: {entry.title} -> {folder}")
    echo(f"licence: {entry.licence}")
    fetched = fetch(entry.archive, folder, accept_unverified=no_verify, progress=progress, echo=echo)
    path = fetched.path
    if entry.convert == "torchscript-to-safetensors":
        target = folder / entry.converted
        if not target.is_file():
            sha = fetched.sha256 or file_digests(path)["sha256"]
            if sha != entry.archive.sha256:
                raise CheckpointError(
                    f"{path}: SHA-256 {sha} is not the published {entry.archive.sha256}, so this TorchScript file is "
                    "not loaded to convert it; delete it and fetch it again"
                )
            echo(f"converting {path.name} (TorchScript) to {target.name} ...")
            torchscript_to_safetensors(path, target)
        path = target
    echo(f"{entry.name} is ready: {path}")
    echo("use it: " + entry.use.format(path=path))
    return path


def torchscript_to_safetensors(src: str | Path, dst: str | Path) -> Path:
    """Write the tensors of the TorchScript module ``src`` to the safetensors file ``dst`` (atomically).

    Only for a file whose SHA-256 was checked against its publisher's (``torch.jit.load`` runs the archive's
    TorchScript, which ``weights_only`` loading refuses for that reason). OpenAI's non-tensor entries
    ``input_resolution``, ``context_length`` and ``vocab_size`` are dropped, as open_clip drops them; the rest keep
    their names and dtypes (OpenAI's CLIP is partly float16), which are open_clip's ``CLIP`` state-dict names.
    """
    import torch
    from safetensors.torch import save_file

    with warnings.catch_warnings():  # torch.jit is deprecated in favour of torch.export; OpenAI ships TorchScript
        warnings.simplefilter("ignore", FutureWarning)
        module = torch.jit.load(str(src), map_location="cpu")
    state = {k: v.detach().clone().contiguous() for k, v in module.state_dict().items() if k not in _CLIP_EXTRA_KEYS}
    dst = Path(dst)
    atomic_write(dst, lambda tmp: save_file(state, str(tmp)), suffix=".safetensors")
    return dst
