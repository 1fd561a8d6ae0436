"""Framework integrations. Each module imports its framework lazily, so the package imports without it."""
