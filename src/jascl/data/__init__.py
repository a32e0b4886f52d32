"""Data: the embedded synthetic benchmark, session splits and datasets."""

from jascl.data.datasets import IGNORE_INDEX, LabelledDataset, training_labels
from jascl.data.synthetic import SessionData, Split, load_or_generate

__all__ = ["IGNORE_INDEX", "LabelledDataset", "SessionData", "Split", "load_or_generate", "training_labels"]
