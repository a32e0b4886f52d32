"""SAM's image encoder: trained in the base session, frozen after it (the paper's configuration table)."""

import pytest
import torch

from conftest import toy_protocol_dict
from jascl.data.synthetic import load_or_generate
from jascl.engine.config import resolve_config
from jascl.engine.loop import ContinualTrainer
from jascl.engine.prototypes import PrototypeStore
from jascl.errors import ConfigError
from jascl.methods import Method, Plugin
from jascl.protocols.parse import parse_protocol

TINY_SAM = {
    "img_size": 32,
    "embed_dim": 16,
    "depth": 1,
    "num_heads": 2,
    "window_size": 2,
    "global_attn_indexes": (0,),
    "proj_channels": 8,
}


class EncoderState(Plugin):
    name = "encoder-state"

    def __init__(self):
        self.seen = []

    def before_session(self, state):
        self.first = True

    def after_forward(self, state):  # at the first training step of each session
        if self.first:
            encoder = state.model.backbone.encoder
            self.seen.append((any(p.requires_grad for p in encoder.parameters()), encoder.training))
            self.first = False


@pytest.mark.parametrize(
    "train_encoder,changes", [("base", [True, False]), ("never", [False, False]), ("always", [True, True])]
)
def test_encoder_trains_when_told(tmp_path, train_encoder, changes):
    spec = toy_protocol_dict(2)
    spec["training"].update(
        backbone="sam-vitb",
        backbone_args={**TINY_SAM, "train_encoder": train_encoder},
        freeze_incremental="none",  # what freezes the encoder here is the backbone, not the policy
        lr_base=0.05,
        lr_incremental=0.05,
    )
    protocol = parse_protocol(spec, source="toy-sam.yaml")
    config = resolve_config(protocol.training, "toy-sam.yaml")
    data = load_or_generate(protocol, tmp_path / "cache")
    probe = EncoderState()
    trainer = ContinualTrainer(protocol, config, Method("t", [probe]), data, progress=False)
    model, store = trainer.new_model(3), PrototypeStore()
    changed = []
    for t in (0, 1):
        before = [p.detach().clone() for p in model.backbone.encoder.parameters()]
        trainer.run_session(t, model, store, tmp_path / f"s{t}")
        after = list(model.backbone.encoder.parameters())
        changed.append(any(not torch.equal(a, b) for a, b in zip(after, before, strict=True)))
    assert changed == changes
    # trainable and in training mode exactly in the sessions it trains
    assert probe.seen == [(c, c) for c in changes]


def test_unknown_train_encoder_is_refused():
    from jascl.networks.sam import SAMBackbone

    with pytest.raises(ConfigError, match="train_encoder='sometimes'"):
        SAMBackbone(train_encoder="sometimes", **TINY_SAM)
