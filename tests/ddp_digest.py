"""A user module for the DDP-safety test (``--import tests/ddp_digest.py``): the method ``digest``, composed after the
method under test (``nncsl+digest``), writes a digest of the model's parameters on every rank at the end of each
session's training, so the test can check that the processes of a DistributedDataParallel run stayed identical."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from jascl import distributed
from jascl.methods import METHODS, Method, Plugin


class ParameterDigest(Plugin):
    name = "digest"

    def after_training(self, state) -> None:
        digest = hashlib.sha256()
        for name, p in sorted(state.model.named_parameters()):
            digest.update(name.encode())
            digest.update(p.detach().cpu().float().contiguous().numpy().tobytes())
        method = state.method_name.removesuffix("+digest")
        out = Path(os.environ["JASCL_DIGEST_DIR"]) / f"{method}.s{state.session.index}.rank{distributed.rank()}"
        out.write_text(digest.hexdigest())


if "digest" not in METHODS:
    METHODS.register("digest", doc="test probe: a digest of the model's parameters per rank")(
        lambda config: Method("digest", [ParameterDigest()])
    )
