"""Seeded, stateless sampling: every random draw of the data pipeline is a function of
(seed, pass, sample index), not of a stream consumed in order.

Why: the same batches and the same augmentations must come out whether the
loader uses worker processes or not, whether one or several ranks share a
global batch, and whether a run went through or was killed and resumed. A
sequential random stream satisfies none of these; a key per sample satisfies
all three, and resuming only needs the number of passes already made.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from jascl import distributed

#: 2**32 - 1: numpy's RandomState seeds are 32-bit
_SEED_MASK = 0xFFFFFFFF


def derive_seed(*parts: object) -> int:
    """A 32-bit seed from any number of parts (stable across processes and Python versions)."""
    return zlib.crc32("/".join(map(str, parts)).encode()) & _SEED_MASK


def split_key(key: int | tuple[int, int]) -> tuple[int, int]:
    """(pass, index) from a sampler key; a plain index (no sampler) counts as pass 0."""
    if isinstance(key, tuple):
        return int(key[0]), int(key[1])
    return 0, int(key)


class SeededBatchSampler(Sampler[list[tuple[int, int]]]):
    """Batches of ``(pass, index)`` keys over ``n`` samples.

    Each pass draws a permutation from ``(seed, pass)`` alone; global batch b is
    ``perm[b * batch_size:(b + 1) * batch_size]``. With several ranks, rank r
    takes every ``world``-th key of each global batch (a batch smaller than the
    number of ranks is shared out round-robin so that every rank steps), so the
    ranks together see exactly the single-process batches.

    Args:
        n: number of samples.
        batch_size: the *global* batch size (all ranks together).
        seed: base seed (e.g. derived from the run seed and session).
        shuffle: False = samples in order every pass.
        rank, world: this rank and the number of ranks (default: torch.distributed's).
    """

    def __init__(
        self,
        n: int,
        batch_size: int,
        seed: int,
        shuffle: bool = True,
        rank: int | None = None,
        world: int | None = None,
    ) -> None:
        if n < 1 or batch_size < 1:
            raise ValueError(f"need at least one sample and batch_size >= 1 (got n={n}, batch_size={batch_size})")
        self.n, self.batch_size, self.seed, self.shuffle = n, batch_size, seed, shuffle
        self.rank = distributed.rank() if rank is None else rank
        self.world = distributed.world_size() if world is None else world
        self.passes = 0
        #: global batches to leave out at the start of the next pass (set to resume inside a pass; then reset)
        self.skip = 0

    def __len__(self) -> int:
        return math.ceil(self.n / self.batch_size)

    def permutation(self, pass_index: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.n))
        g = torch.Generator().manual_seed(derive_seed(self.seed, pass_index))
        return torch.randperm(self.n, generator=g).tolist()

    def local(self, batch: list[int]) -> list[int]:
        """This rank's part of one global batch."""
        if self.world == 1:
            return batch
        if len(batch) >= self.world:
            return batch[self.rank :: self.world]
        return [batch[self.rank % len(batch)]]

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        pass_index = self.passes
        self.passes += 1
        first, self.skip = self.skip * self.batch_size, 0
        perm = self.permutation(pass_index)
        for start in range(first, self.n, self.batch_size):
            yield [(pass_index, i) for i in self.local(perm[start : start + self.batch_size])]

    def state_dict(self) -> dict:
        return {"passes": self.passes}

    def load_state_dict(self, state: dict) -> None:
        self.passes = int(state["passes"])


def loader_options(device: torch.device, num_workers: int, pin_memory: bool | None) -> dict:
    """DataLoader keyword arguments: workers (-1 = auto: 4 per rank on CUDA, none on CPU) and pinned memory."""
    if num_workers < 0:
        num_workers = 4 if device.type == "cuda" else 0
    pin = device.type == "cuda" if pin_memory is None else pin_memory
    opts: dict = {"num_workers": num_workers, "pin_memory": pin}
    if num_workers > 0:
        opts.update(persistent_workers=True, prefetch_factor=4)
    return opts


def seeded_loader(dataset: Dataset, batch_size: int, seed: int, shuffle: bool = True, **options) -> DataLoader:
    """A DataLoader over ``dataset`` driven by a :class:`SeededBatchSampler` (the dataset receives (pass, index) keys)."""
    size = len(dataset)  # type: ignore[arg-type]  # a map-style dataset (torch's Dataset declares no __len__)
    return DataLoader(dataset, batch_sampler=SeededBatchSampler(size, batch_size, seed, shuffle), **options)
