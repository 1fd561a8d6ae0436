"""The main job's mixture-of-experts keys: what ``model.hf`` gives (models.ModelDims), and the checks that run before
any GPU work, after Megatron-LM core_v0.19.0's own (arguments.py ``validate_args``, TransformerConfig, parallel_state,
MoELayer): each problem one line naming the key and the rule."""

from __future__ import annotations

import math
from typing import Any

from megatron_tp_overlap.model_features import layer_freq

SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")
BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
DISPATCHERS = ("alltoall", "allgather")  # flex needs DeepEP / HybridEP, which the main job does not set up
STRUCTURE = ("moe_ffn_hidden_size", "moe_router_topk", "moe_shared_expert_intermediate_size", "moe_layer_freq")


def plain(v: Any) -> Any:
    """An OmegaConf list as a Python list (a per-layer ``moe_layer_freq``); anything else as it is."""
    return [plain(x) for x in v] if hasattr(v, "__iter__") and not isinstance(v, (str, dict)) else v


def moe_derived(d: Any, num_layers: int | None) -> dict[str, Any]:
    """The MoE keys of ``d`` (models.ModelDims); a per-layer pattern cut to the first ``num_layers`` layers when the
    config asks for fewer (a proxy run builds the model's first layers)."""
    if not d.is_moe:
        return {}
    freq = d.moe_layer_freq
    if isinstance(freq, tuple) and num_layers is not None and num_layers < len(freq):
        freq = layer_freq(list(freq[:num_layers]))
    return dict(
        num_experts=d.num_experts,
        moe_ffn_hidden_size=d.moe_ffn,
        moe_router_topk=d.moe_topk,
        moe_shared_expert_intermediate_size=d.shared_expert_ffn,
        moe_layer_freq=list(freq) if isinstance(freq, tuple) else freq,
    )


def score_function(m: Any) -> str:
    """The router's score function: as given, else sigmoid with expert bias (Megatron allows no other), else softmax."""
    return m.moe_router_score_function or ("sigmoid" if m.moe_router_enable_expert_bias else "softmax")


def _freq_problem(freq: Any, layers: int) -> str | None:
    if isinstance(freq, bool) or not isinstance(freq, (int, list)):
        return "must be an integer N >= 1 (layers 0, N, 2N, ... are MoE) or a list of 0/1, one per layer"
    if isinstance(freq, int):
        return None if freq >= 1 else "must be >= 1"
    if len(freq) != layers or any(x not in (0, 1) for x in freq):
        return f"a per-layer pattern must have one 0 (dense) or 1 (MoE) per layer: model.num_layers = {layers}"
    return None if any(freq) else "names no MoE layer (set model.num_experts=null for a dense model)"


def moe_problems(m: Any, par: Any, tr: Any, tp: int, world_size: int) -> list[str]:
    """Problems of the MoE keys of a resolved ModelConfig ``m`` with ``parallel`` / ``training`` groups."""
    ep = par.ep
    if not m.num_experts:
        given = [f"model.{k} = {getattr(m, k)!r}" for k in STRUCTURE if getattr(m, k) is not None]
        given += ["model.moe_router_enable_expert_bias = true"] if m.moe_router_enable_expert_bias else []
        given += [f"parallel.ep = {ep}"] if ep != 1 else []
        p = [f"{g}: needs model.num_experts (a mixture-of-experts model)" for g in given]
        if m.num_experts is not None:  # 0 or negative
            p.append(f"model.num_experts = {m.num_experts}: must be >= 1 (or null: a dense model)")
        return p
    p = []
    e, k = m.num_experts, m.moe_router_topk
    if k is None:
        p.append("model.moe_router_topk: required with model.num_experts (experts per token)")
    elif not 1 <= k <= e:
        p.append(f"model.moe_router_topk = {k}: must be between 1 and model.num_experts = {e}")
    for key in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
        v = getattr(m, key)
        if v is not None and (v < 1 or v % tp):
            p.append(f"model.{key} = {v}: must be >= 1 and divisible by parallel.tp = {tp} (expert TP is parallel.tp)")
    why = _freq_problem(m.moe_layer_freq if m.moe_layer_freq is not None else 1, m.num_layers)
    if why:
        p.append(f"model.moe_layer_freq = {m.moe_layer_freq!r}: {why}")
    if ep < 1:
        p.append(f"parallel.ep = {ep}: must be >= 1")
    else:
        if e % ep:
            p.append(f"parallel.ep = {ep}: must divide model.num_experts = {e}")
        if world_size % (tp * ep * par.pp):
            p.append(
                f"parallel.ep = {ep}: parallel.tp x parallel.ep x parallel.pp = {tp * ep * par.pp} must divide the "
                f"number of processes ({world_size}) (Megatron's expert grid: expert TP = parallel.tp, so "
                "parallel.ep must divide the data-parallel size)"
            )
    if tp > 1 and not par.sequence_parallel:
        p.append(
            "parallel.sequence_parallel = false: an MoE model with parallel.tp > 1 needs sequence parallelism "
            "(Megatron's MoELayer refuses to train without it)"
        )
    score = score_function(m)
    if score not in SCORE_FUNCTIONS:
        p.append(f"model.moe_router_score_function = {score!r}: must be one of {', '.join(SCORE_FUNCTIONS)}")
    elif m.moe_router_enable_expert_bias and score == "softmax":
        p.append(
            "model.moe_router_enable_expert_bias = true: expert bias (aux-loss-free balancing) needs "
            "model.moe_router_score_function = sigmoid or sqrtsoftplus (got softmax)"
        )
    if m.moe_router_load_balancing_type not in BALANCING:
        p.append(
            f"model.moe_router_load_balancing_type = {m.moe_router_load_balancing_type!r}: must be one of "
            f"{', '.join(BALANCING)}"
        )
    if not (math.isfinite(m.moe_aux_loss_coeff) and m.moe_aux_loss_coeff >= 0):
        p.append(f"model.moe_aux_loss_coeff = {m.moe_aux_loss_coeff}: must be a finite number >= 0")
    if m.moe_token_dispatcher_type not in DISPATCHERS:
        p.append(
            f"model.moe_token_dispatcher_type = {m.moe_token_dispatcher_type!r}: must be one of "
            f"{', '.join(DISPATCHERS)}"
        )
    elif tr.precision == "fp8" and m.moe_token_dispatcher_type == "allgather":
        p.append(
            "model.moe_token_dispatcher_type = 'allgather': FP8 expert GEMMs need expert inputs padded "
            "(--moe-router-padding-for-quantization), which Megatron does only with alltoall"
        )
    return p
