"""What a protocol's sessions learn: a *task* supplies the model, the batches, the supervised loss, the
prototypes and the evaluation the one training loop (:mod:`jascl.engine.loop`) uses.

=================  ============================================  =========================================
task               model                                         metric
=================  ============================================  =========================================
``segmentation``   a segmenter (:mod:`jascl.networks`)            Dice / IoU per class
``detection``      a Faster R-CNN (:mod:`jascl.networks.detector`)  COCO mAP per class
=================  ============================================  =========================================

A protocol names its task (``task:`` in its YAML; segmentation by default). Methods are plugins on the loop
whatever the task; a method that needs the task's model or outputs in a task-specific way registers an
implementation for that task (:meth:`jascl.methods.registry.MethodRegistry.register`, ``task=``).
"""

from __future__ import annotations

from jascl.engine.tasks.base import Task, TaskContext

__all__ = ["Task", "TaskContext", "create_task"]


def create_task(name: str, context: TaskContext) -> Task:
    """The task ``name`` ("segmentation" or "detection") serving the run ``context``."""
    if name == "segmentation":
        from jascl.engine.tasks.segmentation import SegmentationTask

        return SegmentationTask(context)
    if name == "detection":
        from jascl.engine.tasks.detection import DetectionTask

        return DetectionTask(context)
    raise ValueError(f"unknown task {name!r}: segmentation or detection")
