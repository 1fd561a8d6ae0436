"""``megatron-tp-overlap bench ag|rs M N K``: one all-gather+GEMM or GEMM+reduce-scatter, every
overlap strategy side by side, against the physical bound (Flux's shape convention: M is the full
token dimension).

- ``ag``: each rank holds A [M/tp, K] and W [N/tp, K]; out = all_gather(A) @ W^T, [M, N/tp].
- ``rs``: each rank holds A [M, K/tp] and W [N, K/tp]; out = reduce_scatter(A @ W^T), [M/tp, N].

Per backend: total, GEMM-only and communication-only time (ms; median over ``--iters`` timed
iterations with CUDA events after ``--warmup``, per rank; the slowest rank is reported, with the
spread across ranks), exposed communication = total - GEMM-only, overlap efficiency = 1 - exposed /
comm-only, TFLOP/s per GPU, the bound max(GEMM-only, comm-only), and the error against an fp32
reference (relative L2, max abs).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megatron_tp_overlap.tools.bench_report import TOLERANCE, Metrics, Row, flops_per_gpu, plot_sweep, render  # noqa: F401

BACKENDS = ("nccl", "te_ring", "te_ring_agg", "te_pipeline", "te_bulk", "asynctp", "flux")
DTYPES = ("bfloat16", "float16", "float32")
TE_DTYPES = ("bfloat16", "float16")


def _ints(s: str) -> list[int]:
    """argparse type: a comma list of integers >= 1."""
    try:
        values = [int(x) for x in s.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r}: not a comma list of integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{s!r}: each value must be >= 1")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="megatron-tp-overlap bench", description=__doc__.split("\n\n")[0])
    p.add_argument("op", choices=["ag", "rs"])
    p.add_argument("M", type=int, help="full token dimension")
    p.add_argument("N", type=int, help="output features (all ranks)")
    p.add_argument("K", type=int, help="input features (all ranks)")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--backends", default=",".join(BACKENDS), help=f"comma list of {', '.join(BACKENDS)}")
    p.add_argument("--num-sm", type=_ints, default=[16], help="TE pipeline/bulk: comma list to sweep")
    p.add_argument("--num-splits", type=_ints, default=[4], help="TE pipeline: comma list to sweep")
    p.add_argument("--cga-size", type=_ints, default=[2], help="TE pipeline/bulk: comma list to sweep")
    p.add_argument("--sweep-m", type=_ints, default=None, help="run each M of this list and plot time vs M")
    p.add_argument("--out", default="bench_out")
    a = p.parse_args(argv)
    a.backends = [b for b in a.backends.split(",") if b]
    unknown = [b for b in a.backends if b not in BACKENDS]
    if unknown:
        p.error(f"--backends: unknown {', '.join(unknown)}; valid: {', '.join(BACKENDS)}")
    if a.iters < 1 or a.warmup < 0:
        p.error("--iters must be >= 1 and --warmup >= 0")
    return a


def check_shape(op: str, M: int, N: int, K: int, tp: int) -> list[str]:
    """Problems with a shape at TP size ``tp`` (before any GPU work)."""
    p = []
    if min(M, N, K) < 1:  # before the GPU count: a bad shape is named on any machine
        p.append(f"M, N, K = {M}, {N}, {K}: must be >= 1")
    if tp < 2:
        p.append(f"needs >= 2 GPUs (found {tp}): there is no tensor-parallel communication to overlap")
        return p
    if M % tp:
        p.append(f"M = {M} must be divisible by the TP size {tp} (tokens are split across ranks)")
    split, name = (N, "N") if op == "ag" else (K, "K")
    if split % tp:
        p.append(f"{name} = {split} must be divisible by the TP size {tp} (the weight is split along {name})")
    return p


def backend_support(backend: str, dtype: str, op: str = "ag") -> str | None:
    """Why ``backend`` cannot run ``dtype`` for ``op`` (None when it can)."""
    if backend.startswith("te_") and dtype not in TE_DTYPES:
        return f"TE userbuffers GEMMs take {'/'.join(TE_DTYPES)} (or FP8), not {dtype}"
    if backend.startswith("te_") and op == "rs" and dtype == "float16":
        # userbuffers.cu: `#define half_dtype nv_bfloat16` for __CUDA_ARCH__ >= 800. Measured on H200
        # before this rule: rel. error 0.41 (TP=2) / 0.60 (TP=4) against the fp32 reference.
        return "TE userbuffers reduce-scatter adds in bf16 on sm_80+ (userbuffers.cu), so fp16 sums come out wrong"
    return None


def _time(fn: Callable[[], Any], iters: int, warmup: int) -> float:
    """This rank's median (the spread across ranks is part of the report)."""
    from megatron_tp_overlap.engine.measure import median_cuda_ms

    return median_cuda_ms(fn, iters, warmup, reduce=False)


