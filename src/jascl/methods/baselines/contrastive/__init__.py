"""Contrastive representation-learning baselines, adapted to pixel embeddings.

The methods live in one module each (all registered on import):

* ``supcl``       -- :mod:`.supcl`   (Khosla et al., NeurIPS 2020: supervised contrastive loss)
* ``unsupcl``     -- :mod:`.unsupcl` (Chen et al., ICML 2020: SimCLR's NT-Xent between two views)
* ``unsupcl-hnm`` -- :mod:`.unsupcl` (Robinson et al., ICLR 2021: hard negatives, debiased)

Each adds its contrastive term, on pixels sampled every step and passed through a projection head the
plugin owns, to the loop's segmentation loss in incremental sessions; ``_shared`` holds the head, the
pixel sampling and the plugin skeleton.
"""
