"""Batch memory that a DataLoader worker reuses once the main process has let go of it (issue 33).

A loader worker hands each batch to the main process in shared memory. torch's DataLoader allocates that memory
anew for every batch, and on a 2-core KVM machine a new shared page costs about 3.8 us (the kernel allocates,
zeroes and maps it, then frees it when the batch dies): 8.6 ms of a 128 x 120 x 120 training patch's 15.6 ms,
where the same patch read into reused memory took 7.0 ms (``docs/performance.md``). This module lets the
training loader's worker write each batch into memory it wrote before, without ever writing into a batch the
main process still holds:

* :class:`BatchSlots`, made in the main process with the dataset (before the workers start), holds one shared
  int64 per slot (:data:`SLOTS_PER_WORKER` per worker): 0 when the main process holds nothing of that slot,
  else the token of the batch last sent from it. Only a worker writes a slot's token (from 0), and only the main
  process clears it (from the token it saw), so the two never write the same slot at the same time.
* In the worker, :meth:`BatchSlots.lease` picks a slot whose value is 0, writes a new token, and returns that
  slot's memory (made the first time, kept by the worker); with no free slot it returns new memory, as torch
  would. :func:`leased_batch` marks the collated batch with its slot.
* In the main process, unpickling the batch calls :func:`_received`, which keeps a weak reference to the
  batch's storage and clears the slot of every earlier batch whose storage is gone: no tensor, view or NumPy
  array of it is left. A batch the main process keeps (a list of batches, a plugin's reference) keeps its slot.

Only torch's default ``file_descriptor`` sharing strategy is supported; under ``file_system`` every batch gets
new memory, as before. A batch that reaches the main process through anything but :func:`_received` (another
collate function) keeps its slot busy, and the worker falls back to new memory.
"""

from __future__ import annotations

import os
import secrets
import threading
import weakref
from typing import Any

import numpy as np
import torch
import torch.multiprocessing
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.data import get_worker_info

#: slots per loader worker: what a worker can have in flight (torch's prefetch factor, 2 by default, 4 in runs on
#: CUDA) plus the batch the loop is on and the one before it; made only when needed
SLOTS_PER_WORKER = 8

#: workers per loader with slots (further workers allocate every batch anew)
MAX_WORKERS = 64

#: worker: storage address -> lease of the batch being collated (set by remember_lease, taken by take_lease)
_PENDING: dict[int, tuple[str, int, int]] = {}
#: main process: key -> slot values of each live BatchSlots made here
_SLOTS: weakref.WeakValueDictionary[str, torch.Tensor] = weakref.WeakValueDictionary()
#: main process: (weak reference to a received batch's storage, key, slot, token) of batches not yet let go of
_HELD: list[tuple[StorageWeakRef, str, int, int]] = []
_LOCK = threading.Lock()  # _received runs in the pin-memory thread when the loader pins memory


class BatchSlots:
    """Reusable shared batch memory of one dataset's loader workers (see the module docstring).

    Attributes (worker side, per process): ``allocations``: storages made (slots, plus batches that found no
    free slot); ``storages``: slot -> its storage.
    """

    def __init__(self) -> None:
        self.key = secrets.token_hex(8)
        self.values = torch.zeros(MAX_WORKERS * SLOTS_PER_WORKER, dtype=torch.int64).share_memory_()
        _SLOTS[self.key] = self.values
        self.storages: dict[int, torch.UntypedStorage] = {}
        self.allocations = 0
        self._sent = 0

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["storages"], state["allocations"], state["_sent"] = {}, 0, 0  # a new worker starts with none
        return state

    def lease(self, nbytes: int) -> tuple[torch.UntypedStorage, tuple[str, int, int] | None]:
        """Shared memory of at least ``nbytes`` for a worker's next batch, and its lease (key, slot, token) to
        pass to :func:`leased_batch`; the lease is None where the memory is new and belongs to no slot."""
        info = get_worker_info()
        shared = torch.multiprocessing.get_sharing_strategy() == "file_descriptor"
        if info is not None and info.id < MAX_WORKERS and shared:
            values = self.values.numpy()
            for slot in range(info.id * SLOTS_PER_WORKER, (info.id + 1) * SLOTS_PER_WORKER):
                if values[slot] != 0:
                    continue
                storage = self.storages.get(slot)
                if storage is None or storage.nbytes() < nbytes:
                    storage = self.storages[slot] = self._new(nbytes)
                self._sent += 1
                token = (os.getpid() << 24) | (self._sent & 0xFFFFFF)  # never 0: a pid is positive
                values[slot] = token
                return storage, (self.key, slot, token)
        return self._new(nbytes), None

    def _new(self, nbytes: int) -> torch.UntypedStorage:
        self.allocations += 1
        return torch.UntypedStorage._new_shared(nbytes)


def batch_views(
    storage: torch.UntypedStorage, image_shape: tuple[int, ...], label_shape: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """A float32 image batch and, after it, a uint8 label batch in ``storage`` (one storage: one lease)."""
    image = torch.empty(0, dtype=torch.float32).set_(storage, 0, image_shape, _strides(image_shape))
    offset = int(np.prod(image_shape)) * 4
    label = torch.empty(0, dtype=torch.uint8).set_(storage, offset, label_shape, _strides(label_shape))
    return image, label


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """C-contiguous strides (in elements) of ``shape``."""
    return tuple(int(np.prod(shape[i + 1 :])) for i in range(len(shape)))


def batch_bytes(image_shape: tuple[int, ...], label_shape: tuple[int, ...]) -> int:
    """Bytes :func:`batch_views` needs."""
    return int(np.prod(image_shape)) * 4 + int(np.prod(label_shape))


def remember_lease(storage: torch.UntypedStorage, lease: tuple[str, int, int] | None) -> None:
    """Worker: ``storage`` holds the batch of ``lease``, for :func:`take_lease` at collation."""
    if lease is not None:
        _PENDING[storage.data_ptr()] = lease


def take_lease(batch: torch.Tensor) -> tuple[str, int, int] | None:
    """Worker: the lease of the storage that ``batch`` lies in, if it has one (once)."""
    return _PENDING.pop(batch.untyped_storage().data_ptr(), None)


class _LeasedBatch(dict):
    """A collated batch (a plain dict in every respect) that tells the main process its slot when unpickled."""

    lease: tuple[str, int, int]

    def __reduce__(self) -> tuple[Any, ...]:
        return _received, (dict(self), *self.lease)


def leased_batch(batch: dict, lease: tuple[str, int, int] | None) -> dict:
    """``batch`` (whose "image" lies in the leased storage), marked so that the main process registers it."""
    if lease is None:
        return batch
    marked = _LeasedBatch(batch)
    marked.lease = lease
    return marked


def _received(batch: dict, key: str, slot: int, token: int) -> dict:
    """Main process, as a batch is unpickled: hold its slot while its storage lives; free the slots of earlier
    batches whose storage is gone (only where the slot still holds the token they were sent with)."""
    with _LOCK:
        values = _SLOTS.get(key)
        if values is not None:
            _HELD.append((StorageWeakRef(batch["image"].untyped_storage()), key, slot, token))
        kept = []
        for ref, k, s, t in _HELD:
            if not ref.expired():
                kept.append((ref, k, s, t))
                continue
            owner = _SLOTS.get(k)
            if owner is not None and int(owner[s]) == t:
                owner[s] = 0
        _HELD[:] = kept
    return batch
