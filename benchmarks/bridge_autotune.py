"""A short Megatron-Bridge pre-training run with the autotune comm-overlap config, under torchrun:

    torchrun --nproc-per-node=2 benchmarks/bridge_autotune.py --tp 2 --out DIR            # autotune
    torchrun --nproc-per-node=2 benchmarks/bridge_autotune.py --tp 2 --no-autotune ...     # TE default ub_cfgs

Bridge's own objects end to end: ``ConfigContainer`` with a Llama-3-8B-like ``GPTModelProvider`` (fewer
layers), mock data, ``NullTokenizer``, and ``megatron.bridge.training.pretrain.pretrain`` with Bridge's
``forward_step``. The only change from a plain Bridge run is ``cfg.comm_overlap``: our
``AutotuneCommOverlapConfig`` instead of Bridge's ``CommOverlapConfig``; Hydra-style overrides given after
``--`` go through Bridge's own override parser, e.g. ``-- comm_overlap.tp_comm_overlap_autotune_seconds=20``.
Bridge logs iteration times and losses itself; the tuned YAML and report go to DIR.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def build_config(a: argparse.Namespace):
    import torch
    import torch.nn.functional as F
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

    model = GPTModelProvider(
        num_layers=a.layers,
        hidden_size=4096,
        ffn_hidden_size=14336,
        num_attention_heads=32,
        num_query_groups=8,
        kv_channels=128,
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
        sequence_parallel=True,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        attention_softmax_in_fp32=True,
        make_vocab_size_divisible_by=128,
        deterministic_mode=False,
        gradient_accumulation_fusion=False,
    )  # True needs APEX's CUDA extension
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
        comm_overlap=AutotuneCommOverlapConfig(
            tp_comm_overlap=True,
            tp_comm_overlap_autotune=not a.no_autotune,
            tp_comm_overlap_autotune_seconds=a.budget_s,
            tp_comm_overlap_autotune_output=str(out / "bridge_tuned.yaml"),
        ),
        mixed_precision="bf16_mixed",
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--global-batch", type=int, default=4)
    p.add_argument("--budget-s", type=float, default=30.0)
    p.add_argument("--no-autotune", action="store_true", help="Bridge with TE's default ub_cfgs (the comparison run)")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument(
        "overrides", nargs="*", help="Hydra-style overrides, e.g. comm_overlap.tp_comm_overlap_autotune_seconds=20"
    )
    a = p.parse_args()
    Path(a.out).mkdir(parents=True, exist_ok=True)

    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain

    cfg = build_config(a)
    if a.overrides:  # Bridge's own path for recipe scripts' command-line overrides
        from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides

        cfg = process_config_with_overrides(cfg, cli_overrides=a.overrides)
    pretrain(cfg, forward_step)

    if int(os.environ.get("RANK", "0")) == 0:  # pretrain() has already torn the process group down
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
