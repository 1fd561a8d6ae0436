"""Structured config of the main job (``-m megatron_tp_overlap.train``): dataclasses that are the OmegaConf
schema of ``conf/``, command-line override checks that name the valid keys, and the semantic checks that run
before any GPU work. The ``tp_overlap`` group extends :class:`~engine.options.TuneOptions`: its tuning keys
are the autotune options themselves."""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from megatron_tp_overlap.app.moe import moe_derived, moe_problems, plain
from megatron_tp_overlap.engine.options import TuneOptions
from megatron_tp_overlap.errors import did_you_mean

CONF_DIR = Path(__file__).with_name("conf")
OVERLAP_MODES = ("autotune", "te_default", "off", "preset", "file")
PRECISIONS = ("bf16", "fp8")


@dataclass
class ModelConfig:
    """A model's dimensions: from ``hf`` (a Hugging Face name or local config directory) and/or given here;
    a value given here wins over ``hf``'s."""

    name: Optional[str] = None
    hf: Optional[str] = None
    num_layers: Optional[int] = None
    hidden_size: Optional[int] = None
    ffn_hidden_size: Optional[int] = None
    num_attention_heads: Optional[int] = None
    num_query_groups: Optional[int] = None  # None: as many as heads (multi-head attention)
    kv_channels: Optional[int] = None  # head size; None: hidden / heads
    vocab_size: Optional[int] = None
    swiglu: Optional[bool] = None
    # Mixture of experts (app/moe.py checks them; unset: dense, or from model.hf). ffn_hidden_size: the dense layers'.
    num_experts: Optional[int] = None  # routed experts per MoE layer
    moe_ffn_hidden_size: Optional[int] = None  # one routed expert's FFN
    moe_router_topk: Optional[int] = None  # experts per token
    moe_shared_expert_intermediate_size: Optional[int] = None  # the shared experts' FFN; None: no shared expert
    moe_layer_freq: Any = None  # N (1 in N layers MoE, from the first) or a 0/1 per layer; None: every layer
    # Routing, not in a Hugging Face config (Megatron-LM's defaults but the dispatcher and grouped GEMM)
    moe_router_score_function: Optional[str] = None  # softmax | sigmoid | sqrtsoftplus; None: sigmoid with expert bias
    moe_router_enable_expert_bias: bool = False  # aux-loss-free load balancing (DeepSeek-V3)
    moe_router_load_balancing_type: str = "aux_loss"  # aux_loss | seq_aux_loss | global_aux_loss | sinkhorn | none
    moe_aux_loss_coeff: float = 0.0
    moe_grouped_gemm: bool = True
    moe_token_dispatcher_type: str = "alltoall"  # alltoall | allgather


MOE_KEYS = tuple(f.name for f in dataclasses.fields(ModelConfig) if f.name.startswith(("moe_", "num_experts")))


@dataclass
class ParallelConfig:
    tp: Optional[int] = None  # None: all local GPUs
    pp: int = 1
    ep: int = 1  # expert-model-parallel size (Megatron's expert TP size is parallel.tp)
    sequence_parallel: bool = True


@dataclass
class TrainingConfig:
    seq_length: int = 4096
    micro_batch_size: int = 1
    global_batch_size: int = 8
    train_iters: int = 480  # the in-run verification's longest (434 iterations) fits, with steady training after it
    precision: str = "bf16"  # one of PRECISIONS (fp8: hybrid format)
    lr: float = 1e-4
    seed: int = 1234


@dataclass
class TPOverlapConfig(TuneOptions):
    mode: str = "autotune"  # one of OVERLAP_MODES
    preset: Optional[str] = None  # a NeMo preset: the config with mode=preset, the starting point with autotune
    file: Optional[str] = None  # a --tp-comm-overlap-cfg YAML: likewise


@dataclass
class OutputConfig:
    root: str = "runs"
    name: Optional[str] = None  # default: a timestamp chosen by rank 0


