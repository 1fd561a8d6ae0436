"""What a Hugging Face config describes beyond a dense GPT: mixture-of-experts structure, mapped to Megatron-LM's
MoE settings, and the features this package's GPT does not build.

Mapped (transformers 5 attribute names): Mixtral, Qwen2-MoE, Qwen3-MoE, GPT-OSS, Llama-4 (its ``text_config``).
Refused in one line, never built as a dense stand-in: multi-latent attention, multi-token prediction, layers that
are not attention (linear attention, Mamba, convolution), and any other MoE structure. Features that leave the
tensor-parallel GEMM shapes as they are (sliding windows, attention sinks, qk-norm, biases) are built without
and named in :attr:`ModelDims.not_reproduced`.
"""

from __future__ import annotations

from typing import Any, Union

LayerFreq = Union[int, tuple[int, ...]]  # Megatron's --moe-layer-freq: 1 in N layers MoE, or a 0/1 per layer

MOE_TYPES = {
    "mixtral": "Mixtral",
    "qwen2_moe": "Qwen2-MoE",
    "qwen3_moe": "Qwen3-MoE",
    "gpt_oss": "GPT-OSS",
    "llama4": "Llama-4",
    "llama4_text": "Llama-4",
}
# Any of these set on a config of another model type: experts this package does not know how to map.
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts", "moe_intermediate_size")
ATTENTION_LAYERS = ("full_attention", "sliding_attention", "chunked_attention")


def text_config(cfg: Any) -> Any:
    """The decoder's config (a multimodal config's ``text_config``; the config itself otherwise)."""
    get = getattr(cfg, "get_text_config", None)
    return get() if callable(get) else cfg


def layer_freq(pattern: list[int]) -> LayerFreq:
    """``pattern`` (1: MoE layer) as Megatron's --moe-layer-freq: the int N when it is Megatron's "layer i is MoE iff
    i % N == 0", the per-layer tuple otherwise."""
    for n in range(1, len(pattern) + 1):
        if pattern == [int(i % n == 0) for i in range(len(pattern))]:
            return n
    return tuple(pattern)


def moe_pattern(freq: LayerFreq, layers: int) -> list[int]:
    """1 per MoE layer, 0 per dense layer, as Megatron builds them (``freq`` a tuple: as given)."""
    return list(freq) if isinstance(freq, (tuple, list)) else [int(i % freq == 0) for i in range(layers)]


def _refuse(t: Any, what: list[str]) -> ValueError:
    return ValueError(
        f"model type {t.model_type!r}: {'; '.join(what)}: not supported by this package's GPT (no dense stand-in "
        "is built)"
    )


def _unsupported(t: Any) -> list[str]:
    what = []
    q, kv = getattr(t, "q_lora_rank", None), getattr(t, "kv_lora_rank", None)
    if q or kv:
        what.append(f"multi-latent attention (q_lora_rank={q}, kv_lora_rank={kv})")
    for k in ("num_nextn_predict_layers", "mtp_num_layers", "num_mtp_layers"):
        if getattr(t, k, None):
            what.append(f"multi-token prediction ({k}={getattr(t, k)})")
    other = sorted({x for x in getattr(t, "layer_types", None) or () if x not in ATTENTION_LAYERS})
    if other:
        what.append(f"layers that are not attention (layer_types: {', '.join(map(str, other))})")
    if t.model_type not in MOE_TYPES:
        experts = {k: getattr(t, k) for k in EXPERT_KEYS if getattr(t, k, None)}
        if experts or getattr(t, "ffn_config", None) is not None:
            given = ", ".join(f"{k}={v}" for k, v in experts.items()) or "ffn_config"
            what.append(
                f"a mixture-of-experts structure this package does not map ({given}; mapped: "
                f"{', '.join(sorted(set(MOE_TYPES.values())))})"
            )
    return what


