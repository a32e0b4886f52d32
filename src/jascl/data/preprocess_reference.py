"""The ``preprocess`` keys of a dataset entry, documented for the protocol reference (``docs/protocol-reference.md``).

Volumes are preprocessed by :func:`jascl.data.medical.preprocess_volume`, images by
:func:`jascl.data.natural.preprocess_image`; ``tests/test_protocol_reference.py`` checks that these rows name
exactly the keys those functions accept and that every example is accepted by them.
"""

from __future__ import annotations

from jascl.data.medical import CT_WINDOW

#: (key, type, default, allowed, description, example) per key, volumes (3D protocols)
VOLUME_KEYS: tuple[tuple[str, str, str, str, str, str], ...] = (
    (
        "orientation",
        "axis codes",
        "`RAS`",
        "three of R/L, A/P, S/I; empty: keep the file's",
        "reorient every volume (MONAI `Orientationd`) so that patches and overlays share one orientation",
        "orientation: LPS",
    ),
    (
        "spacing",
        "three numbers > 0 (mm)",
        "none (the native spacing)",
        "",
        "resample to this voxel size (trilinear image, nearest-neighbour label; MONAI `Spacingd`); "
        "`jascl data check` reports a volume it would collapse below 2 voxels along an axis",
        "spacing: [1.5, 1.5, 2.0]",
    ),
    (
        "intensity",
        "string",
        "`ct` for a CT dataset (one channel named CT), else `mri`",
        "`ct`, `mri`, `none`",
        "`ct`: clip to `window` and map linearly to `range`; `mri`: z-score per channel; `none`: raw values",
        "intensity: mri",
    ),
    (
        "window",
        "[low, high] Hounsfield units",
        f"`[{CT_WINDOW[0]:g}, {CT_WINDOW[1]:g}]` (soft tissue)",
        "high > low",
        "the CT window of `intensity: ct`",
        "window: [-100, 240]",
    ),
    ("range", "[low, high]", "`[0, 1]`", "", "what the CT window maps to", "range: [-1, 1]"),
    (
        "nonzero",
        "true / false",
        "`true`",
        "",
        "z-score over non-zero voxels only (`intensity: mri`): the background of skull-stripped MRI stays 0",
        "nonzero: false",
    ),
)

#: the same for images (2D protocols)
IMAGE_KEYS: tuple[tuple[str, str, str, str, str, str], ...] = (
    (
        "size",
        "[height, width]",
        "none (kept)",
        "not with `scale`",
        "resize every image (bilinear; labels nearest)",
        "size: [512, 1024]",
    ),
    ("scale", "number > 0", "none (kept)", "not with `size`", "resize by this factor (rounded)", "scale: 0.5"),
    (
        "normalize",
        "string",
        "none (raw 0-255 values)",
        "`imagenet`, `zero_one`, `none`",
        "`imagenet`: ImageNet mean / std (pretrained backbones); `zero_one`: x / 255",
        "normalize: imagenet",
    ),
)