@dataclass
class AppConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    tp_overlap: TPOverlapConfig = field(default_factory=TPOverlapConfig)
    output: OutputConfig = field(default_factory=OutputConfig)


def group_choices(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def _fields(cls: Any) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


GROUPS: dict[str, Any] = _fields(AppConfig)  # group name -> its dataclass


def with_model_group(overrides: list[str]) -> list[str]:
    """``model.hf=X`` alone means "this model": the ``hf`` model group (not the default model's dimensions with X's
    name), unless a model group was chosen too."""
    keys = [o.split("=", 1)[0].lstrip("+") for o in overrides if "=" in o]
    return ["model=hf", *overrides] if "model.hf" in keys and "model" not in keys else list(overrides)


def check_overrides(overrides: list[str]) -> list[str]:
    """Problems with Hydra command-line overrides, each naming the valid keys or choices."""
    problems = []
    for ov in overrides:
        if "=" not in ov or ov.startswith(("hydra.", "hydra/", "+hydra", "~")):
            continue
        key, value = ov.split("=", 1)
        parts = key.lstrip("+").split(".")
        if parts[0] not in GROUPS:
            problems.append(
                f"unknown key '{key}'{did_you_mean(parts[0], GROUPS)}: top-level keys are {', '.join(GROUPS)}"
            )
        elif len(parts) == 1:  # a group choice, e.g. model=llama3_8b
            choices = group_choices(parts[0])
            if value not in choices:
                problems.append(
                    f"unknown {parts[0]} '{value}'{did_you_mean(value, choices)}: choose one of {', '.join(choices)}"
                )
        else:
            problems += _key_problems(key, parts)
    return problems


_TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def field_type(key: str) -> str:
    """What ``key`` (``parallel.tp``) takes, in words: ``an integer (or null)``."""
    cls: Any = AppConfig
    for part in key.split("."):
        cls = _fields(cls).get(part) if dataclasses.is_dataclass(cls) else None
        if cls is None:
            return "a value of another type"
    args = [a for a in typing.get_args(cls) if a is not type(None)]
    base = args[0] if args else cls
    word = _TYPE_WORDS.get(base, getattr(base, "__name__", str(base)))
    return f"{word} (or null)" if args else word


def override_error(exc: BaseException) -> str:
    """One line for an error Hydra raised composing the overrides: for a value of the wrong type (OmegaConf's
    ValidationError) the key, the value and the type the key takes; else the first line of what Hydra said."""
    cause = exc.__cause__ or exc
    key = getattr(cause, "full_key", None)
    if key and hasattr(cause, "value"):
        return f"{key} = {cause.value!r}: must be {field_type(key)}"
    first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
    override = getattr(exc, "override", None)  # OverrideParseException: the override it could not parse
    return f"{override!r}: {first}" if override else first


def _key_problems(key: str, parts: list[str]) -> list[str]:
    cls = AppConfig
    for i, p in enumerate(parts):
        fields = _fields(cls)
        if p not in fields:
            where = ".".join(parts[:i]) or "the config"
            return [f"unknown key '{key}'{did_you_mean(p, fields)}: valid keys of {where} are {', '.join(fields)}"]
        cls = fields[p]
        if not dataclasses.is_dataclass(cls):
            return (
                [f"unknown key '{key}': '{'.'.join(parts[: i + 1])}' is a value, not a group"]
                if i != len(parts) - 1
                else []
            )
    return []


def model_provenance(m: Any) -> dict[str, Any]:
    """Where ``m``'s dimensions come from: the ``hf`` model and its source (hub revision, cache, shipped, local
    directory), every dimension, and the ones the config gives over the model's (e.g. fewer layers for a proxy run)."""
    given = {f.name: plain(getattr(m, f.name)) for f in dataclasses.fields(ModelConfig)}
    if m.hf is None:
        return {"hf": None, "source": "the config", "dims": given, "overridden": {}, "not_reproduced": []}
    from megatron_tp_overlap.models import load_model_dims

    d = load_model_dims(m.hf)
    derived = dict(
        name=m.hf,
        num_layers=d.layers,
        hidden_size=d.hidden,
        ffn_hidden_size=d.ffn,
        num_attention_heads=d.heads,
        num_query_groups=d.kv_heads,
        kv_channels=d.head_dim,
        vocab_size=d.vocab,
        swiglu=d.gated_mlp,
        **moe_derived(d, given["num_layers"]),
    )
    overridden = {
        k: {"given": v, "model": derived[k]}
        for k, v in given.items()
        if v is not None and k in derived and k != "name" and v != derived[k]
    }
    dims = {k: (v if v is not None else derived.get(k)) for k, v in given.items()}
    return {
        "hf": m.hf,
        "source": d.source,
        "dims": dims,
        "overridden": overridden,
        "not_reproduced": list(d.not_reproduced),
    }


def resolve_model(m: Any) -> ModelConfig:
    """``m`` with every dimension filled: the given values, the rest from ``m.hf``'s config (models.load_model_dims)."""
    return ModelConfig(**model_provenance(m)["dims"])


REQUIRED_DIMS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "vocab_size")


