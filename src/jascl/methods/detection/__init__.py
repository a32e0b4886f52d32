"""Methods on the detection task (:mod:`jascl.engine.tasks.detection`): the same names and options blocks as their
segmentation implementations, registered with ``task="detection"``.

================  ============================================================================================
``vanilla``       fine-tuning with the task's defaults (Faster R-CNN losses, imprinted new rows)
``jascl``         GAS on the box classifier + prototype replay of RoI-feature prototypes + PAS on boxes
``jascl-no-gas``  prototype replay + PAS (the paper's "JASCL w/o GAS" row)
``jascl-no-pas``  GAS + prototype replay (the paper's "JASCL w/o PAS" row)
``jascl-conf``    JASCL with a confidence-only teacher filter (no prototype check)
``ewc``           elastic weight consolidation with the detector's loss
``lwf``           distillation of the old model's RoI class scores on the same RoIs
``mib``           MiB's unbiased distillation and cross-entropy on RoI class scores
================  ============================================================================================

Which baselines carry over without redesign: those whose loss only needs a classifier over a set of
"positions" and an old model, which RoIs provide (LwF, MiB, EWC). Methods built on dense structure (PLOP's
pooled feature maps, pixel pseudo-labels, copy-paste of masks, SAM prompts) do not, and are refused on a
detection protocol with the list of methods that are implemented.

The modules register their methods when imported; :meth:`jascl.methods.registry.MethodRegistry.for_task` lists
them from the registry index and imports a module on first use.
"""
