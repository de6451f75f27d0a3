"""Tools for the lent GPU machine (no network, 64 MiB per call)."""
