"""Built-in GPT training entry for megatron-core 0.19 (the wheel ships no ``pretrain_gpt.py``).

    torchrun --nproc-per-node=N -m megatron_tp_overlap.integrations.megatron.gpt <Megatron args> \\
        --mock-data --tp-comm-overlap --tp-comm-overlap-autotune

TE layer spec, mock data (``MockGPTDataset``), Megatron's own ``pretrain`` and parser. Scope: the
plain decoder-only case (no context parallelism, packed sequences or multi-token prediction); other
settings are refused with a clear message. ``megatron_argv`` turns a model/parallel/training
description into Megatron flags for the Hydra app; with ``num_experts`` in ``moe``, Megatron's GPT builder
(``get_gpt_decoder_block_spec``) makes the layers of ``--moe-layer-freq`` MoE layers.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

UNSUPPORTED = {
    "context_parallel_size": (1, "context parallelism"),
    "mtp_num_layers": (None, "multi-token prediction"),
    "sft": (False, "SFT datasets"),
}


def megatron_argv(
    *,
    num_layers: int,
    hidden_size: int,
    ffn_hidden_size: int,
    num_attention_heads: int,
    num_query_groups: int | None,
    kv_channels: int | None = None,
    seq_length: int,
    vocab_size: int,
    tp: int,
    pp: int,
    sequence_parallel: bool,
    micro_batch_size: int,
    global_batch_size: int,
    train_iters: int,
    precision: str,
    lr: float = 1e-4,
    seed: int = 1234,
    swiglu: bool = True,
    log_interval: int = 1,
    moe: Mapping[str, Any] | None = None,
) -> list[str]:
    """Megatron-LM flags for a RoPE/RMSNorm GPT on mock data (what the Hydra app launches); ``moe``: the MoE keys of
    the app's ModelConfig and ``ep`` (see :func:`moe_argv`), none or ``num_experts`` unset for a dense GPT."""
    if precision not in ("bf16", "fp8"):
        raise ValueError(f"precision = {precision!r}: must be 'bf16' or 'fp8'")
    values = {
        "--num-layers": num_layers,
        "--hidden-size": hidden_size,
        "--ffn-hidden-size": ffn_hidden_size,
        "--num-attention-heads": num_attention_heads,
        "--seq-length": seq_length,
        "--max-position-embeddings": seq_length,
        "--tensor-model-parallel-size": tp,
        "--pipeline-model-parallel-size": pp,
        "--micro-batch-size": micro_batch_size,
        "--global-batch-size": global_batch_size,
        "--train-iters": train_iters,
        "--lr": lr,
        "--min-lr": lr / 10,
        "--lr-decay-style": "cosine",
        "--lr-warmup-iters": max(1, train_iters // 50),
        "--tokenizer-type": "NullTokenizer",
        "--vocab-size": vocab_size,
        "--normalization": "RMSNorm",
        "--position-embedding-type": "rope",
        "--transformer-impl": "transformer_engine",
        "--log-interval": log_interval,
        "--eval-iters": 0,
        "--eval-interval": 10**9,
        "--seed": seed,
        "--kv-channels": kv_channels,
    }
    switches = {
        "--bf16": True,
        "--mock-data": True,
        "--disable-bias-linear": True,
        "--untie-embeddings-and-output-weights": True,
        "--no-gradient-accumulation-fusion": True,
        "--swiglu": swiglu,
        "--sequence-parallel": sequence_parallel,
        "--group-query-attention": bool(num_query_groups) and num_query_groups != num_attention_heads,
    }
    if switches["--group-query-attention"]:
        values["--num-query-groups"] = num_query_groups
    if precision == "fp8":
        values["--fp8-format"] = "hybrid"
    return (
        [x for k, v in values.items() if v is not None for x in (k, str(v))]
        + [k for k, on in switches.items() if on]
        + (moe_argv(**moe, sequence_parallel=sequence_parallel, tp=tp, fp8=precision == "fp8") if moe else [])
    )


def moe_argv(
    *,
    num_experts: int | None,
    moe_router_topk: int | None,
    moe_ffn_hidden_size: int | None = None,
    moe_shared_expert_intermediate_size: int | None = None,
    moe_layer_freq: int | list[int] | None = None,
    moe_router_score_function: str | None = None,
    moe_router_enable_expert_bias: bool = False,
    moe_router_load_balancing_type: str = "aux_loss",
    moe_aux_loss_coeff: float = 0.0,
    moe_grouped_gemm: bool = True,
    moe_token_dispatcher_type: str = "alltoall",
    ep: int = 1,
    sequence_parallel: bool = True,
    tp: int = 1,
    fp8: bool = False,
) -> list[str]:
    """Megatron-LM core_v0.19.0's MoE flags (none when ``num_experts`` is unset); a combination Megatron refuses is
    one ValueError line here, before launch."""
    if not num_experts:
        return []
    score = moe_router_score_function or ("sigmoid" if moe_router_enable_expert_bias else "softmax")
    bad = []
    if not (moe_router_topk and 1 <= moe_router_topk <= num_experts):
        bad.append(f"moe_router_topk = {moe_router_topk}: must be between 1 and num_experts = {num_experts}")
    if ep < 1 or num_experts % ep:
        bad.append(f"ep = {ep}: must divide num_experts = {num_experts}")
    if tp > 1 and not sequence_parallel:
        bad.append("MoE with TP > 1 needs sequence parallelism")
    if moe_router_enable_expert_bias and score == "softmax":
        bad.append("expert bias needs the sigmoid or sqrtsoftplus score function")
    if bad:
        raise ValueError("MoE: " + "; ".join(bad))
    values = {
        "--num-experts": num_experts,
        "--moe-router-topk": moe_router_topk,
        "--moe-ffn-hidden-size": moe_ffn_hidden_size,
        "--moe-shared-expert-intermediate-size": moe_shared_expert_intermediate_size,
        "--moe-layer-freq": (
            f"[{','.join(map(str, moe_layer_freq))}]" if isinstance(moe_layer_freq, (list, tuple)) else moe_layer_freq
        ),
        "--moe-router-score-function": score,
        "--moe-router-load-balancing-type": moe_router_load_balancing_type,
        "--moe-aux-loss-coeff": moe_aux_loss_coeff,
        "--moe-token-dispatcher-type": moe_token_dispatcher_type,
        "--expert-model-parallel-size": ep,
    }
    switches = {
        "--moe-router-enable-expert-bias": moe_router_enable_expert_bias,
        "--moe-grouped-gemm": moe_grouped_gemm,
        # Megatron refuses top-1 softmax routing without it (softmax over one score has no gradient)
        "--moe-router-pre-softmax": moe_router_topk == 1 and score == "softmax",
        # FP8 expert GEMMs take token counts padded to the FP8 alignment
        "--moe-router-padding-for-quantization": fp8,
    }
    return [x for k, v in values.items() if v is not None for x in (k, str(v))] + [
        k for k, on in switches.items() if on
    ]


def _check_supported(args: Any) -> None:
    bad = [
        f"--{k.replace('_', '-')}={getattr(args, k)!r} ({what})"
        for k, (ok, what) in UNSUPPORTED.items()
        if getattr(args, k, ok) != ok
    ]
    if bad:
        raise SystemExit(
            "megatron_tp_overlap.integrations.megatron.gpt supports the plain GPT case only; "
            f"not: {', '.join(bad)}. Use Megatron-LM's pretrain_gpt.py with -m megatron_tp_overlap.run."
        )
    if not getattr(args, "mock_data", False):
        raise SystemExit(
            "the built-in entry trains on --mock-data only; use Megatron-LM's pretrain_gpt.py for real data"
        )


def get_batch(data_iterator: Any, vp_stage: int | None = None) -> tuple:
    """(tokens, labels, loss_mask, attention_mask, position_ids) on this rank (TP rank 0 reads, broadcasts)."""
    from megatron.core import mpu
    from megatron.core.utils import get_batch_on_this_tp_rank
    from megatron.training import get_args
    from megatron.training.utils import is_first_or_last_pipeline_stage

    args = get_args()
    if not is_first_or_last_pipeline_stage(vp_stage):
        return None, None, None, None, None
    keys = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")
    batch: dict = {}
    tp_rank = mpu.get_tensor_model_parallel_rank()
    if tp_rank == 0:
        batch = next(data_iterator)
        for k in keys:
            batch[k] = batch[k].cuda(non_blocking=True) if batch.get(k) is not None else None
    batch = get_batch_on_this_tp_rank(
        batch,
        has_cu_seqlens=False,
        is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(),
        cp_size=1,
        tp_rank=tp_rank,
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        mtp_on_this_rank=False,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(),
        is_pipeline_last_stage=mpu.is_pipeline_last_stage(),
    )
    return tuple(batch.get(k) for k in keys)


def loss_func(loss_mask: Any, output_tensor: Any) -> tuple:
    import torch

    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator: Any, model: Any, return_schedule_plan: bool = False) -> tuple:
    from megatron.core.utils import get_attr_wrapped_model

    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator, vp_stage)
    output = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output, partial(loss_func, loss_mask)


def datasets_provider(train_val_test_num_samples: list[int], vp_stage: int | None = None) -> tuple:
    from megatron.core import mpu
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from megatron.training import get_args
    from megatron.training.utils import is_first_or_last_pipeline_stage

    args = get_args()
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=None,
        blend_per_split=None,
        split="1,0,0",
        path_to_cache=None,
        tokenizer=build_tokenizer(args),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=args.create_attention_mask_in_dataloader,
    )
    built_here = partial(
        lambda vp: is_first_or_last_pipeline_stage(vp) and mpu.get_tensor_model_parallel_rank() == 0, vp_stage
    )
    return BlendedMegatronDatasetBuilder(MockGPTDataset, train_val_test_num_samples, built_here, config).build()


def main(argv: list[str] | None = None, iteration_log: str | Path | None = None) -> None:
    import sys

    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    from megatron_tp_overlap.integrations.megatron import install

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    install(iteration_log=iteration_log)
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
    _check_supported(args)
    datasets_provider.is_distributed = True
    pretrain(
        pretrain_cfg_container_from_args(args, gpt_config_from_args(args)),
        datasets_provider,
        ModelType.encoder_or_decoder,
        forward_step,
    )


if __name__ == "__main__":
    main()
