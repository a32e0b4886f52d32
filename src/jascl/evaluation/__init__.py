"""Evaluation utilities: segmentation metrics and continual-learning summaries."""
