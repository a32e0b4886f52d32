"""Meta-learning and multi-task baselines.

The methods live in one module each (all registered on import); all of them
reuse vanilla's base model and act in incremental sessions only:

* ``maml``     -- :mod:`.maml` (first-order MAML episodes; Bouniot et al., ECCV 2022)
* ``maml-reg`` -- :mod:`.maml` (the same plus the condition-number regulariser of
  the classifier; Bouniot et al., ECCV 2022)
* ``mtl``      -- :mod:`.mtl`  (multi-task objective over the sessions seen so far,
  earlier sessions represented by their stored prototypes; Wang et al., ICML 2021)
"""
