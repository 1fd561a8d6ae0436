"""``python -m megatron_tp_overlap.run --dry-run [--world-size N] script.py <Megatron args>``: a Megatron-LM launch
checked without GPUs, where megatron-core is installed. Megatron's own parser takes the arguments (with the plugin's
flags and checks, as in a launch), Megatron's ``validate_args`` checks them at the given world size, and the lines
say what tuning would do: the layout, the userbuffers shape, the starting config, the budget and every file it
writes. Exit 0 only when the launch would pass both; 2 with one line per problem otherwise (as a launch refuses)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Optional

from megatron_tp_overlap.errors import refuse

TAG = "[tp-overlap-autotune] dry run"


def split_world_size(argv: list[str]) -> tuple[Optional[int], list[str]]:
    """``--world-size N`` (ours: the processes torchrun would start) out of ``argv``, before the script."""
    if argv[:1] == ["--world-size"] or (argv and argv[0].startswith("--world-size=")):
        value = argv[0].partition("=")[2] or (argv[1] if len(argv) > 1 else "")
        rest = argv[1:] if "=" in argv[0] else argv[2:]
        if not (value.isdigit() and int(value) >= 1):
            refuse(f"megatron_tp_overlap.run --dry-run: --world-size = {value!r}: must be an integer >= 1")
        return int(value), rest
    return None, argv


def describe(args: Any) -> list[str]:
    """What the launch would do, from Megatron's validated arguments."""
    from megatron_tp_overlap.engine.cache import default_cache_dir
    from megatron_tp_overlap.integrations.megatron.flags import options_from_args, output_path
    from megatron_tp_overlap.integrations.megatron.run_shape import RunShape

    run, o = RunShape.from_args(args), options_from_args(args)
    dp = args.world_size // (run.tp * args.pipeline_model_parallel_size * run.cp)
    lines = [
        f"processes: {args.world_size}; TP {run.tp}, PP {args.pipeline_model_parallel_size}, CP {run.cp}, DP {dp}",
        f"model: hidden {run.hidden}, FFN {run.ffn}, {run.heads} heads"
        + (f" / {run.kv_groups} KV groups" if run.kv_groups else "")
        + f", head {run.kv_channels}, {'SwiGLU' if run.gated_mlp else 'MLP'}, {args.num_layers} layers"
        + (f"; MoE {run.moe}" if run.moe else ""),
        f"userbuffers: [{run.init_tokens}, {run.hidden}] (sequence x micro-batch / CP, hidden), {run.dtype}",
        f"starting config: {getattr(args, 'tp_comm_overlap_cfg', None) or 'TE default ub_cfgs'}",
    ]
    if run.recompute or run.cuda_graphs:
        lines.append(f"tuned as configured: {', '.join(x for x in (run.recompute, run.cuda_graphs) if x)}")
    if getattr(args, "tp_comm_overlap_autotune", False):
        out = output_path(args)
        lines += [
            f"budget: {o.seconds:g} s of trial steps, then up to {o.verify_iters} iterations of in-run verification"
            + ("" if o.verify_iters else " (off)"),
            f"tuned YAML: {out} (beside it {out.with_suffix('.report.json').name}, "
            f"{out.with_suffix('.recipe.txt').name})",
            f"cache: {Path(o.cache_dir).expanduser() if o.cache_dir else default_cache_dir()}"
            + (" (reuse on)" if o.reuse else ""),
        ]
    else:
        lines.append("--tp-comm-overlap-autotune not given: the plugin only installs Megatron's dataset-helper fix")
    return lines


def dry_run(argv: list[str]) -> int:
    """Parse and validate ``[--world-size N] script.py <args>`` as a launch would; print the lines; the exit code."""
    world, argv = split_world_size(argv)
    if not argv or not os.path.isfile(argv[0]):
        refuse(f"megatron_tp_overlap.run --dry-run: training script not found: {argv[0] if argv else '(none)'}")
    try:
        import megatron.training.arguments as margs
    except ImportError as e:
        refuse(f"megatron_tp_overlap.run --dry-run needs megatron-core (pip install -e '.[te]'): {e}")
    from megatron_tp_overlap.integrations.megatron.launcher import install

    install()
    if world is not None:
        os.environ["WORLD_SIZE"] = str(world)
    sys.argv = list(argv)
    # the script's own extra arguments are unknown here: tolerated, as its parser would take them
    args = margs.parse_args(None, ignore_unknown_args=True)  # the plugin's flags and checks (refuses: exit 2)
    try:
        margs.validate_args(args, {"tokenizer_type": getattr(args, "tokenizer_type", None) or "NullTokenizer"})
    except (AssertionError, ValueError) as e:
        refuse(f"megatron_tp_overlap.run --dry-run: Megatron's validate_args refused these arguments: {e}")
    for line in describe(args):
        print(f"{TAG}: {line}")
    print(f"{TAG}: the launch would pass Megatron's and the plugin's checks (nothing was written)")
    return 0
