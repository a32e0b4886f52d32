"""Where each public dataset comes from: the table behind ``jascl data download``, ``jascl data list`` and the
documentation page "Getting the data" (generated from :data:`CATALOGUE`, so the three cannot drift apart).

One :class:`DatasetEntry` per dataset root name the built-in protocols use (``--root NAME=PATH``), plus COCO 2017
(the ``coco`` detection layout). An entry is either

* **download**: archives with an official (or the host's mirror) URL that ``jascl data download NAME --to DIR``
  fetches (resumable, :mod:`jascl.download`), verifies and unpacks into ``DIR/NAME/``; the root is the folder in
  there that holds the entry's ``marker`` file; or
* **manual**: the data needs a registration or an account (Synapse, Kaggle, the Cityscapes / BDD100K / IDD sites) or
  has no direct link (a Google Drive page): the command prints where to register, which archive to fetch and where
  to unpack it, and touches no network.

Checksums: the Decathlon tasks' MD5s are MONAI's (``monai.apps.DecathlonDataset.md5``, published with the
``msd-for-monai`` mirror the URLs point to); AMOS22's SHA-256 is the one torch-em verifies its download with; COCO
2017's MD5s are the ones public download scripts check (COCO publishes none). TotalSegmentator and VerSe publish no
checksum that could be recorded here: their downloads need ``--no-verify`` and print the SHA-256 they got. Sizes are
given only where a source states them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from jascl.download import DATA_ENV, PUBLISHED, RECORDED, Archive, download_folder
from jascl.errors import ConfigError

_MSD_CHECKSUM = "MD5 of MONAI's Decathlon table (monai.apps.DecathlonDataset.md5), published with its mirror"
_MSD_LICENCE = "CC-BY-SA 4.0 (medicaldecathlon.com)"
_COCO_NOTE = "MD5 checked by public COCO download scripts (cocodataset.org publishes no checksum)"


@dataclass(frozen=True)
class DatasetEntry:
    """One dataset root.

    Attributes:
        name: the root name protocols use (``--root NAME=PATH``, ``JASCL_ROOT_<NAME>``).
        title: the dataset (and part) in words.
        layout: the jascl layout that reads the root (:data:`jascl.data.layouts.LAYOUTS`, or ``coco``).
        licence: the data's licence or terms, as its source states them.
        source: the official page.
        archives: what ``data download`` fetches (download entries), unpacked in this order into ``DIR/NAME/``.
        msd_task: a Decathlon task whose URL and MD5 come from MONAI's table at download time.
        marker: a file (or folder) whose presence marks the root inside ``DIR/NAME/`` after unpacking.
        prepare: a step after unpacking (``verse-index``: write a ``dataset.json`` over VerSe's own folders).
        size: the download size as its source states it ("" when not recorded).
        access: manual entries: how access is granted (registration, an account, a page without a direct link).
        register / fetch / unpack: manual entries: where to register, which archive(s), how to unpack them.
        note: anything else the user must know (a version, a conversion).
    """

    name: str
    title: str
    layout: str
    licence: str
    source: str
    archives: tuple[Archive, ...] = ()
    msd_task: str | None = None
    marker: str = ""
    prepare: str | None = None
    size: str = ""
    access: str = ""
    register: str = ""
    fetch: str = ""
    unpack: str = ""
    note: str = ""

    @property
    def downloadable(self) -> bool:
        return bool(self.archives or self.msd_task)

    def resolved_archives(self) -> tuple[Archive, ...]:
        """The archives, the Decathlon task's read from MONAI's table (imports MONAI: call it only to download)."""
        if self.msd_task is None:
            return self.archives
        from monai.apps.datasets import DecathlonDataset

        url = DecathlonDataset.resource[self.msd_task]
        md5 = DecathlonDataset.md5[self.msd_task]
        return (Archive(url, Path(url).name, md5=md5, checksum_source=PUBLISHED, checksum_note=_MSD_CHECKSUM),)

    @property
    def verification(self) -> str:
        """How a download is checked, in words (``data list``, the docs)."""
        if not self.downloadable:
            return "—"
        if self.msd_task:
            return "MD5 (published: MONAI's Decathlon table)"
        kinds = {a.checksum_kind for a in self.archives}
        if "" in kinds:
            return "none recorded: --no-verify"
        sources = sorted({a.checksum_source for a in self.archives})
        return f"{'/'.join(sorted(kinds))} ({', '.join(sources)})"

    @property
    def how(self) -> str:
        """ "download" or the manual access, in words."""
        return "download" if self.downloadable else f"manual: {self.access}"


def _msd(name: str, task: str, part: str) -> DatasetEntry:
    return DatasetEntry(
        name=name,
        title=f"Medical Segmentation Decathlon {task} (the MOTS {part} part)",
        layout="msd",
        licence=_MSD_LICENCE,
        source="medicaldecathlon.com (archive from MONAI's msd-for-monai mirror)",
        msd_task=task,
        marker="dataset.json",
    )


def _verse(split: str) -> Archive:
    url = f"https://s3.bonescreen.de/public/VerSe-complete/dataset-verse20{split}.zip"
    return Archive(url, Path(url).name)


#: every dataset root jascl knows, by root name
CATALOGUE: dict[str, DatasetEntry] = {
    e.name: e
    for e in (
        DatasetEntry(
            name="ts",
            title="TotalSegmentator v1.0 (1204 CT, v1 structure names with the heart chambers)",
            layout="totalsegmentator",
            licence="as stated on the Zenodo record 6802614",
            source="zenodo.org/records/6802614",
            archives=(
                Archive(
                    "https://zenodo.org/records/6802614/files/Totalsegmentator_dataset.zip",
                    "Totalsegmentator_dataset.zip",
                ),
            ),
            marker="meta.csv",
            note="v1 is the version the protocols name (v2 renamed and merged structures)",
        ),
        DatasetEntry(
            name="amos",
            title="AMOS22 (500 CT + 100 MRI, 15 abdominal organs)",
            layout="msd",
            licence="non-commercial (CC BY-NC, per its NeurIPS 2022 datasets entry; the Zenodo record 7155725 states it)",
            source="amos22.grand-challenge.org, zenodo.org/records/7155725",
            archives=(
                Archive(
                    "https://zenodo.org/records/7155725/files/amos22.zip",
                    "amos22.zip",
                    sha256="d2fbf2c31abba9824d183f05741ce187b17905b8cca64d1078eabf1ba96775c2",
                    checksum_source=RECORDED,
                    checksum_note="SHA-256 that torch-em verifies its AMOS download with "
                    "(constantinpape/torch-em, torch_em/data/datasets/medical/amos.py)",
                ),
            ),
            marker="dataset.json",
            note="imagesVa/labelsVa are not read unless moved into imagesTr/labelsTr",
        ),
        DatasetEntry(
            name="bcv",
            title="BTCV / BCV, Multi-Atlas Labeling Beyond the Cranial Vault (abdomen, 13 organs)",
            layout="msd",
            licence="Synapse's terms for the challenge data (accepted when registering)",
            source="synapse.org/#!Synapse:syn3193805",
            access="registration on Synapse",
            register="create a Synapse account and join the challenge at https://www.synapse.org/#!Synapse:syn3193805",
            fetch="Files -> Abdomen -> RawData.zip (RawData/Training/img/img*.nii.gz, label/label*.nii.gz)",
            unpack="convert it to the nnU-Net raw layout with nnU-Net v1's "
            "dataset_conversion/Task017_BeyondCranialVaultAbdominalOrganSegmentation.py (github.com/MIC-DKFZ/nnUNet); "
            "the root is the converted folder (dataset.json, imagesTr/, labelsTr/)",
        ),
        _msd("msd_hepaticvessel", "Task08_HepaticVessel", "hepatic vessel"),
        _msd("msd_colon", "Task10_Colon", "colon"),
        _msd("msd_lung", "Task06_Lung", "lung"),
        DatasetEntry(
            name="brats",
            title="BraTS 2021 (RSNA-ASNR-MICCAI), Task 1 training data (1251 subjects, 4 MRI modalities)",
            layout="brats",
            licence="the challenge's data terms (accepted when registering)",
            source="synapse.org (RSNA-ASNR-MICCAI BraTS 2021); also cancerimagingarchive.net",
            access="registration on Synapse or TCIA",
            register="register for BraTS 2021 on Synapse (the RSNA-ASNR-MICCAI BraTS 2021 challenge) or at "
            "https://www.cancerimagingarchive.net/analysis-result/rsna-asnr-miccai-brats-2021/",
            fetch="the Task 1 training archive (BraTS2021_Training_Data.tar)",
            unpack="untar it; the root is the folder holding the BraTS2021_XXXXX/ subject folders (a folder one level "
            "above them works too)",
        ),
        DatasetEntry(
            name="verse",
            title="VerSe'20 (spine CT, vertebra labels 1-28), complete release: training, validation, test",
            layout="msd",
            licence="CC BY-SA 4.0 (github.com/anjany/verse)",
            source="github.com/anjany/verse",
            archives=tuple(_verse(s) for s in ("training", "validation", "test")),
            marker="dataset.json",
            prepare="verse-index",
            note="VerSe's own rawdata/ + derivatives/ folders are indexed by a dataset.json written after unpacking "
            "(nnU-Net v2 'dataset' mapping: <scan>_ct.nii.gz with its <scan>_seg-vert_msk.nii.gz); VerSe'19's "
            "archives are at the same address (dataset-verse19*.zip)",
        ),
        DatasetEntry(
            name="bdd100k",
            title="BDD100K semantic segmentation (10k images, 19 classes)",
            layout="bdd100k",
            licence="the BDD100K licence (accepted when registering)",
            source="bdd-data.berkeley.edu",
            access="registration on the BDD100K site",
            register="create an account at https://bdd-data.berkeley.edu and open the download page",
            fetch="bdd100k_images_10k.zip and bdd100k_sem_seg_labels_trainval.zip",
            unpack="unzip both into one folder; the root is the folder holding images/10k/ and labels/sem_seg/ "
            "(or a single bdd100k/ folder with them)",
        ),
        DatasetEntry(
            name="idd",
            title="IDD, India Driving Dataset, segmentation part",
            layout="idd",
            licence="the IDD terms of use (accepted when registering)",
            source="idd.insaan.iiit.ac.in",
            access="registration on the IDD site",
            register="register at https://idd.insaan.iiit.ac.in and open the dataset downloads",
            fetch="the IDD Segmentation archive (idd-segmentation.tar.gz)",
            unpack="untar it; the root is its IDD_Segmentation/ folder (leftImg8bit/, gtFine/); optionally run "
            "AutoNUE's createLabels.py --id-type level3Id first (github.com/AutoNUE/public-code)",
        ),
        DatasetEntry(
            name="cityscapes",
            title="Cityscapes, fine annotations (label ids 0..33)",
            layout="cityscapes",
            licence="the Cityscapes terms of use (accepted when registering)",
            source="cityscapes-dataset.com",
            access="registration on the Cityscapes site",
            register="register at https://www.cityscapes-dataset.com (an institutional e-mail address) and log in",
            fetch="leftImg8bit_trainvaltest.zip and gtFine_trainvaltest.zip",
            unpack="unzip both into one folder; the root is the folder holding leftImg8bit/ and gtFine/",
        ),
        DatasetEntry(
            name="cholecseg8k",
            title="CholecSeg8k (17 laparoscopic videos, 13 classes)",
            layout="cholecseg8k",
            licence="as stated on its Kaggle page",
            source="kaggle.com/datasets/newslab/cholecseg8k",
            access="a Kaggle account",
            register="log in to Kaggle (kaggle.com) and open https://www.kaggle.com/datasets/newslab/cholecseg8k",
            fetch="the dataset's archive (Download)",
            unpack="unzip it; the root is the folder holding video01/, video09/, ...",
        ),
        DatasetEntry(
            name="m2caiseg",
            title="m2caiSeg (laparoscopic images, 19 colour classes)",
            layout="m2caiseg",
            licence="as stated on its Kaggle page",
            source="kaggle.com/datasets/salmanmaq/m2caiseg",
            access="a Kaggle account",
            register="log in to Kaggle (kaggle.com) and open https://www.kaggle.com/datasets/salmanmaq/m2caiseg",
            fetch="the dataset's archive (Download)",
            unpack="unzip it; the root is the folder holding 'm2caiSeg dataset/' (or that folder itself)",
        ),
        DatasetEntry(
            name="coco_o",
            title="COCO-O (6 domains of COCO's 80 classes, 6,782 images)",
            layout="coco-o",
            licence="not stated in its README",
            source="github.com/alibaba/easyrobust (benchmarks/coco_o)",
            access="a Google Drive page, no direct link",
            register="no registration; open the Google Drive link in the README of "
            "github.com/alibaba/easyrobust/tree/main/benchmarks/coco_o",
            fetch="ood_coco.zip",
            unpack="unzip it; the root is the folder holding the six domain folders (cartoon/, handmake/, painting/, "
            "sketch/, tattoo/, weather/)",
        ),
        DatasetEntry(
            name="coco",
            title="COCO 2017 validation images and annotations (for the coco detection layout)",
            layout="coco",
            licence="annotations CC BY 4.0; images under their Flickr terms (cocodataset.org/#termsofuse)",
            source="cocodataset.org/#download",
            archives=(
                Archive(
                    "http://images.cocodataset.org/zips/val2017.zip",
                    "val2017.zip",
                    md5="442b8da7639aecaf257c1dceb8ba8c80",
                    checksum_source=RECORDED,
                    checksum_note=_COCO_NOTE,
                    size=815585330,
                ),
                Archive(
                    "http://images.cocodataset.org/annotations/annotations_trainval2017.zip",
                    "annotations_trainval2017.zip",
                    md5="f4bbac642086de4f52a3fdda2de5fa2c",
                    checksum_source=RECORDED,
                    checksum_note=_COCO_NOTE,
                    size=252907541,
                ),
            ),
            marker="annotations",
            size="1.07 GB (815,585,330 + 252,907,541 bytes)",
            note="not used by a built-in protocol; a protocol of yours reads it with layout coco and options "
            "annotations: annotations/instances_val2017.json, images: val2017",
        ),
    )
}


def get_entry(name: str) -> DatasetEntry:
    """The entry of a root name.

    Raises:
        ConfigError: an unknown name (one line listing the known ones).
    """
    if name not in CATALOGUE:
        raise ConfigError(f"dataset {name!r}: not known; choose one of {', '.join(CATALOGUE)} (see 'jascl data list')")
    return CATALOGUE[name]


def protocol_roots() -> dict[str, dict[str, str]]:
    """Root name -> {built-in protocol name: the layout it reads that root with}, over every built-in protocol."""
    from jascl.protocols import builtin_protocols, get_protocol

    out: dict[str, dict[str, str]] = {}
    for pname, path in builtin_protocols().items():
        for spec in get_protocol(path).datasets.values():
            out.setdefault(spec.root, {})[pname] = spec.layout
    return out


def data_folder(to: str | Path | None, environ: Mapping[str, str] | None = None) -> Path:
    """The download folder: ``--to``, else ``$JASCL_DATA``.

    Raises:
        ConfigError: neither is given.
    """
    return download_folder(to, environ=environ)


def find_root(entry: DatasetEntry, folder: Path) -> Path | None:
    """The folder under ``folder`` (itself or up to two levels down) that holds ``entry.marker``, or None."""
    if not folder.is_dir():
        return None
    if not entry.marker:
        return folder
    for depth in range(3):
        pattern = "/".join(["*"] * depth + [entry.marker])
        hits = sorted(
            p.parent for p in folder.glob(pattern) if not any(s.startswith(".") for s in p.parts[-depth - 1 :])
        )
        if hits:
            return hits[0]
    return None


def default_root(name: str, environ: Mapping[str, str] | None = None) -> Path | None:
    """Where ``jascl data download NAME`` put the root under ``$JASCL_DATA``, if it did (else None)."""
    environ = os.environ if environ is None else environ
    if name not in CATALOGUE or not environ.get(DATA_ENV):
        return None
    entry = CATALOGUE[name]
    folder = Path(environ[DATA_ENV]).expanduser() / name
    if not (folder / ".jascl-ready").is_file():
        return None
    return find_root(entry, folder)
