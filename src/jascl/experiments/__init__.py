"""Experiments on top of everything: run a protocol for several methods (``runner``), compare them over
seeds (``compare``), sweep settings (``sweep``), measure speed (``bench``) and model cost (``model_info``)."""