def _across_ranks(ms: float) -> tuple[float, float]:
    """(slowest rank's median, spread = slowest - fastest)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([ms, -ms], device="cuda", dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t[0].item(), t[0].item() + t[1].item()


def run_shape(a: argparse.Namespace, M: int) -> list[Row]:
    import torch
    import torch.distributed as dist

    tp, rank = dist.get_world_size(), dist.get_rank()
    dt = getattr(torch, a.dtype)
    N, K = a.N, a.K
    g = torch.Generator(device="cuda").manual_seed(1000 + rank)
    if a.op == "ag":
        A = torch.randn(M // tp, K, device="cuda", generator=g).to(dt)
        W = (torch.randn(N // tp, K, device="cuda", generator=g) / K**0.5).to(dt)
        full = torch.empty(M, K, device="cuda", dtype=dt)
        comm = lambda: dist.all_gather_into_tensor(full, A)  # noqa: E731
        dist.all_gather_into_tensor(full, A)
        gemm = lambda: torch.matmul(full, W.t())  # noqa: E731
        A32 = torch.empty(M, K, device="cuda")
        dist.all_gather_into_tensor(A32, A.float())
        ref = A32 @ W.float().t()
    else:
        A = torch.randn(M, K // tp, device="cuda", generator=g).to(dt)
        W = (torch.randn(N, K // tp, device="cuda", generator=g) / K**0.5).to(dt)
        part = torch.matmul(A, W.t())
        out = torch.empty(M // tp, N, device="cuda", dtype=dt)
        comm = lambda: dist.reduce_scatter_tensor(out, part)  # noqa: E731
        gemm = lambda: torch.matmul(A, W.t())  # noqa: E731
        ref = torch.empty(M // tp, N, device="cuda")
        dist.reduce_scatter_tensor(ref, (A.float() @ W.float().t()).contiguous())
    gemm_ms, _ = _across_ranks(_time(gemm, a.iters, a.warmup))
    comm_ms, _ = _across_ranks(_time(comm, a.iters, a.warmup))
    flops = flops_per_gpu(M, N, K, tp)

    def check(y: Any) -> tuple[float, float]:
        y = y.float().reshape(ref.shape)
        t = torch.tensor([((y - ref).norm() / ref.norm()).item(), (y - ref).abs().max().item()], device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t[0].item(), t[1].item()

    def row(backend: str, config: str, fn: Callable[[], Any], note: str = "") -> Row:
        y = fn()
        err, mx = check(y)
        total, spread = _across_ranks(_time(fn, a.iters, a.warmup))
        return Row(backend, config, Metrics.of(total, gemm_ms, comm_ms, flops), spread, err, mx, note)

    rows: list[Row] = []
    for b in a.backends:
        why = backend_support(b, a.dtype, a.op)
        if why:
            rows.append(Row(b, "", None, None, None, None, f"skipped: {why}"))
            continue
        try:
            if b == "nccl":
                if a.op == "ag":
                    rows.append(row(b, "all_gather then matmul", lambda: (comm(), torch.matmul(full, W.t()))[1]))
                else:

                    def nccl_rs() -> Any:
                        p = torch.matmul(A, W.t())
                        dist.reduce_scatter_tensor(out, p)
                        return out

                    rows.append(row(b, "matmul then reduce_scatter", nccl_rs))
            elif b.startswith("te_"):
                rows += _te_rows(a, b, M, A, W, row)
            elif b == "asynctp":
                rows.append(_asynctp_row(a, A, W, row))
            elif b == "flux":
                try:
                    import flux  # noqa: F401 - presence check
                except ImportError as e:
                    rows.append(Row(b, "", None, None, None, None, f"unavailable: flux does not import ({e})"))
                    continue
                rows.append(
                    Row(b, "", None, None, None, None, "flux imports, but its adapter needs a build for this CUDA")
                )
        except Exception as e:  # noqa: BLE001 - one backend must not hide the others
            rows.append(Row(b, "", None, None, None, None, f"failed: {type(e).__name__}: {str(e)[:120]}"))
        torch.cuda.synchronize()
        dist.barrier()
    return rows


def _te_rows(a: argparse.Namespace, backend: str, M: int, A: Any, W: Any, row: Callable) -> list[Row]:
    """TE userbuffers through TE's own GEMM-with-overlap API (``general_gemm`` with ``ub``)."""
    import gc

    import torch
    import torch.distributed as dist
    import transformer_engine.pytorch.cpp_extensions as tex
    from transformer_engine.pytorch.cpp_extensions import general_gemm
    from transformer_engine.pytorch.module import base

    tp = dist.get_world_size()
    N, K = a.N, a.K
    if a.op == "ag":
        if backend not in ("te_ring", "te_ring_agg", "te_bulk"):
            return [Row(backend, "", None, None, None, None, "skipped: pipeline overlaps reduce-scatter only")]
        name = "qkv_dgrad" if backend == "te_bulk" else "qkv_fprop"
        shape = [M, K]
    else:
        if backend == "te_bulk":
            return [
                Row(backend, "", None, None, None, None, "skipped: bulk reduce-scatter runs beside an unrelated GEMM")
            ]
        name, shape = "proj_fprop", [M, N]
    configs: list[dict] = []
    if backend in ("te_ring", "te_ring_agg"):
        configs.append({"method": "ring_exchange", "aggregate": backend == "te_ring_agg"})
    else:
        method = "bulk" if backend == "te_bulk" else "pipeline"
        splits = [None] if method == "bulk" else a.num_splits
        configs += [
            {"method": method, "num_sm": s, "cga_size": c, **({"num_splits": k} if k else {})}
            for s in a.num_sm
            for c in a.cga_size
            for k in splits
        ]
    rows = []
    for cfg in configs:
        if base.is_ub_initialized():
            gc.collect()
            base.destroy_ub()
        base.initialize_ub(
            shape=shape,
            tp_size=tp,
            quantization_modes=[base.UserBufferQuantizationMode.NONE],
            dtype=A.dtype,
            ub_cfgs={name: cfg},
            bootstrap_backend="nccl",
        )
        ub = base.get_ub(name, False)
        label = " ".join(f"{k}={v}" for k, v in cfg.items() if k != "method")
        if a.op == "ag" and backend != "te_bulk":

            def fn() -> Any:
                ub.copy_into_buffer(A, local_chunk=True)
                total = ub.get_buffer(shape=[M, K])
                return general_gemm(W, total, out_dtype=A.dtype, ub=ub, ub_type=tex.CommOverlapType.AG)[0]
        elif a.op == "ag":  # bulk: the all-gather runs beside a GEMM that does not wait for it
            full = torch.empty(M, K, device="cuda", dtype=A.dtype)
            dist.all_gather_into_tensor(full, A)

            def fn() -> Any:
                ub.copy_into_buffer(A, local_chunk=True)
                return general_gemm(
                    W, full, out_dtype=A.dtype, ub=ub, ub_type=tex.CommOverlapType.AG, bulk_overlap=True
                )[0]
        else:
            rs_out = torch.empty(M // tp, N, device="cuda", dtype=A.dtype)

            def fn() -> Any:
                general_gemm(W, A, out_dtype=A.dtype, ub=ub, ub_type=tex.CommOverlapType.RS, extra_output=rs_out)
                return rs_out

        rows.append(row(backend, f"{cfg['method']} {label}".strip(), fn))
        fn = ub = None  # no reference to this config's communicator may survive the switch
    gc.collect()
    torch.cuda.synchronize()
    dist.barrier()
    base.destroy_ub()
    return rows


def _asynctp_row(a: argparse.Namespace, A: Any, W: Any, row: Callable) -> Row:
    import torch
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    group = dist.group.WORLD
    symm_mem.enable_symm_mem_for_group(group.group_name)
    if a.op == "ag":
        fn = lambda: torch.ops.symm_mem.fused_all_gather_matmul(A, [W.t()], gather_dim=0, group_name=group.group_name)[
            1
        ][0]  # noqa: E731
        return row("asynctp", "fused_all_gather_matmul", fn)
    fn = lambda: torch.ops.symm_mem.fused_matmul_reduce_scatter(
        A, W.t(), "sum", scatter_dim=0, group_name=group.group_name
    )  # noqa: E731
    return row("asynctp", "fused_matmul_reduce_scatter", fn)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if "LOCAL_RANK" not in os.environ:  # not under torchrun: start it on all local GPUs
        import torch

        n = torch.cuda.device_count()
        problems = check_shape(a.op, a.M, a.N, a.K, n) if not a.sweep_m else []
        problems += [p for M in (a.sweep_m or []) for p in check_shape(a.op, M, a.N, a.K, n)]
        if problems:
            print("bench: " + "; ".join(dict.fromkeys(problems)), file=sys.stderr)
            return 2
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={n}",
            "-m",
            "megatron_tp_overlap.tools.bench",
            *(argv if argv is not None else sys.argv[1:]),
        ]
        return subprocess.run(cmd).returncode
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    tp, rank = dist.get_world_size(), dist.get_rank()
    problems = [p for M in (a.sweep_m or [a.M]) for p in check_shape(a.op, M, a.N, a.K, tp)]
    if problems:
        if rank == 0:
            print("bench: " + "; ".join(problems), file=sys.stderr)
        dist.destroy_process_group()
        return 2
    results = {M: run_shape(a, M) for M in (a.sweep_m or [a.M])}
    if rank == 0:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = f"{a.op}_N{a.N}_K{a.K}_{a.dtype}_tp{tp}"
        for M, rows in results.items():
            print(
                render(
                    rows,
                    f"{a.op.upper()} M={M} N={a.N} K={a.K} {a.dtype} TP={tp} ({torch.cuda.get_device_name()})",
                    a.dtype,
                )
            )
        (out / f"{stem}.json").write_text(
            json.dumps(
                {
                    "op": a.op,
                    "N": a.N,
                    "K": a.K,
                    "dtype": a.dtype,
                    "tp": tp,
                    "gpu": torch.cuda.get_device_name(),
                    "results": {str(M): [r.to_dict() for r in rows] for M, rows in results.items()},
                },
                indent=1,
            )
        )
        if a.sweep_m:
            print(f"plot: {plot_sweep(results, out / f'{stem}_sweep.png', stem)}")
    wrong = [
        f"{r.backend} {r.config} (M={M}, rel. err {r.rel_err:.1e})"
        for M, rows in results.items()
        for r in rows
        if r.correct(a.dtype) is False
    ]
    if wrong and rank == 0:
        print(
            f"bench: results beyond the {a.dtype} tolerance {TOLERANCE[a.dtype]:g}: " + "; ".join(wrong),
            file=sys.stderr,
        )
    dist.barrier()
    dist.destroy_process_group()
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
