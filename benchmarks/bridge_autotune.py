"""A short Megatron-Bridge pre-training run with the autotune comm-overlap config, under torchrun:

    torchrun --nproc-per-node=2 benchmarks/bridge_autotune.py --tp 2 --out DIR            # autotune
    torchrun --nproc-per-node=2 benchmarks/bridge_autotune.py --tp 2 --no-autotune ...     # TE default ub_cfgs
    torchrun --nproc-per-node=2 benchmarks/bridge_autotune.py --moe --tp 2 --seq 4096 ...  # Qwen3-MoE-like model
    python benchmarks/bridge_autotune.py --state-identity --moe --tp 1 --iters 20 --out DIR  # one GPU, see below

Bridge's own objects end to end: ``ConfigContainer`` with a Llama-3-8B-like ``GPTModelProvider`` (fewer
layers; ``--moe``: Qwen3-MoE-like, :data:`MOE`, through the provider's megatron-core ``TransformerConfig`` MoE
fields and megatron-core's decoder block spec, which builds the dense first layer that ``moe_layer_freq`` asks
for), mock data, ``NullTokenizer``, and ``megatron.bridge.training.pretrain.pretrain`` with Bridge's
``forward_step``. The only change from a plain Bridge run is ``cfg.comm_overlap``: our
``AutotuneCommOverlapConfig`` instead of Bridge's ``CommOverlapConfig``; Hydra-style overrides given after
``--`` go through Bridge's own override parser, e.g. ``-- comm_overlap.tp_comm_overlap_autotune_seconds=20``.
Bridge logs iteration times and losses itself; the tuned YAML and report go to DIR.

``--state-identity`` (one GPU, TP=1, no comm overlap): the Bridge twin of
``benchmarks/studies/trials_leave_state.py``. Bridge's ``pretrain`` runs ``--iters`` iterations three times, each
under its own ``torchrun`` (deterministic kernels, ``MEGATRON_TP_OVERLAP_DETERMINISTIC=1``): without trials, again
without (the control: a difference there means the run is not reproducible and the comparison says nothing;
``--no-control`` skips it) and with ``--trials`` of tuning's own trial steps before its first iteration (the
study's ``run_trials``: ``MegatronSteps`` on micro-batches read ahead from Bridge's iterator and handed back,
numerics fingerprints, the snapshot restored; a simulated switch, ``gc.collect()``, a device sync and ``--idle-s``,
every 3 steps, as at TP=1 there are no userbuffers to switch). Each run writes every iteration's exact losses and
MoE metrics (``DIR/no_trials.json``, ...); the first ``--iters`` are compared bitwise and one line says
``first 20 losses, trials vs no trials: bitwise equal`` or the first iteration that differs (JSON:
``DIR/bridge_state.json``; exit 1 unless equal). With ``MEGATRON_TP_OVERLAP_CHECK_STATE=1`` the trials run also
checks the training state bitwise (``StateCheck``) and logs the plugin's ``training state after tuning`` line.

On the GPU machines (no network; Bridge's wheels staged on the CPU machine by
``bash benchmarks/studies/stage_bridge.sh`` into ``.bridge/``, 15 MB), two device calls to the same warm machine,
since ``.device`` (50.4 MiB) + the tracked files (6.8 MiB) + ``.bridge`` (14.4 MiB) exceed the 64 MiB one call
carries (``.device`` + ``.bridge`` alone are 64.8 MiB)::

    # call 1 (a fresh machine: TE, megatron-core and the project)
    run(carry=[".device"], command="source .device/env.sh && bash .device/setup.sh")
    # call 2, the same warm machine (.device stays there): Bridge's wheels, then the case
    run(carry=[".bridge"], command="source .device/env.sh && bash .device/setup.sh && python benchmarks/suite.py --cases bridge_moe_state_1gpu --out $OUT/bridge")

``bridge_moe_state_1gpu`` needs one GPU (the default kind); ``bridge_moe_tp2`` (``--cases bridge_moe_tp2``) the same
two calls with ``kind="nvidia-h100-x2"``. Each suite case starts with ``bash .bridge/install.sh`` (the staged wheels,
``--no-deps``, and an import check).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "studies"))  # the studies this builds on (trials_leave_state, trial_noise)
from trial_noise import SWITCH_IDLE_S  # noqa: E402

# Qwen3-MoE-like (as the Megatron-LM case moe_tp2): megatron-core TransformerConfig field names (core_v0.19.0)
MOE_SHAPE = dict(hidden_size=2048, ffn_hidden_size=6144, num_attention_heads=32, num_query_groups=4, kv_channels=128)
MOE = dict(
    num_moe_experts=32,
    moe_router_topk=8,
    moe_ffn_hidden_size=768,
    moe_shared_expert_intermediate_size=1536,
    moe_layer_freq=[0] + [1] * 3,  # the first layer dense
    moe_grouped_gemm=True,
    moe_token_dispatcher_type="alltoall",
    moe_router_enable_expert_bias=True,
    moe_router_score_function="sigmoid",
    moe_router_load_balancing_type="global_aux_loss",
    moe_aux_loss_coeff=1e-3,
)
DENSE_SHAPE = dict(hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32, num_query_groups=8, kv_channels=128)


def model_fields(a: argparse.Namespace) -> dict[str, Any]:
    """``GPTModelProvider`` fields of the run's model (Llama-3-8B-like, or Qwen3-MoE-like with ``--moe``), but the
    layer spec."""
    import torch
    import torch.nn.functional as F

    moe = getattr(a, "moe", False)
    return dict(
        num_layers=a.layers,
        **(MOE_SHAPE if moe else DENSE_SHAPE),
        **(MOE if moe else {}),
        normalization="RMSNorm",
        activation_func=F.silu,
        gated_linear_unit=True,
        add_bias_linear=False,
        position_embedding_type="rope",
        rotary_base=500000,
        share_embeddings_and_output_weights=False,
        vocab_size=32768,
        seq_length=a.seq,
        tensor_model_parallel_size=a.tp,
        pipeline_model_parallel_size=1,
        context_parallel_size=1,
        sequence_parallel=a.tp > 1,  # megatron-core refuses it at TP=1
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        attention_softmax_in_fp32=True,
        make_vocab_size_divisible_by=128,
        deterministic_mode=False,
        gradient_accumulation_fusion=False,  # True needs APEX's CUDA extension
    )


def build_config(a: argparse.Namespace):
    from megatron.bridge.models.gpt_provider import GPTModelProvider
    from megatron.bridge.training.config import (
        CheckpointConfig,
        ConfigContainer,
        DistributedDataParallelConfig,
        LoggerConfig,
        MockGPTDatasetConfig,
        OptimizerConfig,
        RNGConfig,
        SchedulerConfig,
        TrainingConfig,
    )
    from megatron.bridge.training.tokenizers.config import TokenizerConfig

    from megatron_tp_overlap.integrations.bridge import AutotuneCommOverlapConfig

    fields = model_fields(a)
    if getattr(a, "moe", False):
        from functools import partial

        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        # Bridge's default spec is one layer spec for every layer (all MoE); the block spec follows moe_layer_freq,
        # as Megatron-LM's pretrain_gpt.py and Bridge's own MoE bridges (hy_v3, sarvam) build it
        fields["transformer_layer_spec"] = partial(get_gpt_decoder_block_spec, use_transformer_engine=True)
    model = GPTModelProvider(**fields)
    out = Path(a.out)
    return ConfigContainer(
        model=model,
        train=TrainingConfig(
            train_iters=a.iters,
            global_batch_size=a.global_batch,
            micro_batch_size=1,
            eval_interval=10_000,
            eval_iters=0,
            exit_signal_handler=False,
        ),
        optimizer=OptimizerConfig(
            optimizer="adam",
            bf16=True,
            fp16=False,
            adam_beta1=0.9,
            adam_beta2=0.95,
            adam_eps=1e-8,
            use_distributed_optimizer=True,
            clip_grad=1.0,
            lr=3e-4,
            weight_decay=0.01,
            min_lr=3e-5,
        ),
        scheduler=SchedulerConfig(
            lr_decay_style="cosine",
            lr_warmup_iters=2,
            lr_warmup_init=0.0,
            lr_decay_iters=a.iters,
            start_weight_decay=0.01,
            end_weight_decay=0.01,
            weight_decay_incr_style="constant",
            override_opt_param_scheduler=True,
        ),
        ddp=DistributedDataParallelConfig(
            check_for_nan_in_grad=True,
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=True,
            overlap_param_gather=True,
            average_in_collective=True,
            use_distributed_optimizer=True,
        ),
        dataset=MockGPTDatasetConfig(
            seq_length=a.seq,
            random_seed=1234,
            reset_attention_mask=False,
            reset_position_ids=False,
            eod_mask_loss=False,
            num_dataset_builder_threads=1,
            data_sharding=True,
            dataloader_type="single",
            num_workers=1,
            skip_getting_attention_mask_from_dataset=True,
        ),
        logger=LoggerConfig(log_interval=1, tensorboard_dir=None),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=32768),
        checkpoint=CheckpointConfig(save=None, load=None, save_interval=None),
        rng=RNGConfig(seed=1234),
        comm_overlap=None
        if a.tp < 2  # userbuffers need TP >= 2 (the one-GPU state-identity runs)
        else AutotuneCommOverlapConfig(
            tp_comm_overlap=True,
            tp_comm_overlap_autotune=not a.no_autotune,
            tp_comm_overlap_autotune_seconds=a.budget_s,
            tp_comm_overlap_autotune_output=str(out / "bridge_tuned.yaml"),
        ),
        mixed_precision="bf16_mixed",
    )


def state_run(a: argparse.Namespace, out_file: Path) -> None:
    """One run of ``--state-identity`` (inside torchrun, one GPU): Bridge's ``pretrain`` with ``a.trials`` of
    tuning's trial steps before its first iteration (0: none); every iteration's exact losses and MoE metrics, and
    the trials' state check, go to ``out_file``."""
    from megatron_tp_overlap.integrations.megatron.launcher import (
        CHECK_STATE_ENV,
        DETERMINISTIC_ENV,
        deterministic_with_overlap,
    )

    if os.environ.get(DETERMINISTIC_ENV) == "1":  # before the first NCCL/cuBLAS/TE call
        deterministic_with_overlap()
    import megatron.bridge.training.pretrain as bridge_pretrain
    import megatron.bridge.training.train as bridge_train
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.utils.train_utils import prepare_forward_step_func
    from trial_noise import simulated_switch
    from trials_leave_state import iteration_row, run_trials

    from megatron_tp_overlap.engine.tuner import rank0_print
    from megatron_tp_overlap.integrations.bridge import install
    from megatron_tp_overlap.integrations.megatron.outputs import _verdict
    from megatron_tp_overlap.integrations.megatron.run_shape import RunShape

    install()  # the compile_helpers guard (a pip-installed megatron-core has no Makefile); no autotune config here
    original_train, original_log = bridge_pretrain.train, bridge_train.training_log
    rows, meta, live = [], {"trials": a.trials}, {}
    check_state = os.environ.get(CHECK_STATE_ENV) == "1"

    def training_log(loss_dict, *rest, **kw):
        # Bridge's training_log has no iteration argument; the loop has counted the step before it logs
        rows.append(iteration_row(live["state"].train_state.step, loss_dict))
        return original_log(loss_dict, *rest, **kw)

    def train(forward_step_func, model, optimizer, scheduler, train_it, valid_it, global_state, *rest, **kw):
        live["state"] = global_state
        if a.trials:
            cfg = global_state.cfg
            run = RunShape.from_transformer_config(cfg.model, cfg.train.micro_batch_size)
            fwd = prepare_forward_step_func(forward_step_func, global_state)  # as tune_before_training hands it
            switch = lambda: simulated_switch(a.idle_s)
            train_it, check = run_trials(model, fwd, optimizer, train_it, run, a.trials, meta, check_state, switch)
            if check is not None:
                meta["state_check"] = _verdict(check, rank0_print)  # the plugin's "training state after tuning" line
        return original_train(
            forward_step_func, model, optimizer, scheduler, train_it, valid_it, global_state, *rest, **kw
        )

    bridge_pretrain.train, bridge_train.training_log = train, training_log
    try:
        pretrain_with(a, forward_step)
    finally:
        if int(os.environ.get("RANK", "0")) == 0:
            out_file.parent.mkdir(parents=True, exist_ok=True)
            out_file.write_text(json.dumps({**meta, "iterations": rows}) + "\n")


