"""The main job: train a GPT on mock data with Megatron, TP = all local GPUs, the userbuffers
overlap config tuned live before the first iteration (or reused from the cache).

    torchrun --nproc-per-node=$(nvidia-smi -L | wc -l) -m megatron_tp_overlap.train \\
        [model=llama3_8b model.num_layers=4 parallel.tp=4 tp_overlap.budget_s=30 ...]

Config: ``conf/`` (schema ``app_config.py``). All ranks share one run directory
``output.root/<name>`` (rank 0 picks the name): resolved config, tuned YAML, report, plot, logs.
"""
from __future__ import annotations

import datetime
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from .app_config import CONF_DIR, check_overrides, register, validate


def compose(overrides: list[str] | None = None) -> Any:
    """The resolved config for ``overrides`` (Hydra's compose API; what the app sees)."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return hydra_compose(config_name="config", overrides=list(overrides or []))


def agree_run_dir(root: str, name: str | None, group: Any = None) -> Path:
    """Rank 0 picks ``root/name`` (default: a timestamp) and creates it; every rank gets the same path."""
    import torch.distributed as dist

    chosen = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        base = Path(root) / (name or datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
        path, i = base, 1
        while name is None and path.exists():  # two runs started in the same second
            path, i = base.with_name(f"{base.name}-{i}"), i + 1
        path.mkdir(parents=True, exist_ok=True)
        chosen = [str(path.resolve())]
    if dist.is_initialized():
        dist.broadcast_object_list(chosen, src=0, group=group)
    return Path(chosen[0])


def overlap_flags(cfg: Any, run_dir: Path, cached: Any | None) -> tuple[list[str], str]:
    """Megatron flags for ``cfg.tp_overlap`` and a line saying what will happen.

    ``cached``: the cache's ``(UbConfig, meta)`` for this shape, or None.
    """
    from .presets import get_preset
    from .ub_config import dumps_yaml

    ov = cfg.tp_overlap
    if ov.mode == "off":
        return [], "TP overlap off (sequence parallelism over NCCL)"
    if ov.mode == "te_default":
        return ["--tp-comm-overlap"], "TP overlap with TE's default ub_cfgs"
    if ov.mode == "file":
        return ["--tp-comm-overlap", "--tp-comm-overlap-cfg", str(ov.file)], f"TP overlap with {ov.file}"
    target = run_dir / "tp_comm_overlap_tuned.yaml"
    if ov.mode == "preset":
        target = run_dir / f"{ov.preset}.yaml"
        target.write_text(dumps_yaml(get_preset(ov.preset), header=f"NeMo preset {ov.preset}"))
        return ["--tp-comm-overlap", "--tp-comm-overlap-cfg", str(target)], f"TP overlap with preset {ov.preset}"
    if cached is not None and not ov.force:
        ub, meta = cached
        target.write_text(dumps_yaml(ub, header=f"reused from the tuned-config cache (tuned {meta.get('date', '?')})"))
        return (["--tp-comm-overlap", "--tp-comm-overlap-cfg", str(target)],
                f"reusing the cached tuned config for this GPU/TP/shape/dtype/TE ({target}); tuning skipped "
                "(tp_overlap.force=true re-tunes)")
    flags = ["--tp-comm-overlap", "--tp-comm-overlap-autotune", "--tp-comm-overlap-autotune-output", str(target),
             "--tp-comm-overlap-autotune-seconds", str(ov.budget_s), "--tp-comm-overlap-autotune-steps", str(ov.budget_steps),
             "--tp-comm-overlap-autotune-strategy", ov.strategy]
    if ov.allow_off:
        flags.append("--tp-comm-overlap-autotune-allow-off")
    return flags, f"tuning the TP overlap config live (budget {ov.budget_s:g} s / {ov.budget_steps} steps)"


class _Tee:
    def __init__(self, *streams: Any):
        self.streams = streams

    def write(self, s: str) -> int:
        for st in self.streams:
            st.write(s)
        return len(s)

    def flush(self) -> None:
        for st in self.streams:
            st.flush()

    def isatty(self) -> bool:
        return False


def iteration_times(run_dir: Path) -> list[float]:
    """ms between consecutive logged iterations (from the exact-loss log of the last pipeline stage)."""
    files = sorted(run_dir.glob("iterations.rank*"))
    if not files:
        return []
    rows = [json.loads(line) for line in files[-1].read_text().splitlines() if line.strip()]
    t = [r["t"] for r in rows if "t" in r]
    return [1e3 * (b - a) for a, b in zip(t, t[1:])]


def run(cfg: Any) -> None:
    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf

    world = int(os.environ.get("WORLD_SIZE", "1"))
    problems = validate(cfg, world)
    if problems:
        raise SystemExit("megatron_tp_overlap.train: invalid config:\n" + "\n".join(f"  - {p}" for p in problems))
    if not torch.cuda.is_available():
        raise SystemExit("megatron_tp_overlap.train needs CUDA GPUs (launch with torchrun on a GPU node)")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    run_dir = agree_run_dir(cfg.output.root, cfg.output.name)
    log_file = open(run_dir / f"log.rank{rank}.txt", "a")
    sys.stdout = _Tee(sys.__stdout__, log_file)  # type: ignore[assignment]
    tp = cfg.parallel.tp or world

    import transformer_engine

    from .cache import CacheKey, TunedConfigCache
    from .integrations import megatron as integ
    from .integrations.megatron_gpt import main as megatron_main, megatron_argv

    key = CacheKey(torch.cuda.get_device_name(), tp, cfg.training.seq_length * cfg.training.micro_batch_size,
                   cfg.model.hidden_size, cfg.model.ffn_hidden_size, cfg.model.num_attention_heads,
                   cfg.training.precision, transformer_engine.__version__)
    cache = TunedConfigCache(cfg.tp_overlap.cache_dir)
    cached = cache.get(key) if cfg.tp_overlap.mode == "autotune" else None
    flags, what = overlap_flags(cfg, run_dir, cached)
    if rank == 0:
        OmegaConf.save(cfg, run_dir / "config.yaml")
        print(f"[megatron-tp-overlap] run directory {run_dir}; {what}", flush=True)

    def remember(result: Any, yaml_path: Path) -> None:  # after tuning, before training
        if dist.get_rank() == 0:
            cache.put(key, result.best.ub, {"date": datetime.date.today().isoformat(), "chosen": result.best.label,
                                            "report": str(yaml_path.with_suffix(".report.json"))})

    integ.TPOverlapAutotuneCallback.hooks.append(remember)
    os.environ["MEGATRON_TP_OVERLAP_LOSS_LOG"] = str(run_dir / "iterations")
    m = cfg.model
    argv = megatron_argv(num_layers=m.num_layers, hidden_size=m.hidden_size, ffn_hidden_size=m.ffn_hidden_size,
                         num_attention_heads=m.num_attention_heads, num_query_groups=m.num_query_groups,
                         seq_length=cfg.training.seq_length, vocab_size=m.vocab_size, tp=tp, pp=cfg.parallel.pp,
                         sequence_parallel=cfg.parallel.sequence_parallel, micro_batch_size=cfg.training.micro_batch_size,
                         global_batch_size=cfg.training.global_batch_size, train_iters=cfg.training.train_iters,
                         precision=cfg.training.precision, lr=cfg.training.lr, seed=cfg.training.seed, swiglu=m.swiglu)
    argv += flags + ["--tensorboard-dir", str(run_dir / "tensorboard")]
    megatron_main(argv)

    dist.barrier()
    if rank == 0:
        report_path = run_dir / "tp_comm_overlap_tuned.report.json"
        step_ms = iteration_times(run_dir)
        if report_path.exists():
            from .plots import plot_report
            png = plot_report(json.loads(report_path.read_text()), run_dir / "tp_overlap.png", step_ms=step_ms[1:])
            print(f"[megatron-tp-overlap] plot: {png}")
        if step_ms:
            tail = sorted(step_ms[len(step_ms) // 5:])
            print(f"[megatron-tp-overlap] {len(step_ms) + 1} iterations; median time between iterations "
                  f"{tail[len(tail) // 2]:.1f} ms; outputs in {run_dir}")
        shutil.copy(Path(__file__).with_name("conf") / "config.yaml", run_dir / "config.defaults.yaml")
    log_file.flush()


def main() -> None:
    problems = check_overrides(sys.argv[1:])
    if problems:
        print("megatron_tp_overlap.train: " + "\n  ".join(["invalid overrides:", *problems]), file=sys.stderr)
        raise SystemExit(2)
    import hydra

    register()
    hydra.main(config_path=str(CONF_DIR), config_name="config", version_base=None)(run)()


if __name__ == "__main__":
    main()
