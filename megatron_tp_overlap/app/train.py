"""The main job: train a GPT on mock data with Megatron-LM, TP = all local GPUs, the userbuffers overlap config
tuned live before the first iteration (or reused from the cache).

    torchrun --nproc-per-node=$(nvidia-smi -L | wc -l) -m megatron_tp_overlap.train \\
        [model=llama3_8b model.num_layers=4 parallel.tp=4 tp_overlap.seconds=30 ...]

Config: ``conf/`` (schema :mod:`app.config`). All ranks share one run directory ``output.root/<name>`` (rank 0
picks the name): resolved config, tuned YAML, report, plot, logs, TensorBoard events.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path
from typing import Any

from megatron_tp_overlap.app.config import (
    CONF_DIR,
    MOE_KEYS,
    check_overrides,
    model_provenance,
    register,
    resolve_model,
    validate,
    with_model_group,
)
from megatron_tp_overlap.engine.options import TUNED_YAML_NAME, option_fields
from megatron_tp_overlap.errors import refuse

TAG = "[megatron-tp-overlap]"


def compose(overrides: list[str] | None = None) -> Any:
    """The resolved config for ``overrides`` (Hydra's compose API; what the app sees)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return hydra_compose(config_name="config", overrides=with_model_group(list(overrides or [])))


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


def option_flags(ov: Any) -> list[str]:
    """The ``--tp-comm-overlap-autotune-*`` flags for the autotune options in ``ov`` (generated, like the flags)."""
    from megatron_tp_overlap.integrations.megatron.flags import flag_name

    out = []
    for f in option_fields():
        v = getattr(ov, f.name)
        if v is None:
            continue
        out += (
            [flag_name(f.name) if v else "--no-" + flag_name(f.name)[2:]]
            if isinstance(v, bool)
            else [flag_name(f.name), str(v)]
        )
    return out


def overlap_flags(cfg: Any, run_dir: Path) -> tuple[list[str], str]:
    """Megatron flags for ``cfg.tp_overlap`` and a line saying what will happen."""
    from megatron_tp_overlap.ub.config import dumps_yaml
    from megatron_tp_overlap.ub.preset_shape import preset_header
    from megatron_tp_overlap.ub.presets import get_preset

    ov = cfg.tp_overlap
    if ov.mode == "off":
        return [], "TP overlap off (sequence parallelism over NCCL)"
    flags, given = ["--tp-comm-overlap"], "TE's default ub_cfgs"
    if ov.preset is not None:
        target = run_dir / f"{ov.preset}.yaml"
        target.write_text(dumps_yaml(get_preset(ov.preset), header=preset_header(ov.preset)))
        flags, given = flags + ["--tp-comm-overlap-cfg", str(target)], f"preset {ov.preset}"
    elif ov.file:
        flags, given = flags + ["--tp-comm-overlap-cfg", str(ov.file)], str(ov.file)
    if ov.mode != "autotune":
        return flags, f"TP overlap with {given}"
    output = ov.output or str(run_dir / TUNED_YAML_NAME)
    flags += ["--tp-comm-overlap-autotune", *option_flags(ov), "--tp-comm-overlap-autotune-output", output]
    return flags, (
        f"tuning the TP overlap config live from {given} (budget {ov.seconds:g} s"
        + (f" / {ov.steps} steps" if ov.steps else "")
        + ("; a config tuned before for this shape is reused" if ov.reuse else "")
        + ")"
    )


def megatron_args(cfg: Any, tp: int) -> list[str]:
    from megatron_tp_overlap.integrations.megatron.gpt import megatron_argv

    m, tr = resolve_model(cfg.model), cfg.training
    moe = ({k: getattr(m, k) for k in MOE_KEYS} | {"ep": cfg.parallel.ep}) if m.num_experts else None
    return megatron_argv(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        kv_channels=m.kv_channels,
        seq_length=tr.seq_length,
        vocab_size=m.vocab_size,
        tp=tp,
        pp=cfg.parallel.pp,
        sequence_parallel=cfg.parallel.sequence_parallel,
        micro_batch_size=tr.micro_batch_size,
        global_batch_size=tr.global_batch_size,
        train_iters=tr.train_iters,
        precision=tr.precision,
        lr=tr.lr,
        seed=tr.seed,
        swiglu=bool(m.swiglu),
        moe=moe,
    )


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
    """ms between consecutive logged iterations (the iteration log of the last pipeline stage)."""
    files = sorted(run_dir.glob("iterations.rank*"))
    if not files:
        return []
    rows = [json.loads(line) for line in files[-1].read_text().splitlines() if line.strip()]
    t = [r["t"] for r in rows if "t" in r]
    return [1e3 * (b - a) for a, b in zip(t, t[1:])]


def model_line(model: dict[str, Any]) -> str:
    """One log line: which model the dimensions came from, and what the config changed of it."""
    d = model["dims"]
    line = (
        f"model {model['hf'] or d['name']} (dimensions from {model['source']}): {d['num_layers']} layers, hidden "
        f"{d['hidden_size']}, ffn {d['ffn_hidden_size']}, {d['num_attention_heads']} heads / "
        f"{d['num_query_groups'] or d['num_attention_heads']} KV"
    )
    if d.get("num_experts"):
        freq = d["moe_layer_freq"]
        layers = (
            f"layers {[i for i, x in enumerate(freq) if x]}"
            if isinstance(freq, list)
            else "every layer"
            if freq in (None, 1)
            else f"every {freq}th layer from layer 0"
        )
        line += (
            f"; MoE on {layers}: {d['num_experts']} experts, top-{d['moe_router_topk']}, expert ffn "
            f"{d['moe_ffn_hidden_size'] or d['ffn_hidden_size']}, shared expert ffn "
            f"{d['moe_shared_expert_intermediate_size'] or 'none'}"
        )
    if model["overridden"]:
        line += "; given instead of the model's: " + ", ".join(
            f"{k}={v['given']} (model: {v['model']})" for k, v in model["overridden"].items()
        )
    return line


def summarize(run_dir: Path, tuned_yaml: Path) -> None:
    """Rank 0, after training: the model record in the tuning report, the plot of the report and step times, and a
    last line."""
    step_ms = iteration_times(run_dir)
    report = tuned_yaml.with_suffix(".report.json")
    verified = 0  # iterations of the in-run verification (they switch configs): not steady state
    if report.exists():
        from megatron_tp_overlap.atomic import atomic_write_text

        data = json.loads(report.read_text())
        data["model"] = json.loads((run_dir / "model.json").read_text())
        verified = (data.get("in_run_verification") or {}).get("iterations", 0)
        atomic_write_text(report, json.dumps(data, indent=1, default=str) + "\n")
        from megatron_tp_overlap.tools.plots import plot_report

        print(f"{TAG} plot: {plot_report(data, run_dir / 'tp_overlap.png', step_ms=step_ms[1:])}")
    skip = verified + 1 if verified else 0  # and the iteration its last switch back ran in
    steady = step_ms[skip:] if len(step_ms) > skip else step_ms
    if steady:
        tail = sorted(steady[len(steady) // 5 :])
        after = f" (after the {verified} iterations of the in-run verification)" if verified else ""
        print(
            f"{TAG} {len(step_ms) + 1} iterations; median time between iterations{after} {tail[len(tail) // 2]:.1f} "
            f"ms; outputs in {run_dir}"
        )


def run(cfg: Any) -> None:
    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf

    world = int(os.environ.get("WORLD_SIZE", "1"))
    problems = validate(cfg, world)
    if problems:
        refuse("megatron_tp_overlap.train: invalid config:\n" + "\n".join(f"  - {p}" for p in problems))
    if not torch.cuda.is_available():
        refuse("megatron_tp_overlap.train needs CUDA GPUs (launch with torchrun on a GPU node)")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    run_dir = agree_run_dir(cfg.output.root, cfg.output.name)
    log_file = open(run_dir / f"log.rank{rank}.txt", "a")
    sys.stdout = _Tee(sys.__stdout__, log_file)  # type: ignore[assignment]
    flags, what = overlap_flags(cfg, run_dir)
    model = model_provenance(cfg.model)
    if rank == 0:
        OmegaConf.save(cfg, run_dir / "config.yaml")
        (run_dir / "model.json").write_text(json.dumps(model, indent=1) + "\n")
        print(f"{TAG} run directory {run_dir}; {what}", flush=True)
        print(f"{TAG} {model_line(model)}", flush=True)
        if model.get("not_reproduced"):
            print(f"{TAG} not reproduced (GEMM shapes unchanged): {', '.join(model['not_reproduced'])}", flush=True)

    from megatron_tp_overlap.integrations.megatron.gpt import main as megatron_main

    argv = megatron_args(cfg, cfg.parallel.tp or world) + flags + ["--tensorboard-dir", str(run_dir / "tensorboard")]
    megatron_main(argv, iteration_log=run_dir / "iterations")
    dist.barrier()
    if rank == 0:
        summarize(run_dir, Path(cfg.tp_overlap.output or run_dir / TUNED_YAML_NAME))
    log_file.flush()


def composed(overrides: list[str]) -> Any:
    """The config for ``overrides`` (Hydra's own flags and ``hydra.*`` keys left to Hydra), or the process ends with
    one line per problem, exit 2: a typo with the valid keys and the closest one, a value of the wrong type with the
    type the key takes (not Hydra's block and traceback, once per rank)."""
    from megatron_tp_overlap.app.config import override_error

    problems = check_overrides(overrides)
    if problems:
        refuse("megatron_tp_overlap.train: invalid overrides:\n" + "\n".join(f"  - {p}" for p in problems))
    ours = [o for o in overrides if "=" in o and not o.startswith("-") and not o.lstrip("+~").startswith("hydra")]
    try:
        return compose(ours)
    except Exception as e:  # noqa: BLE001 - Hydra/OmegaConf raise many kinds; each is a bad override here
        refuse(f"megatron_tp_overlap.train: invalid override: {override_error(e)}")


def dry_run_main(ours: dict[str, str], overrides: list[str]) -> None:
    from megatron_tp_overlap.app.dry_run import dry_run, world_size

    cfg = composed(overrides)
    world, where = world_size(cfg, ours.get("--world-size"))
    problems, lines = dry_run(cfg, world, where, ours.get("--gpu"))
    if lines and os.environ.get("RANK", "0") == "0":
        print("\n".join(f"{TAG} {line}" for line in lines), flush=True)
    if problems:
        refuse("megatron_tp_overlap.train: invalid config:\n" + "\n".join(f"  - {p}" for p in problems))
    if os.environ.get("RANK", "0") == "0":
        print(f"{TAG} dry run: the launch would pass validation", flush=True)
    raise SystemExit(0)


def main() -> None:
    from megatron_tp_overlap.app.dry_run import flag_problems, split_flags

    if sys.argv[1:2] == ["--version"]:
        from megatron_tp_overlap import __version__

        print(f"megatron-tp-overlap {__version__}")
        raise SystemExit(0)
    ours, rest = split_flags(sys.argv[1:])
    problems = flag_problems(ours)
    if problems:
        refuse("megatron_tp_overlap.train: " + "; ".join(problems))
    if ours:
        dry_run_main(ours, rest)
    composed(rest)  # bad overrides end here, before Hydra's own handling
    import hydra

    sys.argv = [sys.argv[0], *with_model_group(rest)]
    register()
    hydra.main(config_path=str(CONF_DIR), config_name="config", version_base=None)(run)()


if __name__ == "__main__":
    main()
