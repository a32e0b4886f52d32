"""Domain-incremental and foundation-model baselines: MDIL (per-domain decoders and adapters on a shared encoder)
and the CLIP-driven universal model (text-conditioned per-class heads, partial-label loss, fine-tuned over sessions;
also the ``clip-driven`` backbone)."""
