"""Launching: one process per device on this host, the way torchrun starts them, and what the
processes need around the program (the launcher, the failure summaries, the host's malloc and
core settings, the launch environment's variables). Used by ``torchspmd run`` and by the
native engine's ``use_spmd()`` relaunch; it knows nothing of sharding."""
