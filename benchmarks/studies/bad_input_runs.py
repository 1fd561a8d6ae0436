"""How bad inputs and failures end (or do not end) a launch under torchrun: exit code, seconds to exit, and the
lines of our messages (what a user reads), for each of:

    python benchmarks/studies/bad_input_runs.py --megatron-lm DIR --gpus 2 --out DIR

1. Megatron-LM ``pretrain_gpt.py`` with ``--tp-comm-overlap-autotune-rtol 5`` (a bad flag value);
2. the same with ``--tp-comm-overlap-cfg`` of a YAML whose ``[`` is never closed;
3. the main job with ``tp_overlap.secnds=5`` (a typo);
4. ``--tp-comm-overlap-autotune-output`` that is a directory, and one that cannot be created (``/proc/nope/...``);
5. every trial failing (``--tp-comm-overlap-autotune-trial-timeout 0.001``): the run must train on;
6. SIGTERM to torchrun in the middle of tuning: the YAML already at the output path must be left as it was, and no
   temporary file left beside it.
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
    "transformer_engine --no-gradient-accumulation-fusion --eval-iters 0 --eval-interval 1000000 --log-interval 1 "
    "--tp-comm-overlap --tp-comm-overlap-autotune"
).split()
OURS = (
    "megatron-tp-overlap",
    "megatron_tp_overlap",
    "  - ",
    "[tp-overlap-autotune] WARNING",
    "[tp-overlap-autotune] tuning",
    "[bad_input_runs]",
    " [iteration",
    "[after training",
)  # our lines; Megatron's iteration log


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--megatron-lm", required=True)
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--out", required=True)
    p.add_argument("--only", default="", help="comma list of case names (default: all)")
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
    kept = out / "kept" / "tuned.yaml"  # a YAML the user had: a killed tuning must leave it as it was
    kept.parent.mkdir(exist_ok=True)
    kept.write_text("# the user's file\nqkv_dgrad:\n  method: bulk\n  num_sm: 4\n")
    cases = {
        "bad_flag": [*script, "--tp-comm-overlap-autotune-rtol", "5"],
        "bad_yaml": [*script, "--tp-comm-overlap-cfg", str(out / "bad.yaml")],
        "bad_override": [*run, "-m", "megatron_tp_overlap.train", "tp_overlap.secnds=5"],
        "output_is_a_directory": [*script, "--tp-comm-overlap-autotune-output", str(out)],
        "output_unwritable": [*script, "--tp-comm-overlap-autotune-output", "/proc/nope/tuned.yaml"],
        "every_trial_fails": [
            *script,
            "--tp-comm-overlap-autotune-trial-timeout",
            "0.001",
            "--tp-comm-overlap-autotune-output",
            str(out / "fails" / "tuned.yaml"),
        ],
        "killed_mid_tuning": [
            *script,
            "--tp-comm-overlap-autotune-output",
            str(kept),
            "--tp-comm-overlap-autotune-seconds",
            "120",
        ],
    }
    results = {}
    for name, cmd in cases.items():
        if a.only and name not in a.only.split(","):
            continue
        t0 = time.time()
        if name == "killed_mid_tuning":  # SIGTERM once tuning has run for a while
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            lines = []
            for line in proc.stdout:
                lines.append(line)
                if "overlap modules, slots:" in line:  # the tuner's first line: trials start now
                    time.sleep(8)
                    proc.send_signal(15)
                    break
            lines += proc.stdout.readlines()
            proc.wait(timeout=120)
            proc.stdout, proc.stderr = "".join(lines), ""
            leftovers = sorted(p.name for p in kept.parent.iterdir() if p.name != kept.name)
            intact = kept.read_text().startswith("# the user's file")
            proc.stdout += f"\n[bad_input_runs] user's YAML intact: {intact}; other files there: {leftovers}\n"
        else:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
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
            "iterations_trained": sum("elapsed time per iteration" in x for x in log.splitlines()),
        }
        print(
            f"| {name} | rc {proc.returncode} | {wall:.1f} s | {len(ours)} lines of ours: {ours[:6]} | "
            f"{results[name]['iterations_trained']} iterations trained | "
            f"{results[name]['traceback_lines']} tracebacks, {results[name]['log_lines']} log lines |",
            flush=True,
        )
    (out / "bad_input_runs.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
