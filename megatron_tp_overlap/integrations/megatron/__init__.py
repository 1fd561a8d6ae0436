"""Megatron-LM / megatron-core integration (megatron-core 0.19): flags, run shape, data replay, training state,
the ``tune()`` entry point and the installation into Megatron-LM. Importing this package does not import
Megatron; each function imports what it needs."""

from megatron_tp_overlap.integrations.megatron.flags import (
    FLAG,
    add_arguments,
    check_arguments,
    flag_name,
    flags_for,
    options_from_args,
    output_path,
)
from megatron_tp_overlap.integrations.megatron.launcher import IterationLog, install
from megatron_tp_overlap.integrations.megatron.replay import ReplayIterator, attach_replay
from megatron_tp_overlap.integrations.megatron.run_shape import RunShape
from megatron_tp_overlap.integrations.megatron.state import StateCheck, StateSnapshot
from megatron_tp_overlap.integrations.megatron.tuning import Tuned, tune

__all__ = [
    "FLAG",
    "IterationLog",
    "ReplayIterator",
    "RunShape",
    "StateCheck",
    "StateSnapshot",
    "Tuned",
    "add_arguments",
    "attach_replay",
    "check_arguments",
    "flag_name",
    "flags_for",
    "install",
    "options_from_args",
    "output_path",
    "tune",
]
