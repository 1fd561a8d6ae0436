"""The tuning engine: topology, candidate space, timing, search, live switching, numerics guard, tuner, report,
cache and options. Imports neither Megatron nor Hydra."""
