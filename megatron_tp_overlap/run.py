"""Run an unmodified Megatron-LM training script with the autotune plugin installed.

    torchrun --nproc-per-node=N -m megatron_tp_overlap.run pretrain_gpt.py <Megatron args> \\
        --tp-comm-overlap --tp-comm-overlap-autotune

The script runs as ``__main__`` with its own folder first on ``sys.path`` (as ``python script.py``
would), after :func:`megatron_tp_overlap.integrations.megatron.install` patched Megatron.
"""
from __future__ import annotations

import os
import runpy
import sys


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if argv else 2)
    script = argv[0]
    if not os.path.isfile(script):
        raise SystemExit(f"megatron_tp_overlap.run: training script not found: {script}")
    from .integrations.megatron import install

    install()
    sys.argv = [script, *argv[1:]]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
