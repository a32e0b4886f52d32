"""Semi-supervised continual baselines on the session's unlabelled pool: UaD-CE, CSL and RETRIEVE.

All three use the unlabelled pool ``state.data.unlabelled`` on the same
schedule as the mean teacher (``method_args.jascl.pas.start_epoch`` / ``every``:
an *unlabelled phase* is an epoch that makes one pass over the pool, each step
pairing a labelled batch with an unlabelled one). The pool's labels are hidden
ground truth: they ride along for measuring pseudo-label quality
(``state.report["pseudo_labels"]``) and never enter a loss.

* ``uad-ce``  -- Cui, Deng, Chen and Liu, "Uncertainty-Aware Distillation for
  Semi-Supervised Few-Shot Class-Incremental Learning", IEEE TNNLS 2023
  (arXiv 2301.09964; code github.com/yawencui/UaD-ClE): class-balanced
  self-training (ClE) + uncertainty-aware, adaptively weighted distillation (UaD).
* ``csl``     -- Liu and Liu, "When Confidence Fails: Revisiting Pseudo-Label
  Selection in Semi-supervised Semantic Segmentation" (Confidence Separable
  Learning), arXiv 2509.16704, 2025 (authors' code: github.com/ljs11528,
  ``pseudo-label-selection/CSL``): per-image spectral separation of pixels in
  (max confidence, residual-class variance) space, Gaussian weights, on a
  UniMatch-style weak/strong/feature-perturbed student, plus random masking
  of reliable pixels.
* ``retrieve`` -- Killamsetty, Zhao, Chen and Iyer, "RETRIEVE: Coreset
  Selection for Efficient and Robust Semi-Supervised Learning", NeurIPS 2021
  (code: CORDS, ``cords/selectionstrategies/SSL/retrievestrategy.py``):
  greedy bilevel coreset selection of the unlabelled pool on last-layer
  gradients, here under the repository's confidence-filtered mean teacher.

Left out: NNCSL (Kang, Fini, Nabi, Ricci and Alahari, "A Soft Nearest-Neighbor
Framework for Continual Semi-Supervised Learning", ICCV 2023 -- the brief's
title "Soft neighbors are positive supporters ..." is a different paper). Its
learner is a PAWS-style soft nearest-neighbour classifier over a support set
of labelled samples drawn from a replay buffer of every earlier task, plus
nearest-neighbour distillation through a projector. The JASCL setting keeps
no labelled samples of earlier sessions, so the support set and the
distillation targets of earlier classes do not exist; and a pixel-level
support set replacing the segmentation head has no published recipe. A
version without them would not be NNCSL, so it is not offered.

Every deviation needed for dense prediction under joint nonstationarity is
listed in each plugin's docstring.
"""
