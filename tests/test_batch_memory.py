"""Batch memory a loader worker reuses (jascl.data.batch_memory): a slot is reused only once the main process holds
nothing of the batch sent from it, so batches the main process keeps never change; batches it lets go of are
reused instead of new shared memory."""

import gc
import json
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader, get_worker_info

from fixtures import medical as fxm
from jascl.data import batch_memory
from jascl.data.batch_memory import SLOTS_PER_WORKER, BatchSlots, _received
from jascl.data.datasets import LabelledDataset, collate_items
from jascl.data.real import load_real
from jascl.engine.config import resolve_config
from jascl.experiments.runner import run_benchmark
from jascl.protocols import parse_protocol
from test_real_protocols import TINY

#: the end-to-end tests' tiny 3D U-Net, with two epochs a session and flips on (the loader's draws matter)
TINY_3D = {**TINY, "epochs_base": 2, "epochs_incremental": 2, "augment": True, "patch_size": [32, 32, 32]}


@pytest.fixture
def worker(monkeypatch):
    """This process posing as loader worker 1 (its slots are 8-15)."""
    monkeypatch.setattr(batch_memory, "get_worker_info", lambda: SimpleNamespace(id=1))


def test_a_slot_is_leased_held_while_its_batch_lives_and_reused_after(worker):
    slots = BatchSlots()
    values = slots.values
    first, lease = slots.lease(100)
    key, slot, token = lease
    assert (key, slot) == (slots.key, SLOTS_PER_WORKER) and token != 0 and int(values[slot]) == token
    assert first.is_shared() and first.nbytes() == 100 and slots.allocations == 1
    second, lease2 = slots.lease(100)  # the first is in flight: the next slot
    assert lease2[1] == slot + 1 and slots.allocations == 2
    # the main process receives the first batch (its own mapping: another storage) and holds it
    held = torch.zeros(25)
    _received({"image": held}, *lease)
    _received({"image": torch.zeros(1)}, *lease2)  # the second, let go of at once
    assert int(values[slot]) == token and int(values[slot + 1]) == lease2[2]  # freed only at the next receipt
    _received({"image": torch.zeros(1)}, "another-loader", 0, 5)  # the next receipt: the second slot is free
    assert int(values[slot]) == token and int(values[slot + 1]) == 0
    again, lease3 = slots.lease(80)  # slot 8 is held: slot 9's storage again, no new memory
    assert lease3[1] == slot + 1 and again is second and slots.allocations == 2
    del held
    gc.collect()
    _received({"image": torch.zeros(1)}, "another-loader", 0, 5)
    assert int(values[slot]) == 0
    bigger, lease4 = slots.lease(400)  # a larger batch (the slot's storage is too small): new memory for it
    assert lease4[1] == slot and bigger is not first and bigger.nbytes() == 400 and slots.allocations == 3


def test_a_slot_whose_token_changed_is_not_freed_by_an_older_batch(worker):
    slots = BatchSlots()
    _, (key, slot, token) = slots.lease(8)
    _received({"image": torch.zeros(1)}, key, slot, token)
    slots.values[slot] = token + 1  # meanwhile sent again (as a new worker in the slot would)
    _received({"image": torch.zeros(1)}, "another-loader", 0, 5)
    assert int(slots.values[slot]) == token + 1


def test_no_free_slot_or_another_sharing_strategy_gets_new_memory_without_a_lease(worker, monkeypatch):
    slots = BatchSlots()
    leases = [slots.lease(8)[1] for _ in range(SLOTS_PER_WORKER)]
    assert sorted(lease[1] for lease in leases) == list(range(SLOTS_PER_WORKER, 2 * SLOTS_PER_WORKER))
    storage, lease = slots.lease(8)
    assert lease is None and storage.is_shared() and slots.allocations == SLOTS_PER_WORKER + 1
    monkeypatch.setattr(batch_memory.torch.multiprocessing, "get_sharing_strategy", lambda: "file_system")
    slots.values.zero_()
    assert slots.lease(8)[1] is None


def _dataset(tmp_path):
    root = fxm.write_msd(tmp_path / "ct", cases=4, shape=(20, 18, 16), labels=(1, 2), test_cases=1)
    protocol = parse_protocol(fxm.store_protocol_dict(), "store-proto.yaml")
    data, _ = load_real(protocol, {"ct": root}, tmp_path / "cache", echo=lambda *a: None)
    split = data[0].train
    return lambda: LabelledDataset(split, [1], augment=True, patch_size=(8, 8, 8), seed=2, label_dtype=torch.uint8)


def _with_allocations(items):
    batch = collate_items(items)
    batch["allocations"] = torch.tensor(get_worker_info().dataset.slots.allocations)
    return batch


def test_a_worker_reuses_batches_let_go_of_and_never_one_still_held(tmp_path):
    make = _dataset(tmp_path)
    keys = [[(p, i), (p, (i + 1) % 3)] for p in range(8) for i in range(2)]  # 16 batches of 2
    expected = [{k: v.clone() for k, v in collate_items(make().__getitems__(b)).items() if k != "id"} for b in keys]

    def loader():
        return DataLoader(make(), batch_sampler=keys, num_workers=1, collate_fn=_with_allocations)

    allocations = 0
    for batch, want in zip(loader(), expected):  # each batch let go of before the next
        assert torch.equal(batch["image"], want["image"]) and torch.equal(batch["label"], want["label"])
        allocations = int(batch["allocations"])
    assert allocations <= 4  # a few slots for 16 batches (prefetch 2, the batch in hand and the one before)
    held = list(loader())  # every batch kept: none is written over, each had new memory
    for batch, want in zip(held, expected, strict=True):
        assert torch.equal(batch["image"], want["image"]) and torch.equal(batch["label"], want["label"])
        assert type(batch) is dict and batch["label"].dtype == torch.uint8
    assert [int(b["allocations"]) for b in held] == list(range(1, len(keys) + 1))


@pytest.mark.slow
def test_a_run_on_the_store_gives_the_same_scores_with_loader_workers(tmp_path):
    """The training loop's loader on the store (crops read into reused batch memory in two persistent workers, with
    prefetch) gives the scores of the loader without workers, to the last digit. This checks the loop's path through
    the batch memory (worker-side reads, the leased batch, the uint8 labels widened by the task); that a batch in use
    is never written over is the test above, which fails without the check of the main process's references (this
    run's loop lets go of each batch before a worker could reuse it)."""
    root = fxm.write_msd(tmp_path / "ct", cases=8, shape=(24, 24, 20), labels=(1, 2), test_cases=1)
    protocol = parse_protocol(fxm.store_protocol_dict(), "store-proto.yaml")
    scores = {}
    for workers in (0, 2):
        settings = {**TINY_3D, "num_workers": workers}
        config = resolve_config(
            protocol.training, protocol.path, None, [f"{k}={json.dumps(v)}" for k, v in settings.items()]
        )
        results = run_benchmark(
            protocol,
            config,
            ["vanilla"],
            tmp_path / f"run-{workers}",
            cache_dir=tmp_path / "cache",
            progress=False,
            echo=lambda *a: None,
            roots={"ct": root},
        )
        scores[workers] = [session["per_class"] for session in results["methods"]["vanilla"]["sessions"]]
    assert scores[2] == scores[0]
    assert len(scores[0]) == 2 and set(scores[0][1]) == {"0", "1", "2"}
