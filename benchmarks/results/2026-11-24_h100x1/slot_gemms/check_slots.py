"""One GPU: the per-slot GEMM-alone times that bound each collective's hiding, for the TP=4 / TP=8 cases' local
shapes (overlap_vs_baselines.slot_pairs at the target TP size; the collectives need the real TP group).

    torchrun --nproc-per-node=1 benchmarks/results/2026-11-24_h100x1/slot_gemms/check_slots.py   (repository root)
"""

import importlib.util
import json
import os
import time

import torch
import torch.distributed as dist

from megatron_tp_overlap.models import load_model_dims

spec = importlib.util.spec_from_file_location("ovb", "benchmarks/overlap_vs_baselines.py")
ovb = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ovb)
SLOTS = ("qkv.fwd", "qkv.bwd", "proj.fwd", "proj.bwd", "fc1.fwd", "fc1.bwd", "fc2.fwd", "fc2.bwd")
CASES = [("llama3_70b_seq8192", 4), ("llama3_70b_seq8192", 8), ("gpt3_175b", 8), ("gpt3_20b", 4)]
SHAPES = {
    "yi34b_like": ("yi34b_like:7168,20480,56,8,4096", 4),
    "mistral_large_like": ("mistral_large_like:12288,28672,96,8,4096", 8),
}

torch.cuda.set_device(0)
dist.init_process_group("nccl")
rows, out = [], []
for name, tp in CASES + [(k, v[1]) for k, v in SHAPES.items()]:
    if name in SHAPES:
        _, (d, seq, mbs) = ovb.parse_shape(SHAPES[name][0])
    else:
        d, (seq, mbs) = load_model_dims(ovb.CASES[name][0]), ovb.CASES[name][1:]
    pairs = ovb.slot_pairs(d, seq * mbs, tp)
    t0 = time.perf_counter()
    g = ovb.gemm_alone_ms([mkn for ps in pairs.values() for _, mkn in ps])
    per_slot = {s: round(sum(g[mkn] for _, mkn in ps), 4) for s, ps in pairs.items()}
    out.append(
        {"case": name, "tp": tp, "gemm_ms_per_slot_per_layer": per_slot, "seconds": round(time.perf_counter() - t0, 2)}
    )
    rows.append(f"| {name} | {tp} | " + " | ".join(f"{per_slot[s]:.3f}" for s in SLOTS) + " |")
with open(os.path.join(os.environ["OUT"], "slot_gemms.json"), "w") as f:
    json.dump(out, f, indent=1)
print("| case | TP | " + " | ".join(SLOTS) + " |  (GEMM-alone ms per layer, bf16)")
print("|---|---|" + "---|" * len(SLOTS))
print("\n".join(rows))
dist.destroy_process_group()
