"""kvd: the daemon. Kept import-free so `daemon.protocol` stays light for kvchat."""

__version__ = "0.1.0"
