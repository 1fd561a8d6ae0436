"""``python -m megatron_tp_overlap.run [--iteration-log PATH] pretrain_gpt.py <Megatron args>``: an unmodified
Megatron-LM training script with the autotune plugin installed (see :mod:`integrations.megatron.launcher`)."""

import sys

from megatron_tp_overlap.integrations.megatron.launcher import run_script

if __name__ == "__main__":
    run_script(sys.argv[1:])
