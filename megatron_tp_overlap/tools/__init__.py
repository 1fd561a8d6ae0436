"""Offline tools: the CLI, the kernel bench, the layer bench and TP sweep, trace analysis, plots."""
