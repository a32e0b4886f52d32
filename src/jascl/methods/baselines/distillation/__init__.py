"""Distillation baselines for class-incremental segmentation: LwF, ILT, MiB, PLOP, UCB and CLIP-CT.

Each method is three layers, as everywhere in jascl: pure losses on bare
tensors (tested on hand-computed values), a plugin wiring them into the loop,
and a registered factory, one module per method. ``_shared`` holds the pieces
every old-model-based baseline shares (the frozen teacher, forward-hook feature
taps, MiB's classifier initialisation, the background-merged loss); PLOP and the
replay family import them.

Conventions (see ``jascl.methods.baselines``): classifier rows follow
``state.seen`` (row 0 = background); the teacher is the model at the end of the
previous session and only its first ``len(state.previous_seen)`` rows are used
("old rows": background + old classes). Labels are classifier rows, 255 = ignore.
In incremental sessions, pixels of old classes not taught again appear as
background (the *background shift*); classes taught again in a new domain
("recurring") keep their own labels, so only *untaught* old classes are
treated as hidden in the background ("absorbed" rows below).

Sources:
    LwF: Z. Li, D. Hoiem, "Learning without Forgetting", TPAMI 2017.
    ILT: U. Michieli, P. Zanuttigh, "Incremental Learning Techniques for Semantic
        Segmentation", ICCV Workshops 2019.
    MiB: F. Cermelli, M. Mancini, S. Rota Bulo, E. Ricci, B. Caputo, "Modeling the
        Background for Incremental Learning in Semantic Segmentation", CVPR 2020
        (official code: github.com/fcdl94/MiB).
    UCB: Z. Liang, Y. Hu, F. Yang, X. Liu, "Enhancing Continual Semantic Segmentation via Uncertainty and
        Class Balance Re-weighting", IEEE TIP 2025 (IEEE document 11030217; official code
        github.com/JACK-Chen-2019/UCB), applied on PLOP as the authors' UCB_PLOP.
    CLIP-CT: see :mod:`jascl.methods.baselines.distillation.clip_ct` (CLIP-embedding-generated class heads
        and the previous model's pseudo-labels of old classes).
"""
