"""jascl: continual semantic segmentation under joint nonstationarity.

Implements JASCL (gradient-adaptive stabilization, prototype replay and
prototype anchored supervision) and its benchmarks as a library and CLI.
"""

__version__ = "0.1.0"
