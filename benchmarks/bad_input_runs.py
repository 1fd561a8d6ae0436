"""How a bad flag, a bad YAML and a bad override end a launch under torchrun: exit code, seconds to exit, and
the lines of our error (what a user reads), for each of:

    python benchmarks/bad_input_runs.py --megatron-lm DIR --gpus 2 --out DIR

1. Megatron-LM ``pretrain_gpt.py`` with ``--tp-comm-overlap-autotune-rtol 5`` (a bad flag value);
2. the same with ``--tp-comm-overlap-cfg`` of a YAML whose ``[`` is never closed;
3. the main job with ``tp_overlap.secnds=5`` (a typo).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

MEGATRON_ARGS = (
    "--sequence-parallel --num-layers 2 --hidden-size 1024 --ffn-hidden-size 4096 --num-attention-heads 8 "
    "--seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 1 --global-batch-size 2 --train-iters 5 "
    "--lr 1e-4 --bf16 --mock-data --tokenizer-type NullTokenizer --vocab-size 32000 --transformer-impl "
    "transformer_engine --no-gradient-accumulation-fusion --tp-comm-overlap --tp-comm-overlap-autotune"
).split()
OURS = ("megatron-tp-overlap", "megatron_tp_overlap", "  - ")  # the lines our refusal prints


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--megatron-lm", required=True)
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bad.yaml").write_text("qkv_fprop:\n  method: [ring_exchange\n")
    run = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={a.gpus}"]
    script = [
        *run,
        "-m",
        "megatron_tp_overlap.run",
        f"{a.megatron_lm}/pretrain_gpt.py",
        *MEGATRON_ARGS,
        "--tensor-model-parallel-size",
        str(a.gpus),
    ]
    cases = {
        "bad_flag": [*script, "--tp-comm-overlap-autotune-rtol", "5"],
        "bad_yaml": [*script, "--tp-comm-overlap-cfg", str(out / "bad.yaml")],
        "bad_override": [*run, "-m", "megatron_tp_overlap.train", "tp_overlap.secnds=5"],
    }
    results = {}
    for name, cmd in cases.items():
        t0 = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        wall = time.time() - t0
        log = proc.stdout + proc.stderr
        (out / f"{name}.log").write_text(log)
        ours = [line for line in log.splitlines() if line.startswith(OURS)]
        results[name] = {
            "command": " ".join(cmd),
            "rc": proc.returncode,
            "wall_s": round(wall, 1),
            "our_lines": ours,
            "traceback_lines": sum("Traceback" in x for x in log.splitlines()),
            "log_lines": len(log.splitlines()),
        }
        print(
            f"| {name} | rc {proc.returncode} | {wall:.1f} s | {len(ours)} lines of ours: {ours[:4]} | "
            f"{results[name]['traceback_lines']} tracebacks, {results[name]['log_lines']} log lines |",
            flush=True,
        )
    (out / "bad_input_runs.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
