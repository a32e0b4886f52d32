"""Domain-incremental baselines: MDIL (per-domain decoders and adapters on a shared encoder)."""