def validate(cfg: Any, world_size: int) -> list[str]:
    """Semantic problems of a resolved config (an AppConfig or an OmegaConf node of one), before any GPU work."""
    try:
        m = resolve_model(cfg.model)
    except ValueError as e:
        return [f"model.hf = {cfg.model.hf!r}: {str(e).removeprefix(f'model {cfg.model.hf!r}: ')}"]
    par, tr, ov = cfg.parallel, cfg.training, cfg.tp_overlap
    tp = par.tp if par.tp is not None else world_size
    p = [
        f"model.{k} = {getattr(m, k)!r}: must be an integer >= 1 (or set model.hf)"
        for k in REQUIRED_DIMS
        if not isinstance(getattr(m, k), int) or getattr(m, k) < 1
    ]
    for k in ("num_query_groups", "kv_channels"):
        if getattr(m, k) is not None and getattr(m, k) < 1:
            p.append(f"model.{k} = {getattr(m, k)}: must be >= 1 (or null)")
    for k in ("seq_length", "micro_batch_size", "global_batch_size", "train_iters"):
        if getattr(tr, k) < 1:
            p.append(f"training.{k} = {getattr(tr, k)}: must be >= 1")
    if not (math.isfinite(tr.lr) and tr.lr > 0):
        p.append(f"training.lr = {tr.lr}: must be a finite number > 0")
    if tp < 1 or par.pp < 1:
        return p + [f"parallel.tp = {tp}, parallel.pp = {par.pp}: must be >= 1"]
    if p:
        return p
    return (
        _layout_problems(m, par, tr, tp, world_size)
        + moe_problems(m, par, tr, tp, world_size)
        + _overlap_problems(ov, tr, par, tp)
        + _output_problems(cfg)
    )


