"""Few-shot class-incremental baselines.

The methods live in one module each (all registered on import):

* ``pifs``     -- :mod:`.pifs`     (Cermelli et al., BMVC 2021)
* ``gaps``     -- :mod:`.gaps`     (Qiu et al., CVPR Workshops 2023)
* ``nc-fscil`` -- :mod:`.ncfscil`  (Yang et al., ICLR 2023; trains its own base)
* ``fecam``    -- :mod:`.fecam`    (Goswami et al., NeurIPS 2023)
* ``subspace`` -- :mod:`.subspace` (Akyurek et al., ICLR 2022)
* ``c-fscil``  -- :mod:`.cfscil`   (Hersche et al., CVPR 2022; trains its own base)
* ``softnet``  -- :mod:`.softnet`  (Kang et al., ICLR 2023; trains its own base)
* ``fact``     -- :mod:`.fact`     (Zhou et al., CVPR 2022; trains its own base)
* ``fscil-ss`` -- :mod:`.fscil_ss` (Cui et al., IEEE TMM 2023; identification of the cited
  IEEE document unconfirmed, see its docstring)
* ``bcm``      -- :mod:`.bcm`      (Sakai et al. 2024; paper not found, reconstructed from the
  JASCL paper's description, see its docstring)

``_shared`` holds what several of them share (features in eval mode);
``_hyperdimensional`` and ``_soft_subnetwork`` hold the pure functions of C-FSCIL
and SoftNet.
"""
