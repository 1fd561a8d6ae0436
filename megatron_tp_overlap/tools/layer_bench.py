"""One TP size of the offline sweep: a stack of ``te.TransformerLayer`` with a model's real dimensions,
tuned with the engine (TP >= 2) and timed; run under torchrun by ``megatron-tp-overlap sweep``.

    torchrun --nproc-per-node=N -m megatron_tp_overlap.layer_bench --model Qwen/Qwen3-8B --layers 2 \\
        --tokens 8192 --operators qkv proj fc1 fc2 --out DIR [--profile]

Writes ``DIR/tp{N}.json`` (step times of no overlap / TE default / tuned, per-slot times, chosen
config), ``DIR/tp{N}_tuning_report.json`` and, with ``--profile``, ``DIR/tp{N}_trace.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from megatron_tp_overlap.engine.options import TuneOptions
from megatron_tp_overlap.engine.space import DGRAD_MODES
from megatron_tp_overlap.ub.config import MODULES as OPERATORS


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="shipped model name, HF cache name, or a local config directory")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tokens", type=int, default=8192, help="sequence length x micro-batch")
    p.add_argument("--operators", nargs="+", default=list(OPERATORS), choices=OPERATORS)
    p.add_argument("--budget-s", type=float, default=TuneOptions.seconds)
    p.add_argument("--timing-steps", type=int, default=20)
    p.add_argument("--timing-rounds", type=int, default=5, help="interleaved rounds of --timing-steps per config")
    p.add_argument(
        "--dgrad-mode",
        default="any",
        choices=list(DGRAD_MODES),
        help="qkv/fc1 dgrad overlap: bulk or reduce-scatter only (what one Megatron-LM run can use), or any",
    )
    p.add_argument("--profile", action="store_true", help="also write a torch-profiler trace of the tuned config")
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


@dataclass
class LayerStack:
    model: Any
    init: Any  # UbInitArgs, or None without overlap
    step: Callable[[], None]  # fwd+bwd on a fixed batch, keeps nothing
    fingerprint: Callable[[], Any]  # numerics.Fingerprint of outputs and all gradients of one step


def fp8_autocast(group: Any) -> Callable[[], Any]:
    """``() -> context``: TE's autocast with the FP8 recipe a Megatron-LM run gets from ``--fp8-format hybrid``
    (delayed scaling, margin 0, amax history 1, most recent; megatron-core 0.19's ``TransformerConfig`` defaults),
    amaxes reduced over ``group`` (the TP group) as Megatron does."""
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import DelayedScaling, Format

    recipe = DelayedScaling(fp8_format=Format.HYBRID, margin=0, amax_history_len=1, amax_compute_algo="most_recent")
    return lambda: te.autocast(enabled=True, recipe=recipe, amax_reduction_group=group)


def step_and_fingerprint(
    model: Any, x: Any, dy: Any, autocast: Callable[[], Any] | None = None
) -> tuple[Callable[[], None], Callable[[], Any]]:
    """The tuner's trial step (fwd+bwd of ``x`` with output grad ``dy``, keeping nothing: the graph and its
    communicators die with it) and its numerics fingerprint (output, input grad and every weight grad of one step).

    ``autocast``: ``() -> context`` around the forward (FP8: :func:`fp8_autocast`). With it, every fingerprint starts
    from the FP8 metadata (and RNG states) the first one found: delayed scaling takes a step's scales from the steps
    before it, so two configs would otherwise be compared at different scales."""
    from megatron_tp_overlap.engine.numerics import Fingerprint
    from megatron_tp_overlap.integrations.megatron.state import StateSnapshot

    fp = Fingerprint()
    context = autocast or contextlib.nullcontext
    start: list[Any] = []  # StateSnapshot at the first fingerprint (with autocast)

    def step() -> None:
        with context():
            y = model(x)
        y.backward(dy)

    def fingerprint() -> Any:
        if autocast is not None:
            if not start:
                start.append(StateSnapshot.take([model]))
            start[0].restore()
        model.zero_grad(set_to_none=True)
        x.grad = None
        with context():
            y = model(x)
        y.backward(dy)
        f = fp([y, x.grad, *(p.grad for p in model.parameters())])
        del y
        x.grad = None
        model.zero_grad(set_to_none=True)
        return f

    return step, fingerprint


def build_stack(
    d: Any, layers: int, seq: int, mbs: int, overlap: bool, seed: int = 1234, fp8: bool = False
) -> LayerStack:
    """``layers`` x ``te.TransformerLayer`` with the dims of ``d`` (models.ModelDims), sequence
    parallel over the world group, userbuffers initialized (TE defaults) when ``overlap``; with ``fp8``, FP8
    userbuffers and GEMMs as in a Megatron-LM run with ``--fp8-format hybrid`` (:func:`fp8_autocast`)."""
    import torch
    import torch.distributed as dist
    import transformer_engine.pytorch as te
    from transformer_engine.pytorch.module import base as te_base

    from megatron_tp_overlap.engine.switcher import capture_initialize_ub

    tp, rank = dist.get_world_size(), dist.get_rank()
    init = None
    if overlap:
        with capture_initialize_ub() as calls:
            te_base.initialize_ub(
                shape=[seq * mbs, d.hidden],
                tp_size=tp,
                dtype=torch.bfloat16,
                ub_cfgs={},
                quantization_modes=[
                    te_base.UserBufferQuantizationMode.FP8 if fp8 else te_base.UserBufferQuantizationMode.NONE
                ],
                bootstrap_backend="nccl",
            )
        init = calls[0]
    torch.manual_seed(seed)
    sp = tp > 1
    model = torch.nn.Sequential(
        *[
            te.TransformerLayer(
                d.hidden,
                d.ffn,
                d.heads,
                num_gqa_groups=d.kv_heads,
                kv_channels=d.head_dim,
                layer_number=i + 1,
                hidden_dropout=0.0,
                attention_dropout=0.0,
                self_attn_mask_type="causal",
                attn_input_format="sbhd",
                activation="swiglu" if d.gated_mlp else "gelu",
                normalization="RMSNorm" if d.gated_mlp else "LayerNorm",
                params_dtype=torch.bfloat16,
                sequence_parallel=sp,
                tp_group=dist.group.WORLD,
                tp_size=tp,
                set_parallel_mode=sp,
                fuse_qkv_params=True,
                seq_length=seq,
                micro_batch_size=mbs,
                ub_tp_comm_overlap=overlap,
            )
            for i in range(layers)
        ]
    ).cuda()
    g = torch.Generator(device="cuda").manual_seed(42 + rank)
    shape = (seq // tp, mbs, d.hidden)
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
    dy = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)
    step, fingerprint = step_and_fingerprint(model, x, dy, fp8_autocast(dist.group.WORLD) if fp8 else None)
    return LayerStack(model, init, step, fingerprint)


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    import torch
    import torch.distributed as dist
    from transformer_engine.pytorch.module import base as te_base

    from megatron_tp_overlap.engine.measure import compare_configs, median_cuda_ms
    from megatron_tp_overlap.engine.search import SearchOptions
    from megatron_tp_overlap.engine.space import TuningConfig, all_off, space_spec_for_dgrad_mode
    from megatron_tp_overlap.engine.tuner import Autotuner
    from megatron_tp_overlap.model_features import dense_only
    from megatron_tp_overlap.models import load_model_dims
    from megatron_tp_overlap.ub.config import UbConfig

    d = load_model_dims(a.model)
    dense_only(d, "layer_bench")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl")
    tp, rank = dist.get_world_size(), dist.get_rank()
    out = Path(a.out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    overlap = tp > 1
    stack = build_stack(d, a.layers, a.tokens, 1, overlap)
    model, init, step, fingerprint = stack.model, stack.init, stack.step, stack.fingerprint

    result: dict[str, Any] = {
        "tp": tp,
        "model": a.model,
        "dims": d.__dict__,
        "layers": a.layers,
        "tokens": a.tokens,
        "dgrad_mode": a.dgrad_mode,
        "gpu": torch.cuda.get_device_name(),
    }
    if not overlap:
        result["step_ms"] = {"no overlap": median_cuda_ms(step, a.timing_steps)}
    else:
        keep = {f"{op}_{ph}" for op in a.operators for ph in ("fprop", "dgrad", "wgrad")}
        # The result is a YAML: per-GEMM "no overlap" has no YAML form (Megatron's --disable-tp-comm-* flags
        # switch a kind off in every layer), so it is timed for the report but never chosen.
        spec = replace(space_spec_for_dgrad_mode(a.dgrad_mode), include_off=False)
        tuner = Autotuner(
            model,
            step,
            init,
            options=SearchOptions(max_seconds=a.budget_s),
            space_spec=spec,
            allow_overlap_off=False,
            no_overlap_eligible=False,
            verify_fn=fingerprint,
            gemms=keep,
        )
        res = tuner.tune()
        if rank == 0:
            print(res.summary, flush=True)
        sw = tuner.switcher
        cases = {
            "no overlap": all_off(tuner.topology, TuningConfig(UbConfig())),
            "TE default": TuningConfig(UbConfig()),
            "tuned": TuningConfig(res.best.ub, res.best.disabled),
        }
        stats = compare_configs(cases, sw.apply, step, a.timing_steps, a.timing_rounds)
        result["step_ms"] = {k: v["median"] for k, v in stats.items()}
        result["step_ms_spread"] = {k: v["spread"] for k, v in stats.items()}
        result["chosen"] = res.best.to_dict()
        result["per_gemm_choices"] = res.search.choices
        result["slot_ms"] = res.report["summary"]
        if rank == 0:
            (out / f"tp{tp}_tuning_report.json").write_text(json.dumps(res.report, indent=1, default=str))
        if a.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                step()
                torch.cuda.synchronize()
            if rank == 0:
                prof.export_chrome_trace(str(out / f"tp{tp}_trace.json"))
    if rank == 0:
        (out / f"tp{tp}.json").write_text(json.dumps(result, indent=1, default=str))
    # the exit once took 21-31 s after the results were written: each phase of the teardown is timed (stderr)
    # so a run shows where that goes
    t = [time.perf_counter()]
    dist.barrier()
    if overlap:
        te_base.destroy_ub()
    t.append(time.perf_counter())
    dist.destroy_process_group()
    t.append(time.perf_counter())
    if rank == 0:
        print(
            f"[layer-bench] teardown: barrier + destroy_ub {t[1] - t[0]:.2f} s, destroy_process_group "
            f"{t[2] - t[1]:.2f} s",
            file=sys.stderr,
            flush=True,
        )


if __name__ == "__main__":
    main()
