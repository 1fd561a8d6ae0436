"""``torchrun ... -m megatron_tp_overlap.train [overrides]``: the main job (see :mod:`app.train`)."""

from megatron_tp_overlap.app.train import main

if __name__ == "__main__":
    main()
