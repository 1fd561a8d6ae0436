#!/usr/bin/env python3
"""A tensor-parallel ``te.LayerNormMLP`` with userbuffers comm/GEMM overlap, and the smallest demo of
the megatron-tp-overlap tuner. Weights are split over the GPUs of each TP group; ``--num-replicas``
data-parallel replicas (DDP) of the TP group fill the node.

    torchrun --nnodes=1 --nproc-per-node=$(nvidia-smi -L | wc -l) examples/ln_mlp_with_overlap.py \\
        [--autotune] [--benchmark] [--check-numerics] [--fp8] [--num-replicas 2] [--ub-cfg cfg.yaml]

``--check-numerics`` compares output, input gradient and weight gradients with a no-overlap copy of
the layer (same weights, same inputs): relative L2 error <= 2e-2 in bf16, <= 1e-1 with ``--fp8``
(FP8 scaling is computed per module, and overlap changes reduction order).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from typing import Any

from megatron_tp_overlap.engine.options import TuneOptions

RTOL = {"bf16": 2e-2, "fp8": 1e-1}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-iters", type=int, default=5, help="training iterations")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--num-heads", type=int, default=32, help="hidden size = num-heads x head-dim")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--mlp-expansion-factor", type=int, default=4, help="ffn size = factor x hidden size")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--fp8", action="store_true", help="FP8 (delayed scaling, hybrid format) GEMMs and buffers")
    p.add_argument("--no-comm-overlap", action="store_true", help="sequence parallelism over NCCL, no userbuffers")
    p.add_argument("--num-replicas", type=int, default=1, help="data-parallel replicas (DDP) of the TP group")
    p.add_argument(
        "--bootstrap-backend",
        choices=["nccl", "gloo", "mpi"],
        default="nccl",
        help="torch.distributed backend for userbuffers bootstrapping",
    )
    p.add_argument("--ub-cfg", type=str, default=None, help="a ub_cfgs YAML (Megatron --tp-comm-overlap-cfg format)")
    p.add_argument(
        "--autotune", action="store_true", help="tune the ub_cfgs with megatron-tp-overlap before the iterations"
    )
    p.add_argument("--autotune-seconds", type=float, default=TuneOptions.seconds)
    p.add_argument("--check-numerics", action="store_true", help="compare against a no-overlap reference")
    p.add_argument("--benchmark", action="store_true", help="time iterations: no overlap, given/TE default, autotuned")
    p.add_argument("--benchmark-iters", type=int, default=20, help="timed iterations per round")
    p.add_argument("--benchmark-rounds", type=int, default=5, help="interleaved rounds per config")
    p.add_argument("--verbose", action="store_true", help="print from every rank")
    args = p.parse_args(argv)
    for k in ("num_iters", "batch_size", "seq_length", "num_heads", "head_dim", "mlp_expansion_factor", "num_replicas"):
        if getattr(args, k) < 1:
            p.error(f"--{k.replace('_', '-')} = {getattr(args, k)}: must be >= 1")
    if args.no_comm_overlap and (args.autotune or args.ub_cfg):
        p.error("--no-comm-overlap cannot be combined with --autotune or --ub-cfg")
    return args


def check_launch(args: argparse.Namespace, world_size: int, multicast: bool, env: dict[str, str]) -> list[str]:
    """Problems with the launch (before any GPU work): each says what to change."""
    p = []
    if world_size % args.num_replicas:
        p.append(f"world size {world_size} is not divisible by --num-replicas {args.num_replicas}")
    else:
        tp = world_size // args.num_replicas
        if tp < 2:
            p.append(
                f"each TP group has {tp} GPU (world size {world_size} / --num-replicas {args.num_replicas}): "
                "tensor parallelism needs >= 2 GPUs per group"
            )
        elif args.seq_length % tp:
            p.append(f"--seq-length {args.seq_length} must be divisible by the TP size {tp} (sequence parallel)")
        elif (args.mlp_expansion_factor * args.num_heads * args.head_dim) % tp:
            p.append(f"ffn size must be divisible by the TP size {tp}")
    if not args.no_comm_overlap and multicast is False and env.get("UB_SKIPMC", "0") != "1":
        p.append("this GPU/driver has no CUDA multicast: set UB_SKIPMC=1 (userbuffers over CUDA IPC)")
    if not args.no_comm_overlap and env.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1":
        p.append("set CUDA_DEVICE_MAX_CONNECTIONS=1 (comm/GEMM overlap needs in-order kernel launch)")
    if args.ub_cfg:
        from megatron_tp_overlap.errors import ConfigError
        from megatron_tp_overlap.ub.rules import ValidationContext, load_and_validate

        try:
            load_and_validate(
                args.ub_cfg, ValidationContext(fp8=args.fp8, tp_size=max(world_size // args.num_replicas, 2))
            )
        except ConfigError as e:
            p.append(f"--ub-cfg: {e}")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    problems = check_launch(args, world, None, dict(os.environ))  # everything but the GPU's own facts, before TE
    if not problems:
        import transformer_engine.pytorch.cpp_extensions as tex

        problems = check_launch(args, world, bool(tex.device_supports_multicast()), dict(os.environ))
    if problems:
        if rank == 0:
            print("ln_mlp_with_overlap.py: cannot run:\n" + "\n".join(f"  - {x}" for x in problems), file=sys.stderr)
        return 2
    import torch
    import torch.distributed as dist
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import DelayedScaling, Format
    from transformer_engine.pytorch.module import base as te_base

    from megatron_tp_overlap.engine.numerics import Fingerprint
    from megatron_tp_overlap.engine.search import SearchOptions
    from megatron_tp_overlap.engine.space import TuningConfig, all_off
    from megatron_tp_overlap.engine.switcher import capture_initialize_ub
    from megatron_tp_overlap.engine.topology import build_topology, find_overlap_modules
    from megatron_tp_overlap.engine.tuner import Autotuner
    from megatron_tp_overlap.ub.config import UbConfig, load_yaml

    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device(f"cuda:{local_rank}"))
    node = socket.gethostname()
    tp = world // args.num_replicas
    groups = [list(range(r * tp, (r + 1) * tp)) for r in range(args.num_replicas)]
    tp_group, _ = dist.new_subgroups_by_enumeration(groups, backend="nccl")
    dp_group = None
    if args.num_replicas > 1:
        dp_group, _ = dist.new_subgroups_by_enumeration([list(c) for c in zip(*groups)], backend="nccl")

    def log(msg: str, group: Any = tp_group) -> None:
        if args.verbose or dist.get_rank(group) == 0:
            print(f"[rank{rank}:{node}] {msg}", flush=True)

    log(f"|-- Created tensor-parallel group: {dist.get_process_group_ranks(tp_group)}")
    if dp_group is not None:
        log(f"|-- Created data-parallel group: {dist.get_process_group_ranks(dp_group)}", dp_group)

    hidden = args.num_heads * args.head_dim
    ffn = args.mlp_expansion_factor * hidden
    tokens = args.seq_length * args.batch_size
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=32, amax_compute_algo="max")
    init = None
    if not args.no_comm_overlap:
        mode = te_base.UserBufferQuantizationMode.FP8 if args.fp8 else te_base.UserBufferQuantizationMode.NONE
        user_cfg = load_yaml(args.ub_cfg) if args.ub_cfg else UbConfig()
        with capture_initialize_ub() as calls:
            te_base.initialize_ub(
                shape=[tokens, hidden],
                tp_size=tp,
                quantization_modes=[mode],
                dtype=torch.bfloat16,
                ub_cfgs=user_cfg.to_dict(),
                bootstrap_backend=args.bootstrap_backend,
            )
        init = calls[0]

    kw = dict(
        tp_group=tp_group,
        tp_size=tp,
        sequence_parallel=True,
        set_parallel_mode=True,
        params_dtype=torch.bfloat16,
        seq_length=args.seq_length,
        micro_batch_size=args.batch_size,
        device="cuda",
    )
    torch.manual_seed(args.seed)
    torch.cuda.manual_seed(args.seed + dist.get_rank(tp_group))  # weight shards differ across TP ranks
    overlap = not args.no_comm_overlap
    layer = te.LayerNormMLP(
        hidden, ffn, ub_overlap_ag=overlap, ub_overlap_rs=overlap, ub_bulk_dgrad=overlap, ub_bulk_wgrad=overlap, **kw
    )
    model = torch.nn.parallel.DistributedDataParallel(layer, process_group=dp_group) if dp_group is not None else layer
    # Found now, while every overlap flag is on: a tuned config may switch them all off ("no overlap" won).
    mods = find_overlap_modules(layer) if overlap else []
    optim = torch.optim.Adam(model.parameters(), lr=1e-4)
    shape = (args.seq_length // tp, args.batch_size, hidden)
    g = torch.Generator(device="cuda").manual_seed(args.seed + rank)
    x_fixed = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
    dy_fixed = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)

    def fp8_region() -> Any:  # TE >= 2.x: te.autocast; older: te.fp8_autocast (deprecated since)
        if hasattr(te, "autocast"):
            return te.autocast(enabled=args.fp8, recipe=recipe, amax_reduction_group=tp_group)
        return te.fp8_autocast(enabled=args.fp8, fp8_recipe=recipe, fp8_group=tp_group)

    def fwd_bwd(module: Any, x: Any, dy: Any) -> Any:
        with fp8_region():
            y = module(x)
        y.backward(dy)
        return y.detach()

    tuned = None
    if args.autotune:
        fp = Fingerprint()

        def fingerprint() -> Any:
            layer.zero_grad(set_to_none=True)
            x_fixed.grad = None
            y = fwd_bwd(model, x_fixed, dy_fixed)
            out = fp([y, x_fixed.grad, *(p.grad for p in layer.parameters())])
            layer.zero_grad(set_to_none=True)
            return out

        def step() -> None:
            fwd_bwd(model, x_fixed, dy_fixed)

        tuner = Autotuner(
            model,
            step,
            init,
            reference=load_yaml(args.ub_cfg) if args.ub_cfg else None,
            options=SearchOptions(max_seconds=args.autotune_seconds),
            verify_fn=fingerprint,
            verify_rtol=RTOL["fp8" if args.fp8 else "bf16"],
            log=lambda *a: log(" ".join(map(str, a))),
        )
        res = tuner.tune()
        tuned = res.best
        log(res.summary)
        layer.zero_grad(set_to_none=True)

    for i in range(args.num_iters):
        log(f"Iter {i + 1}")
        log("|-- Generate random input batch")
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        log("|-- Forward pass")
        with fp8_region():
            y = model(x)
        log("|-- Compute loss")
        loss = y.float().pow(2).mean()
        log("|-- Backward pass")
        loss.backward()
        log("|-- Optimizer step")
        optim.step()
        optim.zero_grad(set_to_none=True)
        del y, loss

    status = 0
    if args.check_numerics and overlap:
        ref = te.LayerNormMLP(hidden, ffn, **kw)  # no userbuffers flags: NCCL all-gather / reduce-scatter
        with torch.no_grad():  # weights only: TE refuses to unpickle FP8 extra state, and ref starts its own
            for (name, p), (ref_name, q) in zip(layer.named_parameters(), ref.named_parameters()):
                assert name == ref_name, (name, ref_name)
                q.copy_(p)
        if args.fp8:  # same FP8 scaling state in both (made by a first step of ref, then copied over)
            fwd_bwd(ref, x_fixed.detach().clone().requires_grad_(True), dy_fixed)
            ref.zero_grad(set_to_none=True)
            for k in ("scaling_fwd", "scaling_bwd"):
                for a in ("amax_history", "scale"):
                    getattr(ref.fp8_meta[k], a).copy_(getattr(layer.fp8_meta[k], a))
        layer.zero_grad(set_to_none=True)
        xs = [x_fixed.detach().clone().requires_grad_(True) for _ in range(2)]
        y_ub, y_ref = fwd_bwd(layer, xs[0], dy_fixed), fwd_bwd(ref, xs[1], dy_fixed)
        pairs = {
            "output": (y_ub, y_ref),
            "input grad": (xs[0].grad, xs[1].grad),
            **{f"{n} grad": (p.grad, dict(ref.named_parameters())[n].grad) for n, p in layer.named_parameters()},
        }
        tol = RTOL["fp8" if args.fp8 else "bf16"]
        for name, (a, b) in pairs.items():
            err = torch.tensor(
                [((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()], device="cuda"
            )
            dist.all_reduce(err, op=dist.ReduceOp.MAX)
            ok = err.item() <= tol
            status |= 0 if ok else 1
            log(f"numerics {name:<22} rel. error {err.item():.2e} (tol {tol:g}): {'PASSED' if ok else 'FAILED'}")

    if args.benchmark and overlap:
        from megatron_tp_overlap.engine.measure import compare_configs
        from megatron_tp_overlap.engine.switcher import UbSwitcher

        given = TuningConfig(
            load_yaml(args.ub_cfg) if args.ub_cfg else UbConfig(),
            frozenset(),
            "given --ub-cfg" if args.ub_cfg else "TE default",
        )
        sw = UbSwitcher(init, mods, barrier=dist.barrier, current=tuned or given)  # what is live now
        cases = {"no overlap": all_off(build_topology(mods), given), given.label: given}
        if tuned:
            cases["autotuned"] = TuningConfig(tuned.ub, tuned.disabled, "autotuned")
        for c in cases.values():  # warm each config up once
            sw.apply(c)
            fwd_bwd(model, x_fixed, dy_fixed)
        stats = compare_configs(
            cases,
            sw.apply,
            lambda: fwd_bwd(model, x_fixed, dy_fixed),
            args.benchmark_iters,
            args.benchmark_rounds,
            group=tp_group,
        )
        rows = [(name, st["median"], st["spread"]) for name, st in stats.items()]
        if rank == 0:
            base = rows[0][1]
            print(
                f"\n| config | fwd+bwd ms (median of {args.benchmark_rounds} interleaved rounds x {args.benchmark_iters}) "
                "| spread ms | vs no overlap |\n|---|---|---|---|"
            )
            for name, t, spread in rows:
                print(f"| {name} | {t:.3f} | {spread:.3f} | {base / t:.3f}x |")

    dist.barrier()
    if overlap:
        te_base.destroy_ub()
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
