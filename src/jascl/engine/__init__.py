"""The engine: one training loop, its named events, plugins and methods, the state plugins see,
the loop's default plugins, and checkpoints, resume and stop. It imports nothing from
``jascl.methods``, ``jascl.experiments`` or ``jascl.results``."""
