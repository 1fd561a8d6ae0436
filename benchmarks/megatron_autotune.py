"""GPU acceptance of --tp-comm-overlap-autotune on Megatron-LM's own pretrain_gpt.py (core_v0.19.0).

    python benchmarks/megatron_autotune.py --script .megatron-lm/pretrain_gpt.py --gpus 2 --tp 2 \\
        --runs autotune,tuned_yaml,te_default,no_overlap --out DIR

Each run is ``torchrun -m megatron_tp_overlap.run <script> <args>`` (mock data, bf16, GPT with
4 layers, hidden 4096, ffn 14336, 32 heads / 8 KV groups, seq 8192, 4 micro-batches of 1). Exact
per-iteration losses come from the plugin's --iteration-log; iteration times from Megatron's log.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from megatron_tp_overlap.engine.options import TuneOptions

MODEL = {"layers": 4, "hidden": 4096, "ffn": 14336, "heads": 32, "kv_groups": 8, "global_batch": 4}  # the defaults
FP8_ARGS = ["--fp8-format", "hybrid"]  # what --fp8 adds to Megatron's flags


def add_trial_microbatches(p: argparse.ArgumentParser) -> None:
    """``--trial-microbatches`` of the one-GPU benchmarks that run the tuner's own trial steps."""
    p.add_argument(
        "--trial-microbatches",
        type=int,
        default=0,
        help="micro-batches per trial step (the tuner's option; 0: its default, the fewest: 1 here)",
    )


def on_trial_steps(argv: list[str], out_file: Path, measure) -> None:
    """Run Megatron-LM's script (``argv``) with its training loop replaced by ``measure(steps)`` on the tuner's own
    trial steps (``MegatronSteps``, the fewest micro-batches); rank 0 writes what it returns (plus the Megatron
    arguments) to ``out_file`` as JSON."""
    import megatron.training.training as training
    from megatron.training import get_args

    from megatron_tp_overlap.integrations.megatron.launcher import run_script
    from megatron_tp_overlap.integrations.megatron.run_shape import RunShape
    from megatron_tp_overlap.integrations.megatron.tuning import MegatronSteps

    def train(forward_step_func, model, optimizer, scheduler, data_iterator, *rest, **kw):
        steps = MegatronSteps(model, forward_step_func, optimizer, data_iterator, RunShape.from_args(get_args()), 0)
        result = {"megatron_args": argv[1:], **measure(steps)}
        if int(os.environ.get("RANK", "0")) == 0:
            out_file.parent.mkdir(parents=True, exist_ok=True)
            out_file.write_text(json.dumps(result) + "\n")
        return 0, 0  # no training; pretrain() carries on to its end

    training.train = train
    run_script(argv)


def parse_model_shape(text: str) -> dict[str, int]:
    """``--shape`` of the one-GPU benchmarks: ``"hidden=5120,ffn=17920"`` -> ``{"hidden": 5120, "ffn": 17920}``
    (keys checked by :func:`one_gpu_args`)."""
    return {k: int(v) for k, v in (kv.split("=", 1) for kv in text.split(",") if kv)}


def one_gpu_args(seq: int, iters: int, **shape: int) -> list[str]:
    """``model_args`` of the default GPT (``shape``: other values of ``MODEL``'s keys) on one GPU (TP=1: no sequence
    parallelism), for the measurements that need no TP (benchmarks/studies/compile_reset_cost.py, trial_noise.py,
    verify_noise.py)."""
    unknown = set(shape) - set(MODEL)
    if unknown:
        raise ValueError(f"model shape keys {sorted(unknown)}: must be among {sorted(MODEL)}")
    a = argparse.Namespace(tp=1, pp=1, seq=seq, iters=iters, **{**MODEL, **shape})
    return [x for x in model_args(a) if x != "--sequence-parallel"]


