"""A bounded labelled replay memory: at most ``size`` labelled samples (image + label) of earlier sessions.

**This stores real images of earlier sessions, which the JASCL setting otherwise forbids** (every other
method keeps at most prototypes or statistics). It exists for NNCSL (:mod:`jascl.methods.baselines.semi.nncsl`),
whose learner needs labelled support samples of earlier tasks; no other method uses it by default. A method that
adds it is a replay method and must say so.

What is stored. At the end of every session (``after_session``; ``session_restored`` for a session that was
reused, e.g. the shared base) the session's labelled training samples are offered to the memory, each as the
loop's training crop without augmentation (``patch_size``; the whole sample when it is null; the crop of a
lazy real-data sample is drawn from ``(seed, "labelled-memory", session)`` and the sample index, so it is the
same on every process and on a resumed run) and its *training* label: global class ids with the classes the
session did not teach hidden as the protocol says (0 or 255, :func:`jascl.data.datasets.training_labels`).
Samples are tensors on the CPU: images float32 ``(N, C, *spatial)``, labels uint8 ``(N, *spatial)``; all
stored samples have one shape (the training crop's), as the loop's own batches do.

Selection rule (class-balanced, herding-free, seeded; :func:`balanced_selection`). Every stored sample
is *assigned* one foreground class, the class it was kept for. With K foreground classes among the held
and offered samples, class c's quota is ``size // K``, plus one for the first ``size % K`` classes in
ascending id order. (1) Held samples of a class over its quota are cut to it, a random subset kept.
(2) Free slots are then filled one at a time: the class with the fewest stored samples that still has an
unused sample (ties: the smaller id) gets one, a held sample cut in (1) first (in random order), else an
offered sample showing the class (in one random order of the session's samples); samples showing no
foreground class fill slots only when no foreground class has any left. So the memory stays full, and as
even over classes as the data allow. Every random draw comes from a generator seeded by
``(seed, "labelled-memory", session)``: the same memory on every process and on a resumed run.

Saved with the session checkpoint through :meth:`LabelledMemoryPlugin.extra_state` (safetensors tensors
``images``, ``labels``, ``classes`` (assigned class), ``sessions`` (source session), ``offered`` (sessions whose
samples were offered, so a reused session is not offered twice)); restored by ``load_extra_state``.

Other methods read samples through :meth:`LabelledMemory.sample` (uniform, without replacement, from a
generator the caller seeds).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from jascl.data.datasets import LabelledDataset
from jascl.data.sampling import derive_seed
from jascl.engine.plugin import Plugin
from jascl.errors import ConfigError
from jascl.methods.common import labelled_crops
from jascl.protocols.schema import IGNORE_INDEX

if TYPE_CHECKING:
    from jascl.engine.state import LoopState


class ImageSource(Protocol):
    """Images by sample index (a list, or images read when indexed)."""

    def __getitem__(self, index: int, /) -> torch.Tensor: ...


def foreground_classes(label: torch.Tensor) -> set[int]:
    """The foreground class ids a label shows (0 = background and 255 = ignore left out)."""
    return {int(c) for c in torch.unique(label).tolist() if c not in (0, IGNORE_INDEX)}


def balanced_selection(
    held: Sequence[int], offered: Sequence[set[int]], size: int, generator: torch.Generator
) -> tuple[list[int], list[tuple[int, int]]]:
    """The class-balanced selection rule of the module docstring.

    Args:
        held: the assigned class of every sample already stored (0 = a sample showing no foreground class).
        offered: the foreground classes every offered sample shows (empty set: background only).
        size: the most samples the memory keeps.
        generator: the CPU generator of the random choices (one permutation per class in (1), one of the held
            samples cut in (1), one of the offered samples, drawn in that order).

    Returns:
        (indices of the held samples kept, ascending; (offered index, assigned class) pairs taken, ascending
        by offered index).
    """
    classes = sorted({c for c in held if c > 0} | {c for s in offered for c in s if c > 0})
    quota = {c: size // len(classes) + int(i < size % len(classes)) for i, c in enumerate(classes)}
    count = dict.fromkeys(classes, 0)
    keep: list[int] = []
    spare: dict[int, list[int]] = {c: [] for c in [0, *classes]}  # held samples cut in (1), by class
    for c in [0, *classes]:
        members = [i for i, h in enumerate(held) if (h if h in quota else 0) == c]
        if c == 0:
            spare[0] = members  # background-only samples are kept only when nothing else is left
            continue
        order = torch.randperm(len(members), generator=generator).tolist()
        shuffled = [members[j] for j in order]
        keep += shuffled[: quota[c]]
        spare[c] = shuffled[quota[c] :]
        count[c] = min(len(members), quota[c])
    order = torch.randperm(len(offered), generator=generator).tolist()
    taken: dict[int, int] = {}

    def available(c: int) -> int | None:
        """A held sample of c cut before (negative: -1 - its index), else an unused offered one, else None."""
        if spare[c]:
            return -1 - spare[c][0]
        for i in order:
            if i not in taken and (c in offered[i] if c else not offered[i]):
                return i
        return None

    while len(keep) + len(taken) < size:
        candidates = [(count[c], c) for c in classes if available(c) is not None]
        c = min(candidates)[1] if candidates else 0
        item = available(c)
        if item is None:
            break
        if item < 0:
            keep.append(spare[c].pop(0))
        else:
            taken[item] = c
        if c:
            count[c] += 1
    return sorted(keep), sorted(taken.items())


class LabelledMemory:
    """At most ``size`` labelled samples of earlier sessions (CPU tensors), with their assigned class and session.

    Attributes:
        images: (N, C, *spatial) float32, or None while empty.
        labels: (N, *spatial) uint8 training labels in global ids (255 = ignore), or None.
        classes: (N,) int64 assigned class of each sample (0: it shows no foreground class).
        sessions: (N,) int64 session each sample comes from.
        offered: sessions whose samples were offered already.
    """

    def __init__(self, size: int) -> None:
        if size < 0:
            raise ConfigError(f"a labelled memory needs size >= 0 (got {size})")
        self.size = size
        self.images: torch.Tensor | None = None
        self.labels: torch.Tensor | None = None
        self.classes = torch.zeros(0, dtype=torch.long)
        self.sessions = torch.zeros(0, dtype=torch.long)
        self.offered: list[int] = []

    def __len__(self) -> int:
        return int(self.classes.numel())

    def class_counts(self) -> dict[int, int]:
        """Stored samples per assigned class."""
        return {int(c): int((self.classes == c).sum()) for c in torch.unique(self.classes).tolist()}

    def add_session(
        self, session: int, images: ImageSource, labels: Sequence[torch.Tensor], generator: torch.Generator
    ) -> None:
        """Offer one session's labelled samples ((C, *spatial) images, (*spatial) labels) and re-select.

        A session offered before is ignored (a reused session whose memory was restored with it).

        Raises:
            ConfigError: the samples do not all have the shape of the stored ones (set ``patch_size``).
        """
        if session in self.offered:
            return
        held = self.classes.tolist()
        keep, taken = balanced_selection(held, [foreground_classes(y) for y in labels], self.size, generator)
        new_images = [images[i].float().cpu() for i, _ in taken]
        new_labels = [labels[i].to(torch.uint8).cpu() for i, _ in taken]
        stored_x, stored_y = self.images, self.labels
        shapes = {tuple(x.shape) for x in new_images}
        if stored_x is not None:
            shapes.add(tuple(stored_x.shape[1:]))
        if len(shapes) > 1:
            raise ConfigError(
                f"labelled memory: samples of different shapes {sorted(shapes)}; set patch_size so that every "
                "stored sample is a training crop of one size"
            )
        parts_x, parts_y = [], []
        if keep and stored_x is not None and stored_y is not None:
            parts_x.append(stored_x[keep])
            parts_y.append(stored_y[keep])
        if new_images:
            parts_x.append(torch.stack(new_images))
            parts_y.append(torch.stack(new_labels))
        self.images, self.labels = (torch.cat(parts_x), torch.cat(parts_y)) if parts_x else (None, None)
        self.classes = torch.tensor([held[i] for i in keep] + [c for _, c in taken], dtype=torch.long)
        self.sessions = torch.cat([self.sessions[keep], torch.full((len(taken),), session, dtype=torch.long)])
        self.offered.append(session)

    def sample(self, n: int, generator: torch.Generator) -> dict[str, torch.Tensor] | None:
        """``min(n, len(self))`` stored samples drawn uniformly without replacement (None when empty).

        Returns:
            ``image`` (n, C, *spatial) float32, ``label`` (n, *spatial) int64 global ids (255 = ignore),
            ``class`` (n,) assigned classes, ``session`` (n,) and ``index`` (n,) positions in the memory.
        """
        if not len(self) or n <= 0 or self.images is None or self.labels is None:
            return None
        index = torch.randperm(len(self), generator=generator)[:n]
        return {
            "image": self.images[index],
            "label": self.labels[index].long(),
            "class": self.classes[index],
            "session": self.sessions[index],
            "index": index,
        }

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """The memory as named tensors (for safetensors); empty when nothing was ever offered."""
        out: dict[str, torch.Tensor] = {}
        if self.offered:
            out["offered"] = torch.tensor(self.offered, dtype=torch.long)
        if len(self) and self.images is not None and self.labels is not None:
            out.update(images=self.images, labels=self.labels, classes=self.classes, sessions=self.sessions)
        return out

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Replace the memory with what :meth:`to_tensors` returned."""
        self.offered = [int(s) for s in tensors["offered"].tolist()] if "offered" in tensors else []
        if "images" in tensors:
            self.images = tensors["images"].float()
            self.labels = tensors["labels"].to(torch.uint8)
            self.classes = tensors["classes"].long()
            self.sessions = tensors["sessions"].long()
        else:
            self.images, self.labels = None, None
            self.classes = torch.zeros(0, dtype=torch.long)
            self.sessions = torch.zeros(0, dtype=torch.long)


