"""Continual surgical-scene segmentation baselines: CAT (Xu et al., IEEE TMI 2024: overlapping class-aware
temperature normalisation of the logit distillation, with multi-scale shifted-feature distillation).

The JASCL paper compares with CAT on its 2D robotic surgery benchmark (CholecSeg8k -> m2caiseg) as "a
specialized baseline for this task" (tables per_2d_robot and the robotic surgery ablation)."""
