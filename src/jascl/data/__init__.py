"""Data: the embedded synthetic benchmark, session splits and datasets."""

from jascl.data.datasets import IGNORE_INDEX, LabelledDataset, training_labels
from jascl.data.synthetic import load_or_generate
from jascl.data.types import SessionData, Split

__all__ = ["IGNORE_INDEX", "LabelledDataset", "SessionData", "Split", "load_or_generate", "training_labels"]