def model_args(a) -> list[str]:
    return [
        "--tensor-model-parallel-size",
        str(a.tp),
        "--pipeline-model-parallel-size",
        str(a.pp),
        "--sequence-parallel",
        "--num-layers",
        str(a.layers),
        "--hidden-size",
        str(a.hidden),
        "--ffn-hidden-size",
        str(a.ffn),
        "--num-attention-heads",
        str(a.heads),
        "--group-query-attention",
        "--num-query-groups",
        str(a.kv_groups),
        "--seq-length",
        str(a.seq),
        "--max-position-embeddings",
        str(a.seq),
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        str(a.global_batch),
        "--train-iters",
        str(a.iters),
        "--lr",
        "1e-4",
        "--min-lr",
        "1e-5",
        "--lr-decay-style",
        "cosine",
        "--lr-warmup-iters",
        "2",
        "--bf16",
        "--mock-data",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "32000",
        "--swiglu",
        "--normalization",
        "RMSNorm",
        "--position-embedding-type",
        "rope",
        "--disable-bias-linear",
        "--untie-embeddings-and-output-weights",
        "--no-gradient-accumulation-fusion",
        "--log-interval",
        "1",
        "--eval-iters",
        "0",
        "--eval-interval",
        "1000000",
        "--transformer-impl",
        "transformer_engine",
        "--seed",
        "1234",
        "--attention-backend",
        "auto",
    ]


NCCL_EXIT = re.compile(
    r"\[rank(\d+)\]:\[W\d{4} (\d\d):(\d\d):(\d\d\.\d+) ProcessGroupNCCL.*destroy_process_group\(\) was not called"
)


