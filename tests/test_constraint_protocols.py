"""The constraint study's protocols (paper, Figure 1): synthetic-2d's base, then one constrained session each."""

from __future__ import annotations

import numpy as np

from jascl.data.synthetic import SyntheticRenderer
from jascl.protocols import get_protocol


def test_one_constraint_each_on_the_common_base():
    base = get_protocol("synthetic-2d").sessions[0]
    sessions = {k: get_protocol(f"constraint-{k}").sessions for k in ("none", "ci", "fs", "di")}
    for k, (s0, _) in sessions.items():
        assert s0 == base, k  # the common base model's session
    # (domains, new classes, recurring classes, shots = None for fully labelled) of the constrained session
    assert {k: (s[1].domains, s[1].new_classes, s[1].recurring_classes, s[1].shots) for k, s in sessions.items()} == {
        "none": (("ct",), (), (1, 2, 3, 4), None),
        "ci": (("ct",), (5, 6), (), None),
        "fs": (("ct",), (), (1, 2, 3, 4), 5),
        "di": (("mri",), (), (1, 2, 3, 4), None),
    }


def test_the_base_data_is_synthetic_2ds():
    ours, theirs = get_protocol("constraint-fs"), get_protocol("synthetic-2d")
    a = SyntheticRenderer(ours).session(ours.sessions[0])
    b = SyntheticRenderer(theirs).session(theirs.sessions[0])
    assert np.array_equal(a.train.images, b.train.images) and np.array_equal(a.test.labels, b.test.labels)
