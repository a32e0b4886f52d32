"""A protocol variant that keeps session 0 (K shots, fewer sessions, borrowed unlabelled data) accepts the base model
of the protocols it was made from, and no later session of theirs (jascl.protocols.variants.renamed_variant,
jascl.engine.checkpoint.session_aliases)."""

import dataclasses

import pytest

from jascl.engine.checkpoint import check_meta, session_aliases
from jascl.errors import CheckpointError
from jascl.experiments.sweep import with_shots
from jascl.protocols import get_protocol, with_unlabelled_extra
from jascl.protocols.variants import renamed_variant


def test_a_variant_records_the_protocols_whose_session_0_it_keeps_through_a_chain():
    source = get_protocol("synthetic-2d-ss")
    first = renamed_variant(source, "synthetic-2d-ss-first3", sessions=source.sessions[:3])
    both = with_unlabelled_extra(first, 2, 6)
    assert source.session0_of == () and first.session0_of == ("synthetic-2d-ss",)
    assert both.name == "synthetic-2d-ss-first3-s2extra6"
    assert both.session0_of == ("synthetic-2d-ss-first3", "synthetic-2d-ss")
    assert with_shots(source, 3).session0_of == ("synthetic-2d-ss",)
    # a variant whose session 0 differs keeps no such claim, nor its source's
    fewer = dataclasses.replace(source.sessions[0], train=source.sessions[0].train - 1)
    changed = renamed_variant(first, "other", sessions=(fewer, *first.sessions[1:]))
    assert changed.session0_of == ()
    assert renamed_variant(source, "seeded", seed=source.seed + 1).session0_of == ()


def test_only_a_session_0_checkpoint_of_a_source_protocol_fits_the_variant():
    variant = with_shots(get_protocol("synthetic-2d"), 3)
    made_for_source = {"protocol": "synthetic-2d", "backbone": "unet"}
    expect = {"protocol": "synthetic-2d-k3", "backbone": "unet"}
    check_meta("base/model.safetensors", made_for_source, expect, session_aliases(variant, 0))
    assert session_aliases(variant, 1) == {} and session_aliases(get_protocol("synthetic-2d"), 0) == {}
    with pytest.raises(CheckpointError, match="made for protocol 'synthetic-2d', but this run has protocol"):
        check_meta("s1/model.safetensors", made_for_source, expect, session_aliases(variant, 1))
    with pytest.raises(CheckpointError, match="made for backbone 'unet'"):  # the aliases name the protocol only
        check_meta("base/model.safetensors", made_for_source, {**expect, "backbone": "swinunetr"},
                   session_aliases(variant, 0))  # fmt: skip
    with pytest.raises(CheckpointError, match="made for protocol 'synthetic-3d'"):
        check_meta("base/model.safetensors", {"protocol": "synthetic-3d"}, expect, session_aliases(variant, 0))
