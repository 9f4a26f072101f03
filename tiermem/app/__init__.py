"""The jobs of the ``tiermem`` command, built on the core: the training loop behind
``tiermem train`` and its checkpoints and summary, the I/O benchmark of ``tiermem bench io``,
the ROK curve, what a configuration means on this machine, and reading a timeline trace.

Nothing in the core imports this package; it imports the core as any user's code does."""
