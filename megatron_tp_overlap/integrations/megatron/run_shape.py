"""What tuning needs to know about a Megatron run, read from Megatron-LM's arguments or from a megatron-core
``TransformerConfig`` (Megatron-Bridge's model provider, NeMo's GPT config): one description for every way in."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Optional

from megatron_tp_overlap.engine.cache import TuningKey
from megatron_tp_overlap.engine.switcher import UbInitArgs
from megatron_tp_overlap.integrations.megatron.graphs import graph_mode, refusal
from megatron_tp_overlap.integrations.megatron.recompute import Recompute


def _precision(c: Any) -> str:
    """What beyond the dtype decides the GEMMs' kernels and the bytes they communicate (Megatron's flags and
    TransformerConfig use the same names): the FP8 format and recipe, FP4, the counts of bf16 edge layers."""
    parts = []
    if getattr(c, "fp8", None):
        parts.append(f"{c.fp8}/{getattr(c, 'fp8_recipe', None) or 'delayed'}")
    if getattr(c, "fp4", None):
        parts.append(f"fp4:{c.fp4}/{getattr(c, 'fp4_recipe', None)}")
    if _bf16_edge_layers(c):
        start, end = (getattr(c, f"num_layers_at_{w}_in_bf16", 0) or 0 for w in ("start", "end"))
        parts.append(f"bf16_edges:{start},{end}")
    return "+".join(parts)


def _bf16_edge_layers(c: Any) -> bool:
    """An FP8 run with its first/last layers in bf16 (Megatron's flags and TransformerConfig use the same names)."""
    return bool(getattr(c, "first_last_layers_bf16", False)) and (
        (getattr(c, "num_layers_at_start_in_bf16", 0) or 0) > 0 or (getattr(c, "num_layers_at_end_in_bf16", 0) or 0) > 0
    )


def _recompute(c: Any) -> Optional[str]:
    return Recompute.of(c).flag()


def _moe(c: Any, experts: Optional[int]) -> str:
    """An MoE model's layout for the reuse key (Megatron's flags and TransformerConfig use the same names): what
    changes the overlapped GEMMs (shared-expert FFN, which layers are dense) or the step around them (experts, top-k,
    expert FFN, expert parallelism). "" for a dense model."""
    if not experts:
        return ""
    parts = {
        "experts": experts,
        "topk": getattr(c, "moe_router_topk", None),
        "ffn": getattr(c, "moe_ffn_hidden_size", None),
        "shared": getattr(c, "moe_shared_expert_intermediate_size", None),
        "shared_overlap": bool(getattr(c, "moe_shared_expert_overlap", False)),
        "freq": getattr(c, "moe_layer_freq", None),
        "ep": getattr(c, "expert_model_parallel_size", None),
        "etp": getattr(c, "expert_tensor_parallel_size", None),
        "dispatcher": getattr(c, "moe_token_dispatcher_type", None),
    }
    return ",".join(f"{k}={v}" for k, v in parts.items() if v is not None)


def _cuda_graphs(c: Any) -> Optional[str]:
    return graph_mode(c)


@dataclass(frozen=True)
class RunShape:
    """The parallel layout, GEMM shapes and precision of a run (what the tuned config depends on)."""

    tp: int
    seq_length: int
    micro_batch_size: int
    hidden: int
    ffn: int
    heads: int
    kv_groups: Optional[int]  # None: multi-head attention
    kv_channels: int  # head size
    gated_mlp: bool  # SwiGLU: fc1 is 2 x ffn wide
    fp8: Optional[str]  # FP8 format, or None
    bf16: bool
    fp16: bool = False
    cp: int = 1
    sequence_parallel: bool = True
    tp_comm_overlap: bool = True
    transformer_engine: bool = True
    rs_dgrad: bool = False  # --tp-comm-overlap-rs-dgrad: qkv/fc1 dgrad as GEMM + reduce-scatter
    bootstrap_backend: str = "nccl"
    bf16_edge_layers: bool = False  # FP8 run with its first/last layers in bf16: a second userbuffers mode
    decoder_seq_length: Optional[int] = None
    recompute: Optional[str] = None  # recompute flags, when recompute re-runs an overlap GEMM (part of the key)
    moe_experts: Optional[int] = None
    moe: str = ""  # _moe: the MoE layout, part of the reuse key
    cuda_graphs: Optional[str] = None  # Megatron's CUDA graph mode (graphs.MODES), when on
    precision: str = ""  # FP8 format/recipe, FP4, bf16 edge layer counts (_precision); part of the reuse key

    @staticmethod
    def from_args(args: argparse.Namespace) -> RunShape:
        """From Megatron-LM's parsed arguments."""
        heads, edge = args.num_attention_heads, _bf16_edge_layers(args)
        return RunShape(
            tp=args.tensor_model_parallel_size,
            seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size,
            hidden=args.hidden_size,
            ffn=args.ffn_hidden_size,
            heads=heads,
            kv_groups=args.num_query_groups if getattr(args, "group_query_attention", False) else None,
            kv_channels=getattr(args, "kv_channels", None) or args.hidden_size // heads,
            # Megatron's core_transformer_config_from_args: both make fc1 2 x ffn wide
            gated_mlp=bool(getattr(args, "swiglu", False) or getattr(args, "quick_geglu", False)),
            fp8=getattr(args, "fp8", None),
            bf16=bool(args.bf16),
            fp16=bool(getattr(args, "fp16", False)),
            cp=getattr(args, "context_parallel_size", 1) or 1,
            sequence_parallel=bool(args.sequence_parallel),
            tp_comm_overlap=bool(getattr(args, "tp_comm_overlap", False)),
            transformer_engine=getattr(args, "transformer_impl", "transformer_engine") == "transformer_engine",
            rs_dgrad=bool(getattr(args, "tp_comm_overlap_rs_dgrad", False)),
            bootstrap_backend=getattr(args, "tp_comm_bootstrap_backend", None) or "nccl",
            bf16_edge_layers=edge,
            decoder_seq_length=args.decoder_seq_length if getattr(args, "decoder_tp_comm_overlap", False) else None,
            recompute=_recompute(args),
            moe_experts=getattr(args, "num_experts", None),
            moe=_moe(args, getattr(args, "num_experts", None)),
            cuda_graphs=_cuda_graphs(args),
            precision=_precision(args),
        )

    @staticmethod
    def from_transformer_config(m: Any, micro_batch_size: int, bootstrap_backend: Optional[str] = None) -> RunShape:
        """From a megatron-core ``TransformerConfig``-like model config that also carries ``seq_length``."""
        heads, kv, edge = m.num_attention_heads, getattr(m, "num_query_groups", None), _bf16_edge_layers(m)
        return RunShape(
            tp=m.tensor_model_parallel_size,
            seq_length=m.seq_length,
            micro_batch_size=micro_batch_size,
            hidden=m.hidden_size,
            ffn=m.ffn_hidden_size,
            heads=heads,
            kv_groups=kv if kv not in (None, heads) else None,
            kv_channels=getattr(m, "kv_channels", None) or m.hidden_size // heads,
            gated_mlp=bool(getattr(m, "gated_linear_unit", False)),
            fp8=getattr(m, "fp8", None),
            bf16=bool(getattr(m, "bf16", False)),
            fp16=bool(getattr(m, "fp16", False)),
            cp=getattr(m, "context_parallel_size", 1) or 1,
            sequence_parallel=bool(m.sequence_parallel),
            tp_comm_overlap=bool(getattr(m, "tp_comm_overlap", False)),
            rs_dgrad=bool(getattr(m, "tp_comm_overlap_rs_dgrad", False)),
            bootstrap_backend=bootstrap_backend or getattr(m, "tp_comm_bootstrap_backend", None) or "nccl",
            bf16_edge_layers=edge,
            recompute=_recompute(m),
            moe_experts=getattr(m, "num_moe_experts", None),
            moe=_moe(m, getattr(m, "num_moe_experts", None)),
            cuda_graphs=_cuda_graphs(m),
            precision=_precision(m),
        )

    @property
    def init_tokens(self) -> int:
        """Rows of the userbuffers (Megatron's ``initialize_ub`` shape[0])."""
        return (self.decoder_seq_length or self.seq_length) * self.micro_batch_size // self.cp

    @property
    def dtype(self) -> str:
        return "fp8" if self.fp8 else "bf16" if self.bf16 else "fp16" if self.fp16 else "fp32"

    def problems(self, te_available: bool = True) -> list[str]:
        """Why tuning cannot run on this layout (empty when it can). Flag names as Megatron-LM spells them."""
        p = []
        if not self.tp_comm_overlap:
            p.append("needs --tp-comm-overlap (tp_comm_overlap=True): it tunes TE's userbuffers overlap")
        if not self.sequence_parallel:
            p.append(
                "needs --sequence-parallel (sequence_parallel=True): userbuffers overlap its all-gather / "
                "reduce-scatter"
            )
        if self.tp < 2:
            p.append(
                f"needs --tensor-model-parallel-size >= 2 (got {self.tp}): there is no TP communication to overlap"
            )
        if not self.transformer_engine or not te_available:
            p.append(
                "needs Transformer Engine (pip install transformer-engine[pytorch]) and "
                "--transformer-impl transformer_engine"
            )
        graphs = refusal(self.cuda_graphs, self.recompute)  # only what Megatron itself refuses
        if graphs:
            p.append(graphs)
        if self.fp16:
            p.append(
                "--fp16 with TP overlap: TE's userbuffers reduce-scatter adds in bf16 on Ampere and newer "
                "(transformer_engine/common/comm_gemm_overlap/userbuffers/userbuffers.cu), so fp16 overlap "
                "gives wrong sums; use --bf16"
            )
        return p

    def key(self, gpu: str, te_version: str, reference: str, space: str) -> TuningKey:
        """The reuse key: everything that changes the GEMM shapes, the communication or the search."""
        return TuningKey(
            gpu=gpu,
            te_version=te_version,
            tp=self.tp,
            cp=self.cp,
            tokens=self.init_tokens,
            hidden=self.hidden,
            ffn=self.ffn,
            heads=self.heads,
            kv_groups=self.kv_groups,
            kv_channels=self.kv_channels,
            gated_mlp=self.gated_mlp,
            dtype=f"{self.dtype}:{self.precision}" if self.precision else self.dtype,
            bf16_edge_layers=self.bf16_edge_layers,
            rs_dgrad=self.rs_dgrad,
            reference=reference,
            space=space,
            moe=self.moe,
        )

    def init_args(self) -> UbInitArgs:
        """The ``initialize_ub`` arguments Megatron uses (as ``_initialize_tp_communicators``); the ones captured
        from Megatron's own call win when there was one."""
        import torch
        from transformer_engine.pytorch.module.base import UserBufferQuantizationMode as Q

        from megatron_tp_overlap.engine.switcher import last_captured

        captured = last_captured()
        if captured is not None:
            return captured
        modes = [Q.FP8 if self.fp8 else Q.NONE] + ([Q.NONE] if self.fp8 and self.bf16_edge_layers else [])
        dtype = torch.bfloat16 if self.bf16 else torch.float16 if self.fp16 else torch.float32
        return UbInitArgs(
            shape=[self.init_tokens, self.hidden],
            tp_size=self.tp,
            quantization_modes=modes,
            dtype=dtype,
            bootstrap_backend=self.bootstrap_backend,
        )