def _common_not_reproduced(t: Any) -> list[str]:
    out = []
    if getattr(t, "sliding_window", None) and getattr(t, "use_sliding_window", True):
        layers = getattr(t, "layer_types", None) or ()
        where = " on alternate layers" if "full_attention" in layers else ""
        out.append(f"sliding-window attention (window {t.sliding_window}){where}")
    if t.model_type in ("qwen3", "qwen3_moe"):
        out.append("qk-norm")
    if getattr(t, "attention_bias", False) or getattr(t, "qkv_bias", False):
        out.append("attention biases")
    return out


def moe_fields(cfg: Any) -> tuple[Any, dict[str, Any]]:
    """The decoder config of ``cfg`` and the ModelDims fields it gives beyond the dense ones: ``ffn`` (the dense
    layers' FFN, Megatron's --ffn-hidden-size), the MoE fields (none for a dense model) and ``not_reproduced``.
    Raises ValueError (one line) for what this package cannot build."""
    t = text_config(cfg)
    bad = _unsupported(t)
    if bad:
        raise _refuse(t, bad)
    nr = _common_not_reproduced(t)
    out: dict[str, Any] = {"ffn": getattr(t, "intermediate_size", None)}
    kind = t.model_type
    if kind not in MOE_TYPES:
        return t, {**out, "not_reproduced": tuple(nr)}
    layers = t.num_hidden_layers
    shared = None
    if kind == "mixtral":
        experts, moe_ffn, pattern = t.num_local_experts, t.intermediate_size, [1] * layers
    elif kind in ("qwen2_moe", "qwen3_moe"):
        experts, moe_ffn = t.num_experts, t.moe_intermediate_size
        skip = set(t.mlp_only_layers or ())
        pattern = [int(i not in skip and (i + 1) % t.decoder_sparse_step == 0) for i in range(layers)]
        if kind == "qwen2_moe":
            shared = t.shared_expert_intermediate_size or None
            nr.append("shared-expert sigmoid gate")
    elif kind == "gpt_oss":
        experts, moe_ffn, pattern = t.num_local_experts, t.intermediate_size, [1] * layers
        nr += ["attention sinks", "expert and router biases", f"clamped SwiGLU (limit {t.swiglu_limit})"]
    else:  # Llama-4: every MoE layer has one shared expert as wide as a routed one; dense layers are wider
        experts, moe_ffn, shared = t.num_local_experts, t.intermediate_size, t.intermediate_size
        out["ffn"] = t.intermediate_size_mlp
        moe = set(t.moe_layers)
        pattern = [int(i in moe) for i in range(layers)]
        if getattr(t, "use_qk_norm", False):
            nr.append("qk L2-norm")
        if getattr(t, "attention_chunk_size", None):
            nr.append(f"chunked attention ({t.attention_chunk_size}) and NoPE layers")
        nr.append("sigmoid routing with scores applied to the expert input")
    topk = getattr(t, "num_experts_per_tok", None) or getattr(t, "experts_per_token", None)
    if not experts or not any(pattern):  # no MoE layer: the dense model is the model
        return t, {**out, "not_reproduced": tuple(nr)}
    return t, {
        **out,
        "num_experts": experts,
        "moe_topk": topk,
        "moe_ffn": moe_ffn,
        "shared_expert_ffn": shared,
        "moe_layer_freq": layer_freq(pattern),
        "not_reproduced": tuple(nr),
    }


def dense_only(d: Any, tool: str) -> None:
    """One ValueError line when ``d`` (models.ModelDims) is an MoE model: ``tool`` times stacks of dense
    ``te.TransformerLayer``\\ s, which would leave out the routed experts."""
    if d.is_moe:
        raise ValueError(
            f"{tool} --model {d.name}: a mixture-of-experts model ({d.num_experts} experts, top-{d.moe_topk}) is "
            "not timed as dense layers: its routed experts (no userbuffers overlap, most of an MoE layer's time) "
            f"would be missing and the TP ranking wrong; tune it in its run (python -m megatron_tp_overlap.train "
            f"model.hf={d.name}, or --tp-comm-overlap-autotune in Megatron-LM)"
        )