def pretrain_with(a: argparse.Namespace, forward_step: Any) -> Any:
    """Bridge's ``pretrain`` on :func:`build_config` (overrides through Bridge's own parser); the config."""
    from megatron.bridge.training.pretrain import pretrain

    cfg = build_config(a)
    if a.overrides:  # Bridge's own path for recipe scripts' command-line overrides
        from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides

        cfg = process_config_with_overrides(cfg, cli_overrides=a.overrides)
    pretrain(cfg, forward_step)
    return cfg


def state_verdict(result: dict, iters: int) -> list[str]:
    """The lines ``--state-identity`` prints for ``trials_leave_state.compare``'s result."""

    def said(diff: Any, what: str) -> str:
        if diff is None:
            return f"first {iters} losses, {what}: bitwise equal"
        if diff == -1:
            return f"first {iters} losses, {what}: not compared (a run logged fewer than {iters} iterations)"
        return f"first {iters} losses, {what}: differ from iteration {diff}"

    lines = [said(result["trials vs no trials"], "trials vs no trials")]
    if result["control (no trials twice)"] != "not run":
        lines.append(said(result["control (no trials twice)"], "control (no trials twice)"))
    return lines


def state_identity(a: argparse.Namespace, argv: list[str]) -> int:
    """``--state-identity``: the runs, one torchrun each, then their comparison (``out/bridge_state.json``)."""
    from trials_leave_state import RUNS, compare, read_runs, run_file

    from megatron_tp_overlap.integrations.megatron.launcher import DETERMINISTIC_ENV

    out = Path(a.out)
    env = {**os.environ, DETERMINISTIC_ENV: "1"}
    codes = {}
    for name in [r for r in RUNS if not (a.no_control and r == "no trials again")]:
        f = run_file(out, name)
        f.unlink(missing_ok=True)  # a file of an earlier call must not stand in for a run that dies
        trials = a.trials if name == "trials" else 0
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", __file__]
        cmd += child_args(argv, f, trials)
        print(" ".join(cmd), flush=True)
        codes[name] = subprocess.run(cmd, env=env).returncode
    runs = read_runs(out, list(codes))
    result = {"moe": a.moe, "exit_codes": codes, **compare(runs, a.iters)}
    result["first_losses"] = {n: [r.get("lm loss") for r in run["iterations"][:3]] for n, run in runs.items()}
    result["lines"] = state_verdict(result, a.iters)
    (out / "bridge_state.json").write_text(json.dumps(result, indent=1) + "\n")
    for line in result["lines"]:
        print(f"[bridge_state] {line}", flush=True)
    print(f"[bridge_state] {json.dumps(result)}", flush=True)
    return max([*codes.values(), 0 if result["trials vs no trials"] is None else 1])


