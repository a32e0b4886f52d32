"""GAPS's passes over the model's features (:mod:`jascl.methods.baselines.fewshot.gaps`): the scores that choose
its memory of base images, and the scene embeddings that pair support images with memory images. Both are per
image and add up over an image's pixels, so a volume too large to hold whole comes in blocks
(:func:`jascl.methods.baselines.fewshot._shared.sample_pieces`) with the whole volume's results."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from jascl.methods.baselines.fewshot._shared import per_sample, sample_pieces
from jascl.methods.common import labelled_loader
from jascl.networks.base import resize

if TYPE_CHECKING:
    from jascl.engine.state import LoopState


def scene_embeddings(state: LoopState, model, images: Sequence[torch.Tensor]) -> torch.Tensor:
    """(C, *spatial) images -> (N, D) normalised global averages of the features; batched ``batch_size`` at a
    time when the images share one shape, else one at a time (real datasets vary in size); a volume too large
    to hold whole in blocks (:func:`sample_pieces`), whose feature sums add up to the whole volume's."""
    size = state.config.batch_size if len({tuple(i.shape) for i in images}) == 1 else 1
    loader = []
    for i in range(0, len(images), size):
        chunk = torch.stack(list(images[i : i + size]))  # no labels: a zero label map, without its memory
        loader.append(
            {"image": chunk, "label": torch.zeros((), dtype=torch.uint8).expand(len(chunk), *chunk.shape[2:])}
        )
    pieces = sample_pieces(state, model, loader)
    out = [F.normalize(t["sum"], dim=0) for _, t in per_sample(pieces, lambda f, _: {"sum": f.flatten(2).sum(-1)[0]})]
    return torch.stack(out).cpu() if out else torch.zeros(0, 0)


def _class_sums(features: torch.Tensor, labels: torch.Tensor, classes: Sequence[int]) -> dict:
    """One sample's piece -> its voxel count, and each present class's sum of n(f_p) and voxel count."""
    features, labels = F.normalize(resize(features, labels.shape[1:]), dim=1)[0], labels[0]
    out: dict = {"voxels": torch.tensor(labels.numel())}
    for c in classes:
        mask = labels == c
        if mask.any():
            out["sum", c], out["count", c] = features[:, mask].sum(dim=1), mask.sum()
    return out


def memory_scores(state: LoopState, classes: Sequence[int]) -> dict[int, list[tuple[float, int]]]:
    """Class -> (score, index) of every labelled image of the session that holds the class: the cosine between
    the class's classifier row and the normalised mean of its pixels' normalised features, over the share of the
    image's pixels that are the class (the official memory's ``baseset_type: uniform_interval`` ranking)."""
    weight = F.normalize(state.model.classifier.weight.detach().float(), dim=1)
    row_of = {c: r for r, c in enumerate(state.seen)}
    scores: dict[int, list[tuple[float, int]]] = {c: [] for c in classes}
    pieces = sample_pieces(state, state.model, labelled_loader(state))
    for index, totals in per_sample(pieces, lambda f, lab: _class_sums(f, lab, classes)):
        for c in classes:
            if ("sum", c) in totals:
                pooled = F.normalize(totals["sum", c], dim=0)
                cos = float(pooled @ weight[row_of[c]].to(pooled))
                scores[c].append((cos * float(totals["voxels"]) / float(totals["count", c]), index))
    return scores
