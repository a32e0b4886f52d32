"""Sharpness / perturbation baselines: SAM, C-Flat and STAR.

The JASCL appendix ("GAS vs. sharpness-based methods", "GAS vs. perturbation-based
stability methods") contrasts GAS's parameter-wise, gradient-adaptive noise with
these methods' worst-case perturbations of the whole parameter vector (SAM,
C-Flat) or of each layer (STAR).

SAM and C-Flat change the *update* (the gradient the optimiser sees), not the
loss: they re-evaluate the loss of the current batch at perturbed weights with
``state.closure()`` in ``before_update`` and so declare no loss term. STAR adds a
loss term (the KL divergence at the perturbed weights). By default all three act
in incremental sessions only, on the parameters the freezing policy leaves
trainable (``freeze`` option, see :mod:`jascl.methods.baselines.regularization`).
"""
