"""Few-shot class-incremental baselines.

The methods live in one module each (all registered on import):

* ``pifs``     -- :mod:`.pifs`     (Cermelli et al., BMVC 2021)
* ``gaps``     -- :mod:`.gaps`     (Qiu et al., CVPR Workshops 2023)
* ``nc-fscil`` -- :mod:`.ncfscil`  (Yang et al., ICLR 2023)
* ``fecam``    -- :mod:`.fecam`    (Goswami et al., NeurIPS 2023)
* ``subspace`` -- :mod:`.subspace` (Akyurek et al., ICLR 2022)

Left out, because a faithful segmentation version needs machinery the paper
gives no segmentation recipe for and a loose one would not be worth comparing:
C-FSCIL (Hersche et al., CVPR 2022: a meta-learned backbone and a
hyperdimensional fully-connected reduction trained episodically), FACT
(Zhou et al., CVPR 2022: virtual-class base training with manifold mixup of
instances), SoftNet (Kang et al., ICLR 2023: learned soft/binary masks over
every backbone weight) and FSCIL-SS (cited by an IEEE document number only;
probably Cui et al., "Uncertainty-Guided Semi-Supervised Few-Shot
Class-Incremental Learning With Knowledge Distillation", IEEE TMM, but this
could not be confirmed, and no official code was found).

``_shared`` holds what several of them share: the frozen copy of the model at
the start of a session, a loader over the session's labelled data with its
training labels, and features in eval mode.
"""