def child_args(argv: list[str], out_file: Path, trials: int) -> list[str]:
    """One state-identity run's arguments: the command's own less ``--state-identity`` (the child is one run), its
    file and trial count (last, so they win) before any ``--`` (what follows it are Bridge overrides)."""
    words = [w for w in argv if w != "--state-identity"]
    cut = words.index("--") if "--" in words else len(words)
    return words[:cut] + ["--state-run", str(out_file), "--trials", str(trials)] + words[cut:]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--global-batch", type=int, default=4)
    p.add_argument("--budget-s", type=float, default=30.0)
    p.add_argument("--no-autotune", action="store_true", help="Bridge with TE's default ub_cfgs (the comparison run)")
    p.add_argument("--moe", action="store_true", help="a Qwen3-MoE-like model (32 experts, top-8; first layer dense)")
    p.add_argument(
        "--state-identity",
        action="store_true",
        help="one GPU, TP=1: runs with and without tuning's trial steps, first --iters losses compared bitwise",
    )
    p.add_argument("--trials", type=int, default=30, help="--state-identity: trial steps before the first iteration")
    p.add_argument(
        "--idle-s", type=float, default=SWITCH_IDLE_S, help="--state-identity: host seconds per simulated switch"
    )
    p.add_argument("--no-control", action="store_true", help="--state-identity: skip the second run without trials")
    p.add_argument("--state-run", default=None, help=argparse.SUPPRESS)  # one run of --state-identity (its file)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument(
        "overrides", nargs="*", help="Hydra-style overrides, e.g. comm_overlap.tp_comm_overlap_autotune_seconds=20"
    )
    return p


def main() -> None:
    p = parser()
    a = p.parse_args()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    if a.state_run is not None:
        state_run(a, Path(a.state_run))
        return
    if a.state_identity:
        if a.tp != 1 or a.iters < 1 or a.trials < 2:
            p.error("--state-identity runs on one GPU: --tp 1, --iters >= 1, --trials >= 2")
        sys.exit(state_identity(a, sys.argv[1:]))

    from megatron.bridge.training.gpt_step import forward_step

    cfg = pretrain_with(a, forward_step)
    if int(os.environ.get("RANK", "0")) == 0 and cfg.comm_overlap is not None:  # pretrain() has torn the group down
        co = cfg.comm_overlap
        summary = {
            "autotune": co.tp_comm_overlap_autotune,
            "seconds": co.tp_comm_overlap_autotune_seconds,
            "model.tp_comm_overlap_cfg": str(cfg.model.tp_comm_overlap_cfg),
            "comm_overlap.tp_comm_overlap_cfg": type(co.tp_comm_overlap_cfg).__name__,
        }
        (Path(a.out) / "bridge_run.json").write_text(json.dumps(summary, indent=1))
        print("bridge run:", json.dumps(summary))


if __name__ == "__main__":
    main()