def _layout_problems(m: ModelConfig, par: Any, tr: Any, tp: int, world_size: int) -> list[str]:
    p = []
    if world_size % (tp * par.pp):
        p.append(f"parallel.tp x parallel.pp = {tp * par.pp} must divide the number of processes ({world_size})")
    dp = max(world_size // (tp * par.pp), 1)
    kv = m.num_query_groups or m.num_attention_heads
    for name, value in (
        ("model.num_attention_heads", m.num_attention_heads),
        ("model.num_query_groups", kv),
        ("model.ffn_hidden_size", m.ffn_hidden_size),
    ):
        if value % tp:
            p.append(f"{name} = {value}: must be divisible by parallel.tp = {tp}")
    if m.kv_channels is None and m.hidden_size % m.num_attention_heads:
        p.append(
            f"model.hidden_size = {m.hidden_size}: must be divisible by model.num_attention_heads = "
            f"{m.num_attention_heads} (or set model.kv_channels)"
        )
    if m.num_attention_heads % kv:
        p.append(
            f"model.num_attention_heads = {m.num_attention_heads}: must be divisible by model.num_query_groups = {kv}"
        )
    if par.sequence_parallel and tr.seq_length % tp:
        p.append(f"training.seq_length = {tr.seq_length}: must be divisible by parallel.tp = {tp} (sequence parallel)")
    if m.num_layers % par.pp:
        p.append(f"model.num_layers = {m.num_layers}: must be divisible by parallel.pp = {par.pp}")
    if tr.global_batch_size % (tr.micro_batch_size * dp):
        p.append(
            f"training.global_batch_size = {tr.global_batch_size}: must be a multiple of micro_batch_size x "
            f"data-parallel size ({tr.micro_batch_size} x {dp})"
        )
    if tr.precision not in PRECISIONS:
        p.append(
            f"training.precision = {tr.precision!r}: must be one of {', '.join(PRECISIONS)}{did_you_mean(tr.precision, PRECISIONS)}"
        )
    return p


def _overlap_problems(ov: Any, tr: Any, par: Any, tp: int) -> list[str]:
    p = []
    if ov.mode not in OVERLAP_MODES:
        return [
            f"tp_overlap.mode = {ov.mode!r}: must be one of {', '.join(OVERLAP_MODES)}{did_you_mean(ov.mode, OVERLAP_MODES)}"
        ]
    if ov.mode == "off":
        return p
    if tp < 2:
        p.append(f"tp_overlap.mode = {ov.mode}: TP overlap needs parallel.tp >= 2 (got {tp}); use tp_overlap=off")
    if not par.sequence_parallel:
        p.append(f"tp_overlap.mode = {ov.mode}: userbuffers overlap needs parallel.sequence_parallel=true")
    if ov.mode == "preset" and ov.preset is None:
        p.append("tp_overlap.preset: required with tp_overlap=preset (a name from `megatron-tp-overlap preset`)")
    if ov.mode == "file" and not ov.file:
        p.append("tp_overlap.file: required with tp_overlap=file (a --tp-comm-overlap-cfg YAML)")
    if ov.preset is not None and ov.file:
        p.append("tp_overlap.preset and tp_overlap.file: give one (the config to use, or to start tuning from)")
    if ov.preset is not None:
        from megatron_tp_overlap.ub.presets import PRESETS

        if ov.preset not in PRESETS:
            p.append(
                f"tp_overlap.preset = {ov.preset!r}: unknown{did_you_mean(ov.preset, PRESETS)}; valid: "
                f"{', '.join(PRESETS)}"
            )
    if ov.file:
        from megatron_tp_overlap.errors import ConfigError
        from megatron_tp_overlap.ub.rules import ValidationContext, load_and_validate

        try:
            ctx = ValidationContext(
                fp8=tr.precision == "fp8", tp_size=max(tp, 2), tokens=tr.seq_length * tr.micro_batch_size
            )
            load_and_validate(ov.file, ctx)
        except ConfigError as e:
            p.append(f"tp_overlap.file: {e}")
    if ov.mode == "autotune":
        p += TuneOptions(**{f.name: getattr(ov, f.name) for f in dataclasses.fields(TuneOptions)}).problems(
            lambda k: f"tp_overlap.{k}"
        )
    return p


def _output_problems(cfg: Any) -> list[str]:
    from megatron_tp_overlap.atomic import unwritable

    p = []
    for key, folder in (("output.root", cfg.output.root), ("tp_overlap.cache_dir", cfg.tp_overlap.cache_dir)):
        why = unwritable(folder) if folder else None
        if why:
            p.append(f"{key} = {folder!r}: cannot write there ({why})")
    if cfg.tp_overlap.output:
        from megatron_tp_overlap.integrations.megatron.flags import output_problems

        p += output_problems(Path(cfg.tp_overlap.output), "tp_overlap.output")
    return p


def register() -> None:
    """Make ``AppConfig`` the schema of ``conf/config.yaml`` (typos in YAML or overrides are errors)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="app_schema", node=AppConfig)
    for group, cls in GROUPS.items():
        cs.store(group=group, name=f"{group}_schema", node=cls)
