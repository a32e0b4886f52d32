"""Replay baselines: prototype replay (Saving100x (STAR), Adapt_replay (Adapter), YoooP / YoooP+) and
generative replay (Gen-Replay), one module each.

Sources (as cited by the JASCL paper, keys ``chen2023saving`` and ``zhu2025adaptive``;
the seed file carries no bibliography, the keys were matched to the titles and to
the links in the authors' ``baselines.md``):

* Saving100x: J. Chen, R. Cong, Y. Luo, H. H. S. Ip, S. Kwong, "Saving 100x Storage:
  Prototype Replay for Reconstructing Training Sample Distribution in
  Class-Incremental Semantic Segmentation", NeurIPS 2023 (method "STAR"; official
  code github.com/jinpeng0528/STAR). Not to be confused with the ``star`` method
  (Eskandar et al., ICLR 2025, weight perturbation).
* Adapt_replay: G. Zhu, D. Wu, C. Gao, R. Wang, W. Yang, N. Sang, "Adaptive Prototype
  Replay for Class Incremental Semantic Segmentation", AAAI 2025 (method "Adapter";
  official code github.com/zhu-gl-ux/Adapter, built on STAR's).
* Gen-Replay (key ``10.1007/978-3-031-20053-3_9``): H. Liu, L. Gu, Z. Chi, Y. Wang, Y. Yu,
  J. Chen, J. Tang, "Few-Shot Class-Incremental Learning via Entropy-Regularized Data-Free
  Replay", ECCV 2022 -- a generator fitted to the model after every session, whose images
  are replayed with one-hot-like labels from the old model (:mod:`.gen_replay`; generator
  and losses in ``_generator``).

STAR stores, per learned class, a compact prototype plus statistics instead of
images: the pixel count, the per-channel spread of the L2-normalised features
around the prototype, and the mean / std of the feature norms; and the number of
"true background" pixels. In later sessions it replays synthetic features drawn
from these statistics through the classifier, in the numbers that make the
session's training distribution match the complete dataset's, repeats true
background pixels for the same purpose, keeps the features of pixels the old
model sees as old classes (OCFM) and pushes new-class feature centres away from
the nearest old prototype (SAD). Adapter adds adaptive deviation compensation of
the stored prototypes (ADC), an uncertainty-aware constraint (UAC) and uses the
compensated prototypes in the SAD term (CPD).

YoooP (``yooop``, ``yooop-plus``; key ``kong2025yooop``): Kong et al., "YoooP: You Only Optimize One
Prototype per Class for Non-Exemplar Incremental Learning", arXiv 2308.13207 -- one optimised prototype
per class replayed instead of exemplars (:mod:`.yooop`; its pure functions in ``_yooop_prototypes``).

Conventions as in :mod:`jascl.methods.baselines.distillation`.
"""
