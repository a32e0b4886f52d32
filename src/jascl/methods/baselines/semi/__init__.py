"""Semi-supervised continual baselines on the session's unlabelled pool: UaD-CE, CSL, RETRIEVE, NNCSL and HALO.

All five use the unlabelled pool ``state.data.unlabelled`` on the same
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

* ``nncsl`` -- Kang, Fini, Nabi, Ricci and Alahari, "A Soft Nearest-Neighbor
  Framework for Continual Semi-Supervised Learning", ICCV 2023 (code:
  github.com/kangzhiq/NNCSL): a PAWS-style soft nearest-neighbour learner on
  pool pixels and nearest-neighbour distillation of the previous model, over a
  bounded labelled replay memory (:mod:`jascl.methods.labelled_memory`). It is
  the one method here that keeps real labelled images of earlier sessions,
  which the JASCL setting otherwise forbids; no other method uses the memory
  by default.
* ``halo`` -- Franco, Mandica, Kallidromitis, Guillory, Li, Darrell and
  Galasso, "Hyperbolic Active Learning for Semantic Segmentation under Domain
  Shift", ICML 2024 (arXiv 2306.11180; code github.com/paolomandica/HALO): a
  hyperbolic head (Poincare ball, hyperbolic MLR) on the decoder features;
  pool pixels acquired by hyperbolic radius x region entropy and, with no
  oracle, pseudo-labelled by the model.

Every deviation needed for dense prediction under joint nonstationarity is
listed in each plugin's docstring.
"""
