"""Regularisation baselines: EWC, online EWC, UCL, dropout + weight decay, variational dropout, Adagrad.

The JASCL paper compares GAS with these in its appendix "GAS vs. existing
regularization-based continual learning methods" (memory-based penalties: EWC,
UCL; static regularisers: dropout, variational dropout, weight decay; adaptive optimisers: Adagrad).
Each method is one module of this package: a pure function tested on bare tensors, a plugin on the
training loop, and a registered factory with typed options (``--set method_args.<method>.<option>=value``).

Conventions shared by every method in this package:

* Session 0 is the shared base model unless a method says otherwise (``in_base``
  options, UCL): the paper's appendix table starts every regularisation baseline
  from the same session-0 score. End-of-session statistics (Fisher information,
  uncertainties) of a reused session are computed on ``session_restored``.
* ``freeze`` ("config" | "none" | "all_but_classifier"): the incremental-session
  freezing policy. Default "config" = the protocol's policy (``all_but_classifier``
  in the paper's medical setting, so only the classifier -- its old rows included
  -- is regularised); "none" lets the method act on the backbone as in the
  original papers.
* Classifier rows grow with new classes; a penalty anchored at an earlier
  session applies to that session's rows (the first rows) only.
"""
