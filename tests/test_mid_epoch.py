"""Resuming inside an epoch: the labelled loader and the plugins' batch streams continue with exactly the
batches (and the global random stream) of an uninterrupted epoch."""

import json

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from jascl.data.datasets import BatchStream, iterate_steps, loader_position, set_loader_position
from jascl.data.sampling import SeededBatchSampler, seeded_loader, split_key
from jascl.engine.plugin import Method, Plugin
from jascl.engine.snapshot import capture_object, pack, restore_object, unpack


class Keys(Dataset):
    """Item = (pass, index) as a tensor, so a batch shows which keys it came from."""

    def __len__(self):
        return 7

    def __getitem__(self, key):
        return torch.tensor(split_key(key))


def test_sampler_skip_leaves_out_the_first_global_batches_of_one_pass_only():
    sampler = SeededBatchSampler(7, 3, seed=4)
    whole = list(sampler)
    sampler.passes, sampler.skip = 0, 2
    assert list(sampler) == whole[2:] and len(whole) == 3
    assert sampler.skip == 0 and sampler.passes == 1
    assert len(list(sampler)) == 3  # the next pass is whole again


@pytest.mark.parametrize("n_steps", [2, 3, 8])  # less than a pass, one pass, 2 passes + 2 steps (3 batches a pass)
def test_iterate_steps_from_any_start_continues_the_uninterrupted_epoch(n_steps):
    loader = seeded_loader(Keys(), 3, seed=11)
    loader.batch_sampler.passes = 5  # earlier epochs
    start_position = loader_position(loader)
    torch.manual_seed(0)
    expected = []
    rng_after = []
    for batch in iterate_steps(loader, n_steps):
        expected.append(batch.tolist())
        rng_after.append(torch.get_rng_state())  # the global stream after each step (DataLoader draws from it)
    end_passes = loader.batch_sampler.passes
    assert [b[0][0] for b in expected] == [5, 5, 5, 6, 6, 6, 7, 7][:n_steps]  # pass index of each batch
    for start in range(1, n_steps):
        resumed = seeded_loader(Keys(), 3, seed=11)
        set_loader_position(resumed, start_position)
        torch.set_rng_state(rng_after[start - 1])  # the state a checkpoint after step `start` holds
        got = []
        for batch in iterate_steps(resumed, n_steps, start=start):
            got.append(batch.tolist())
            assert torch.equal(torch.get_rng_state(), rng_after[start - 1 + len(got)]), (start, len(got))
        assert got == expected[start:], start
        assert resumed.batch_sampler.passes == end_passes


def test_iterate_steps_refuses_to_resume_a_loader_without_seeded_sampler():
    with pytest.raises(ValueError, match="SeededBatchSampler"):
        list(iterate_steps(DataLoader(Keys(), batch_size=3), 3, start=1))


def _roundtrip(obj: Plugin) -> dict:
    tensors = {}
    skeleton = json.loads(json.dumps(pack(capture_object(obj), "p", tensors)))
    return unpack(skeleton, tensors)


class Holder(Plugin):
    def __init__(self, loader):
        self.loader = loader
        self.stream = BatchStream(loader)


@pytest.mark.parametrize("kind", ["seeded", "shuffled"])
@pytest.mark.parametrize("taken", [0, 1, 2, 3, 4, 6])  # 3 batches a pass: inside, at the end, across passes
def test_batch_stream_snapshot_continues_with_the_same_batches(kind, taken):
    def make():
        if kind == "seeded":
            return seeded_loader(Keys(), 3, seed=2)
        return DataLoader(Keys(), batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(9))

    torch.manual_seed(1)
    a = Holder(make())
    for _ in range(taken):
        next(a.stream)
    snap = _roundtrip(a)
    rng = torch.get_rng_state()
    expected = [next(a.stream).tolist() for _ in range(5)]
    rng_expected = torch.get_rng_state()

    b = Holder(make())
    restore_object(b, snap)
    torch.set_rng_state(rng)
    assert [next(b.stream).tolist() for _ in range(5)] == expected
    assert torch.equal(torch.get_rng_state(), rng_expected)


def test_methods_say_which_plugins_cannot_resume_inside_an_epoch():
    class Plain(Plugin):
        name = "plain"

    class EpochSetup(Plugin):
        name = "setup"

        def before_epoch(self, state):
            self.cache = object()

    class Declared(EpochSetup):
        name = "declared"
        mid_epoch_resume = True

    assert Method("m", [Plain(), EpochSetup(), Declared()]).mid_epoch_blockers() == ["setup"]
    assert Method("m", [Plain()]).mid_epoch_blockers() == []


def test_each_pass_draws_once_from_the_global_generator_whatever_the_workers():
    """Persistent workers reuse their iterator (no base-seed draw after the first pass): without the explicit draw,
    every later random number of a run (GAS noise) would depend on num_workers."""
    states = []
    for options in ({}, {"num_workers": 2, "persistent_workers": True}):
        loader = seeded_loader(Keys(), 3, seed=11, **options)
        torch.manual_seed(5)
        batches = [[b.tolist() for b in iterate_steps(loader, 4)] for _ in range(3)]
        states.append((batches, torch.get_rng_state()))
    assert states[0][0] == states[1][0]
    assert torch.equal(states[0][1], states[1][1])
    torch.manual_seed(5)
    for _ in range(3 * 2):  # 3 epochs of 4 steps = 2 passes each
        torch.empty((), dtype=torch.int64).random_()
    assert torch.equal(torch.get_rng_state(), states[0][1])  # exactly one draw per pass
