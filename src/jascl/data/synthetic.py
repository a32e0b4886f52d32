"""Embedded synthetic benchmark: seeded 2D images / 3D volumes with joint nonstationarity.

Every class is a *shape family* (disc, ring, cross, ...) and every domain an
*appearance* (class intensities, background, texture, bias field, blur, gamma,
contrast inversion, additive and multiplicative noise -- think CT vs MRI vs
ultrasound). A protocol's sessions then introduce new classes in new domains
with K labelled samples per class, and may bring old classes back in a new
domain, exactly the structure of the paper's benchmarks, at a size that trains
on a laptop CPU in minutes.

Data layout per session (all splits keep the *full* ground truth; the
training label policy of :mod:`jascl.data.datasets` hides untaught classes):

* ``train``: labelled samples. Base session: ``train`` images with 1..n objects of
  the session's classes. K-shot sessions: K images per taught class, each with
  one or two instances of that class.
* ``unlabelled``: pool images of the session's domain (ground truth kept hidden,
  for measuring pseudo-label quality only), then the samples borrowed from earlier
  sessions' domains (``unlabelled_sources``): fresh renders in that domain with objects
  of the classes the earlier sessions taught there, ids ``s<t>-<name>/extra-<domain>/<i>``,
  labels all 255 (images only, no ground truth).
* ``test``: images with objects of the session's classes only, so every class
  is measured in the domain(s) where it was taught.
* ``validation`` (``validation`` > 0): that many images per taught class, each with
  one or two instances of it and, like ``test``, no other class; for model selection.

Every sample is drawn from its own random stream, seeded by (seed, session, split
name, index), so adding validation samples leaves the other splits bit-identical.

Training and unlabelled images also contain up to ``distractors`` objects of
classes introduced in *earlier* sessions, rendered in the new domain: as in the
real benchmarks (a liver visible in a kidney-tumour CT), old structures appear
unlabelled in new data -- the background shift that drives forgetting.
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import torch
from monai.transforms import GaussianSmooth

from jascl.data.types import SessionData, Split
from jascl.errors import DataError
from jascl.fileio import atomic_write
from jascl.protocols.schema import IGNORE_INDEX, DomainSpec, Protocol, SessionSpec

GENERATOR_VERSION = 2

DEFAULT_APPEARANCE: dict = {
    "background": 0.1,
    "class_intensity": [0.3, 0.9],
    "noise": 0.05,
    "speckle": 0.0,
    "blur": 0.0,
    "texture": 0.0,
    "invert": False,
    "bias_field": 0.0,
    "gamma": 1.0,
    "jitter": 0.03,
}


def _radius(u: np.ndarray) -> np.ndarray:
    return np.sqrt((u**2).sum(0))


def _linf(u: np.ndarray) -> np.ndarray:
    return np.abs(u).max(0)


def _rest_radius(u: np.ndarray) -> np.ndarray:
    """Euclidean norm over all axes but the first."""
    return np.sqrt((u[1:] ** 2).sum(0))


def _cross(u: np.ndarray) -> np.ndarray:
    arms = []
    for axis in range(u.shape[0]):
        others = np.delete(np.abs(u), axis, axis=0).max(0)
        arms.append((np.abs(u[axis]) <= 1.0) & (others <= 0.3))
    return np.logical_or.reduce(arms)


def _cone(u: np.ndarray) -> np.ndarray:
    h = u[-1]
    rest = np.sqrt((u[:-1] ** 2).sum(0))
    return (h >= -0.7) & (h <= 0.9) & (rest <= 0.9 * (0.9 - h) / 1.6)


def _star(u: np.ndarray) -> np.ndarray:
    angle = np.arctan2(u[1], u[0])
    return _radius(u) <= 0.72 + 0.28 * np.cos(5 * angle)


def _crescent(u: np.ndarray) -> np.ndarray:
    shifted = u.copy()
    shifted[0] -= 0.5
    return (_radius(u) <= 1.0) & (_radius(shifted) >= 0.8)


#: Shape families, each a predicate on object-frame coordinates ``u`` of shape (D, *spatial),
#: where the object's nominal radius is 1.
SHAPES: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "disc": lambda u: _radius(u) <= 1.0,
    "square": lambda u: _linf(u) <= 0.8,
    "diamond": lambda u: np.abs(u).sum(0) <= 1.15,
    "ring": lambda u: (_radius(u) <= 1.0) & (_radius(u) >= 0.55),
    "frame": lambda u: (_linf(u) <= 0.85) & (_linf(u) >= 0.5),
    "cross": _cross,
    "bar": lambda u: (np.abs(u[0]) <= 1.0) & (_rest_radius(u) <= 0.28),
    "ellipse": lambda u: u[0] ** 2 + (_rest_radius(u) / 0.5) ** 2 <= 1.0,
    "triangle": _cone,
    "star": _star,
    "crescent": _crescent,
}


def _stable_int(*parts: object) -> int:
    return zlib.crc32("/".join(map(str, parts)).encode())


def class_intensity(seed: int, domain: DomainSpec, class_id: int) -> float:
    """Deterministic mean intensity of ``class_id`` in ``domain`` (drawn from the domain's range)."""
    lo, hi = domain.appearance.get("class_intensity", DEFAULT_APPEARANCE["class_intensity"])
    rng = np.random.default_rng([seed, _stable_int(domain.name), class_id])
    return float(rng.uniform(lo, hi))


def _random_rotation(rng: np.random.Generator, dims: int) -> np.ndarray:
    q, r = np.linalg.qr(rng.normal(size=(dims, dims)))
    q = q * np.sign(np.diag(r))
    if np.linalg.det(q) < 0:
        q[:, 0] = -q[:, 0]
    return q


def _smooth_field(rng: np.random.Generator, size: tuple[int, ...], sigma: float) -> np.ndarray:
    """Zero-mean, unit-std smooth random field (Gaussian-smoothed white noise, via MONAI)."""
    noise = torch.as_tensor(rng.normal(size=(1, *size)), dtype=torch.float32)
    field = GaussianSmooth(sigma=sigma)(noise)[0]
    field = torch.as_tensor(field)
    field = (field - field.mean()) / (field.std() + 1e-6)
    return field.numpy()


class SyntheticRenderer:
    """Renders samples of one protocol. Pure function of (protocol, session, split, index)."""

    def __init__(self, protocol: Protocol) -> None:
        if protocol.synthetic is None:
            raise DataError(f"{protocol.path}: protocol has no 'synthetic' section; it cannot be generated")
        self.protocol = protocol
        self.spec = protocol.synthetic
        self.size = self.spec.size
        self.dims = protocol.spatial_dims
        self.grid = np.stack(np.meshgrid(*[np.arange(s, dtype=np.float32) for s in self.size], indexing="ij"))
        self.shapes = {c.id: c.shape for c in protocol.classes if c.id != 0}
        for cid, shape in self.shapes.items():
            if shape not in SHAPES:
                raise DataError(
                    f"{protocol.path}: class {cid} has unknown shape {shape!r}; choose one of {', '.join(SHAPES)}"
                )

    def _object_mask(self, rng: np.random.Generator, shape: str) -> np.ndarray:
        lo, hi = self.spec.object_radius
        radius = rng.uniform(lo, hi) * min(self.size)
        center = np.array([rng.uniform(radius, s - radius) for s in self.size], dtype=np.float32)
        rot = _random_rotation(rng, self.dims).astype(np.float32)
        stretch = rng.uniform(0.85, 1.15, size=self.dims).astype(np.float32)
        rel = self.grid - center.reshape(-1, *([1] * self.dims))
        u = np.tensordot(rot.T, rel, axes=1) / (radius * stretch).reshape(-1, *([1] * self.dims))
        return SHAPES[shape](u)

    def render(self, rng: np.random.Generator, domain: DomainSpec, objects: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Render one sample with the given object classes (drawn in order) in ``domain``.

        Returns:
            image (C, *spatial) float32 and label (*spatial) uint8.
        """
        app = {**DEFAULT_APPEARANCE, **domain.appearance}
        label = np.zeros(self.size, dtype=np.uint8)
        intensity = np.full(self.size, app["background"], dtype=np.float32)
        for cid in objects:
            mask = self._object_mask(rng, self.shapes[cid])
            label[mask] = cid
            mean = class_intensity(self.protocol.seed, domain, cid)
            intensity[mask] = mean + rng.normal(0.0, app["jitter"])
        smooth_sigma = max(2.0, min(self.size) / 8)
        if app["texture"] > 0:
            intensity = intensity + app["texture"] * _smooth_field(rng, self.size, sigma=1.0) * 0.5
        if app["bias_field"] > 0:
            intensity = intensity * (1.0 + app["bias_field"] * _smooth_field(rng, self.size, sigma=smooth_sigma))
        if app["blur"] > 0:
            intensity = np.asarray(GaussianSmooth(sigma=app["blur"])(torch.as_tensor(intensity)[None])[0])
        intensity = np.clip(intensity, 0.0, 1.0) ** app["gamma"]
        if app["invert"]:
            intensity = 1.0 - intensity
        if app["speckle"] > 0:
            intensity = intensity * (1.0 + app["speckle"] * rng.normal(size=self.size))
        if app["noise"] > 0:
            intensity = intensity + app["noise"] * rng.normal(size=self.size)
        image = np.repeat(intensity[None].astype(np.float32), self.protocol.in_channels, axis=0)
        return image, label

    # ------------------------------------------------------------------ sessions

    def _distractor_pool(self, session: SessionSpec) -> list[int]:
        earlier = [c for s in self.protocol.sessions[: session.index] for c in s.new_classes]
        return [c for c in earlier if c not in session.classes]

    def _sample_objects(
        self, rng: np.random.Generator, session: SessionSpec, primary: int | None, distractors: bool
    ) -> list[int]:
        lo, hi = self.spec.objects_per_image
        if primary is None:
            objects = [int(c) for c in rng.choice(session.classes, size=int(rng.integers(lo, hi + 1)))]
        else:
            objects = [primary] * int(rng.integers(1, 3))
        pool = self._distractor_pool(session)
        if distractors and pool and self.spec.distractors > 0:
            n = int(rng.integers(0, self.spec.distractors + 1))
            # distractors go underneath so the taught objects stay fully visible
            objects = [int(c) for c in rng.choice(pool, size=n)] + objects
        return objects

    def _split(self, session: SessionSpec, split: str, plan: list[int | None], distractors: bool) -> Split:
        images, labels, ids = [], [], []
        domains = [self.protocol.domains[d] for d in session.domains]
        for i, primary in enumerate(plan):
            rng = np.random.default_rng([self.protocol.seed, session.index, _stable_int(split), i])
            domain = domains[i % len(domains)]
            image, label = self.render(rng, domain, self._sample_objects(rng, session, primary, distractors))
            images.append(image)
            labels.append(label)
            ids.append(f"s{session.index}-{session.name}/{split}/{i:05d}")
        return self._stack(images, labels, ids)

    def _stack(self, images: list[np.ndarray], labels: list[np.ndarray], ids: list[str]) -> Split:
        shape = (0, self.protocol.in_channels, *self.size)
        return Split(
            np.stack(images) if images else np.zeros(shape, np.float32),
            np.stack(labels) if labels else np.zeros((0, *self.size), np.uint8),
            ids,
        )

    def _borrowed(self, session: SessionSpec) -> Split:
        """The samples ``session`` borrows from earlier sessions' domains (``unlabelled_sources``).

        Each is a fresh render in the named domain, from its own random stream
        ``(seed, session, "extra-<domain>", i)``, with 1..n objects of the classes that earlier
        sessions taught in that domain; the label is all 255 (images only).
        """
        images, labels, ids = [], [], []
        lo, hi = self.spec.objects_per_image
        for src in session.unlabelled_sources:
            name = extra_split(str(src.domain))
            domain = self.protocol.domains[str(src.domain)]
            taught = sorted(
                {c for s in self.protocol.sessions[: session.index] if src.domain in s.domains for c in s.classes}
            )
            for i in range(src.count):
                rng = np.random.default_rng([self.protocol.seed, session.index, _stable_int(name), i])
                objects = [int(c) for c in rng.choice(taught, size=int(rng.integers(lo, hi + 1)))] if taught else []
                image, _ = self.render(rng, domain, objects)
                images.append(image)
                labels.append(np.full(self.size, IGNORE_INDEX, dtype=np.uint8))
                ids.append(f"s{session.index}-{session.name}/{name}/{i:05d}")
        return self._stack(images, labels, ids)

    def session(self, session: SessionSpec) -> SessionData:
        """Generate all splits of ``session``."""
        if session.shots is None:
            train_plan: list[int | None] = [None] * int(session.train or 0)
        else:
            train_plan = [c for c in session.classes for _ in range(session.shots)]
        train = self._split(session, "train", train_plan, distractors=True)
        test = self._split(session, "test", [None] * session.test, distractors=False)
        pool_plan: list[int | None] = [None] * session.unlabelled
        pool_plan += [c for c in session.classes for _ in range(session.unlabelled_per_class)]
        unlabelled = self._split(session, "unlabelled", pool_plan, distractors=True) if pool_plan else None
        if session.unlabelled_extra:
            borrowed = self._borrowed(session)
            unlabelled = borrowed if unlabelled is None else _concat(unlabelled, borrowed)
        validation = None
        if session.validation:
            val_plan: list[int | None] = [c for c in session.classes for _ in range(session.validation)]
            validation = self._split(session, "validation", val_plan, distractors=False)
        return SessionData(session, train, test, unlabelled, validation)


def extra_split(domain: str) -> str:
    """The split name (middle part of the ids) of the samples a session borrows from ``domain``."""
    return f"extra-{domain}"


def _concat(a: Split, b: Split) -> Split:
    return Split(np.concatenate([a.images, b.images]), np.concatenate([a.labels, b.labels]), [*a.ids, *b.ids])


# ----------------------------------------------------------------------- caching


def protocol_digest(protocol: Protocol) -> str:
    """Hash of everything that determines the generated data (not the training defaults)."""
    payload = {
        "v": GENERATOR_VERSION,
        "seed": protocol.seed,
        "dims": protocol.spatial_dims,
        "in": protocol.in_channels,
        "classes": [(c.id, c.shape) for c in protocol.classes],
        "domains": {k: dict(v.appearance) for k, v in protocol.domains.items()},
        "synthetic": protocol.synthetic.__dict__ if protocol.synthetic else None,
        "sessions": [
            (
                s.name,
                s.domains,
                s.new_classes,
                s.recurring_classes,
                s.shots,
                s.train,
                s.test,
                s.unlabelled,
                s.unlabelled_per_class,
            )
            for s in protocol.sessions
        ],
    }
    if any(s.validation for s in protocol.sessions):  # only then: the caches of earlier protocols stay valid
        payload["validation"] = [s.validation for s in protocol.sessions]
    if any(s.unlabelled_sources for s in protocol.sessions):  # likewise
        payload["unlabelled_sources"] = [[(u.domain, u.count) for u in s.unlabelled_sources] for s in protocol.sessions]
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=list).encode()).hexdigest()[:12]


def default_cache_dir() -> Path:
    """``$JASCL_CACHE`` or ``~/.cache/jascl``."""
    return Path(os.environ.get("JASCL_CACHE", Path.home() / ".cache" / "jascl"))


_SPLITS = ("train", "test", "unlabelled", "validation")


def _save_npz(path: Path, data: SessionData) -> None:
    arrays: dict[str, np.ndarray] = {}
    for name in _SPLITS:
        split: Split | None = getattr(data, name)
        if split is None:
            continue
        arrays[f"{name}_images"] = split.images
        arrays[f"{name}_labels"] = split.labels
        arrays[f"{name}_ids"] = np.array(split.ids)
    atomic_write(path, lambda tmp: np.savez_compressed(tmp, **arrays), suffix=".tmp.npz")


def _load_npz(path: Path, session: SessionSpec) -> SessionData:
    try:
        with np.load(path, allow_pickle=False) as z:
            splits = {}
            for name in _SPLITS:
                if f"{name}_images" in z:
                    splits[name] = Split(z[f"{name}_images"], z[f"{name}_labels"], [str(i) for i in z[f"{name}_ids"]])
    except (OSError, ValueError, KeyError) as exc:
        raise DataError(f"{path}: corrupt cache file ({exc}); delete it and rerun") from None
    return SessionData(session, splits["train"], splits["test"], splits.get("unlabelled"), splits.get("validation"))


def load_or_generate(
    protocol: Protocol, cache_dir: str | Path | None = None, progress: Callable[[str], None] | None = None
) -> list[SessionData]:
    """All sessions of a synthetic protocol, generated once and cached on disk.

    The cache key is the protocol name plus :func:`protocol_digest` (seed and
    every data-defining field), so editing a protocol regenerates its data.
    """
    renderer = SyntheticRenderer(protocol)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    folder = root / "synthetic" / f"{protocol.name}-{protocol_digest(protocol)}"
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for session in protocol.sessions:
        path = folder / f"session{session.index}.npz"
        if path.exists():
            out.append(_load_npz(path, session))
            continue
        if progress:
            progress(f"generating session {session.index} ({session.name})")
        data = renderer.session(session)
        _save_npz(path, data)
        out.append(data)
    return out


def domain_intensities(protocol: Protocol) -> Mapping[str, dict[int, float]]:
    """Per-domain class intensities, for documentation and inspection."""
    return {
        name: {c.id: class_intensity(protocol.seed, d, c.id) for c in protocol.classes if c.id}
        for name, d in protocol.domains.items()
    }
