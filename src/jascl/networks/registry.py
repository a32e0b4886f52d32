"""The backbone registry, :data:`BACKBONES`, in a module free of torch: ``jascl backbones`` lists it from the
registry index (:mod:`jascl.registry`) and a backbone's module (MONAI, segmentation-models-pytorch, ...) is
imported the first time that backbone is built."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jascl.registry import Registry

if TYPE_CHECKING:
    from jascl.networks.base import Backbone

#: every registered backbone: name -> ``factory(spatial_dims=, in_channels=, **backbone_args) -> Backbone``
BACKBONES: Registry[Backbone] = Registry("backbone", "backbones", packages=("jascl.networks",))