class _Crops:
    """The images of a :class:`LabelledDataset`, read one at a time when indexed (only the samples kept)."""

    def __init__(self, dataset: LabelledDataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.dataset[index]["image"]


def session_samples(state: LoopState) -> tuple[_Crops, list[torch.Tensor]]:
    """The session's labelled samples as the memory stores them: training crops without augmentation.

    The crop of sample i is drawn from ``(seed, "labelled-memory", session)`` and i alone, so reading a
    sample twice gives the same crop. Returns the images (read when indexed) and every label (uint8): the
    labels decide the selection, and only the images of the samples taken are kept.
    """
    dataset = labelled_crops(state, "labelled-memory")
    return _Crops(dataset), [dataset[i]["label"].to(torch.uint8) for i in range(len(dataset))]


class LabelledMemoryPlugin(Plugin):
    """Keeps a :class:`LabelledMemory` of ``size`` samples, filled at the end of every session (see the module
    docstring: it stores real images of earlier sessions, which the JASCL setting otherwise forbids).

    The memory changes only between sessions, so it is left out of in-session checkpoints (a resumed session
    rebuilds it from the earlier sessions, reused, before it starts); it is saved with each session's checkpoint.
    """

    name = "labelled-memory"
    snapshot_exclude = ("memory",)

    def __init__(self, size: int = 20) -> None:
        self.memory = LabelledMemory(size)

    def _offer(self, state: LoopState) -> None:
        t = state.session.index
        if t in self.memory.offered or self.memory.size == 0:
            self.memory.offered = sorted({*self.memory.offered, t})
            return
        images, labels = session_samples(state)
        generator = torch.Generator().manual_seed(derive_seed(state.seed, "labelled-memory", t))
        self.memory.add_session(t, images, labels, generator)
        state.report["labelled_memory"] = {
            "size": len(self.memory),
            "per_class": {str(c): n for c, n in sorted(self.memory.class_counts().items())},
        }

    def after_session(self, state: LoopState) -> None:
        self._offer(state)

    def session_restored(self, state: LoopState) -> None:
        self._offer(state)

    def extra_state(self) -> dict[str, torch.Tensor]:
        return self.memory.to_tensors()

    def load_extra_state(self, tensors: dict[str, torch.Tensor]) -> None:
        self.memory.load_tensors(tensors)