def exit_skew_s(log: str) -> float | None:
    """Seconds between the first and the last rank's exit, from the warning each rank's process-group destructor
    prints as the process ends (None: not every rank printed one)."""
    at: dict[int, float] = {}
    for rank, h, m, s in NCCL_EXIT.findall(log):
        at.setdefault(int(rank), 3600 * int(h) + 60 * int(m) + float(s))
    return round(max(at.values()) - min(at.values()), 2) if len(at) > 1 else None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--script", required=True)
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--layers", type=int, default=MODEL["layers"])
    p.add_argument("--hidden", type=int, default=MODEL["hidden"])
    p.add_argument("--ffn", type=int, default=MODEL["ffn"])
    p.add_argument("--heads", type=int, default=MODEL["heads"])
    p.add_argument("--kv-groups", type=int, default=MODEL["kv_groups"])
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--global-batch", type=int, default=MODEL["global_batch"])
    p.add_argument("--iters", type=int, default=25)
    p.add_argument(
        "--yaml-iters",
        type=int,
        default=0,
        help="runs other than autotune stop after this many iterations (Megatron's --exit-interval): the same "
        "--train-iters, so the same LR schedule and data, for a bitwise loss comparison at less cost (0: all)",
    )
    p.add_argument("--budget-s", type=float, default=TuneOptions.seconds)
    p.add_argument(
        "--runs",
        default="autotune,tuned_yaml,te_default,no_overlap",
        help="comma list of autotune, tuned_yaml, recipe (flags from the report), te_default, no_overlap",
    )
    p.add_argument("--tag", default="")
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="deterministic kernels as Megatron's --deterministic-mode sets them up (MEGATRON_TP_OVERLAP_DETERMINISTIC=1), for bitwise loss comparisons",
    )
    p.add_argument(
        "--master-port",
        type=int,
        default=int(os.environ.get("PET_MASTER_PORT", 29500)),  # suite.py --per-gpu gives each case its own
        help="torchrun's; differ for jobs sharing a host (default %(default)s: $PET_MASTER_PORT, else 29500)",
    )
    p.add_argument("--fp8", action="store_true", help="FP8 GEMMs (--fp8-format hybrid)")
    p.add_argument(
        "--extra",
        default="",
        help="more Megatron flags for every run, e.g. '--tp-comm-overlap-autotune-trial-timeout 10'",
    )
    p.add_argument(
        "--exit-trace",
        action="store_true",
        help="run through benchmarks/studies/exit_trace.py: each rank's way out of the run, timed, in the log",
    )
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = a.tag or f"tp{a.tp}pp{a.pp}"
    tuned = out / f"megatron_{tag}_tuned.yaml"
    extra = {
        "autotune": [
            "--tp-comm-overlap",
            "--tp-comm-overlap-autotune",
            "--tp-comm-overlap-autotune-output",
            str(tuned),
            "--tp-comm-overlap-autotune-seconds",
            str(a.budget_s),
        ],
        "tuned_yaml": ["--tp-comm-overlap", "--tp-comm-overlap-cfg", str(tuned)],
        "te_default": ["--tp-comm-overlap"],
        "no_overlap": [],
    }
    results: dict = {  # what scales a layer-level gain to this run's iteration (benchmarks/realized_vs_exhaustive.py)
        "model": {
            "layers": a.layers,
            "seq": a.seq,
            "micro_batch": 1,
            "micro_batches_per_iter": a.global_batch // (a.gpus // (a.tp * a.pp)),
            "tp": a.tp,
            "pp": a.pp,
            "fp8": a.fp8,
            "dims": [a.hidden, a.ffn, a.heads, a.kv_groups],
        }
    }
    for run in a.runs.split(","):  # "tuned_yaml.2": a second identical run (run-to-run determinism)
        kind = run.split(".")[0]
        if kind == "recipe":  # a fresh run from the recipe alone (flags to add and drop, the YAML), no tuning
            rep = json.loads(tuned.with_suffix(".report.json").read_text())["recipe"]
            extra["recipe"] = list(rep["add_flags"])
            print(f"[{a.tag or 'run'}] recipe run with: {rep['line']}", flush=True)
        loss_log = out / f"losses_{tag}_{run}"
        for f in out.glob(loss_log.name + ".rank*"):
            f.unlink()
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={a.gpus}",
            f"--master-port={a.master_port}",
            *(
                [str(Path(__file__).parent / "studies" / "exit_trace.py")]
                if a.exit_trace
                else ["-m", "megatron_tp_overlap.run"]
            ),
            "--iteration-log",
            str(loss_log),
            a.script,
            *model_args(a),
            *extra[kind],
            *a.extra.split(),
            *(["--exit-interval", str(a.yaml_iters)] if a.yaml_iters and kind != "autotune" else []),
        ]
        if a.fp8:
            cmd += FP8_ARGS
        env = {**os.environ, "MEGATRON_TP_OVERLAP_CHECK_STATE": "1"}
        if a.deterministic:  # Megatron's --deterministic-mode refuses --tp-comm-overlap: the same settings by env
            env["MEGATRON_TP_OVERLAP_DETERMINISTIC"] = "1"
        t0 = time.time()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        end = time.time()
        wall = end - t0
        log = proc.stdout + proc.stderr
        (out / f"log_{tag}_{run}.txt").write_text("\n".join(x for x in log.splitlines() if not x.startswith("!!! [UB")))
        times = [float(x) for x in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", log)]
        losses = []
        for f in sorted(out.glob(loss_log.name + ".rank*")):
            losses = [json.loads(x) for x in f.read_text().splitlines()]
        steady = times[5:] if len(times) > 8 else times
        results[run] = {
            "rc": proc.returncode,
            "wall_s": round(wall, 1),
            "iter_ms": times,
            "iter_ms_median": round(statistics.median(steady), 2) if steady else None,
            "iter_ms_spread": round(max(steady) - min(steady), 2) if steady else None,
            "losses": [x.get("lm loss") for x in losses],
            "exit_skew_s": exit_skew_s(log),
            # from the last training iteration's log line (any rank) to the end of torchrun: Megatron's own wrap-up,
            # every rank's exit, the agent's
            "exit_s_after_last_iteration": round(end - max(x["t"] for x in losses), 2) if losses else None,
        }
        print(
            f"[{tag}] {run}: rc={proc.returncode} wall {wall:.0f}s iter median {results[run]['iter_ms_median']} ms "
            f"losses {results[run]['losses'][:3]}; ranks' exits {results[run]['exit_skew_s']} s apart, torchrun ended "
            f"{results[run]['exit_s_after_last_iteration']} s after the last iteration",
            flush=True,
        )
        if proc.returncode != 0:
            print("\n".join(log.splitlines()[-40:]), flush=True)
    if "autotune" in results and "tuned_yaml" in results:
        la, lb = results["autotune"]["losses"][:20], results["tuned_yaml"]["losses"][:20]
        results["losses_equal_first_20"] = bool(la) and la == lb
        results["first_loss_difference_at_iteration"] = next(
            (i + 1 for i, (x, y) in enumerate(zip(la, lb)) if x != y), None
        )
        if "tuned_yaml.2" in results:
            lc = results["tuned_yaml.2"]["losses"][:20]
            results["tuned_yaml_repeat_equal_first_20"] = bool(lc) and lc == lb
            results["max_rel_loss_difference"] = {
                "autotune_vs_yaml": max(
                    (abs(float(x) - float(y)) / abs(float(y)) for x, y in zip(la, lb)), default=None
                ),
                "yaml_vs_yaml_repeat": max(
                    (abs(float(x) - float(y)) / abs(float(y)) for x, y in zip(lc, lb)), default=None
                ),
            }
    report = out / f"megatron_{tag}_tuned.report.json"
    if report.exists():
        r = json.loads(report.read_text())
        results["tuning"] = {
            "decision": r["decision"],
            "wall_s": r["meta"]["wall_s"],
            "switches": r["meta"].get("switches"),
            "summary": r["summary"],
            "state_check": r.get("state_check"),
            "numerics_guard": r["meta"].get("numerics_guard"),
            "reinit_s_median": r["meta"].get("reinit_s_median"),
            "reinit_phases_s_median": r["meta"].get("reinit_phases_s_median"),
            "in_run_verification": r.get("in_run_verification"),
        }
        d, v = r["decision"], r.get("in_run_verification") or {}
        dec = d.get("abba") or {}
        print(
            f"[{tag}] tuning {r['meta']['wall_s']:.1f} s (budget {a.budget_s:g} s), {r['meta']['switches']} switches, "
            f"re-init median {r['meta'].get('reinit_s_median')} s {r['meta'].get('reinit_phases_s_median')}; chose {d['chosen']}; decision noise "
            f"{dec.get('noise_pct_of_step')}% of a step; {d['reason']}",
            flush=True,
        )
        if v:
            print(f"[{tag}] in-run verification: {v.get('message')}", flush=True)
            after = results["autotune"]["iter_ms"][v["iterations"] + 1 :] if "autotune" in results else []
            if len(after) >= 3:  # the iterations after the verification's switching: the config the run kept
                results["autotune"]["iter_ms_median_after_verification"] = round(statistics.median(after), 2)
                print(
                    f"[{tag}] after the verification ({v['kept']} kept): iter median {statistics.median(after):.1f} ms "
                    f"over {len(after)} iterations",
                    flush=True,
                )
    (out / f"megatron_{tag}.json").write_text(json.dumps(results, indent=1))
    print(f"\n| {tag} | run | iter ms (median, iters 6+) | spread | rc |\n|---|---|---|---|---|")
    for k, v in results.items():
        if isinstance(v, dict) and "rc" in v:
            print(f"| {tag} | {k} | {v['iter_ms_median']} | {v['iter_ms_spread']} | {v['rc']} |")
    if "losses_equal_first_20" in results:
        print(
            f"first 20 losses, autotune vs tuned YAML: {'bitwise equal' if results['losses_equal_first_20'] else 'DIFFERENT'}"
        )


if __name__ == "__main__":
    main()
