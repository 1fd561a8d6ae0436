"""Structured config of the main job (``-m megatron_tp_overlap.train``): dataclasses that are the
OmegaConf schema of ``conf/``, command-line override checks that name the valid keys, and the
semantic checks that run before any GPU work."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

CONF_DIR = Path(__file__).with_name("conf")
OVERLAP_MODES = ("autotune", "te_default", "off", "preset", "file")


@dataclass
class ModelConfig:
    name: str = "gpt_small"
    num_layers: int = 4
    hidden_size: int = 2048
    ffn_hidden_size: int = 8192
    num_attention_heads: int = 16
    num_query_groups: Optional[int] = None  # None: multi-head attention (no GQA)
    vocab_size: int = 32000
    swiglu: bool = True


@dataclass
class ParallelConfig:
    tp: Optional[int] = None  # None: all local GPUs
    pp: int = 1
    sequence_parallel: bool = True


@dataclass
class TrainingConfig:
    seq_length: int = 4096
    micro_batch_size: int = 1
    global_batch_size: int = 8
    train_iters: int = 60
    precision: str = "bf16"  # bf16 | fp8
    lr: float = 1e-4
    seed: int = 1234


@dataclass
class TPOverlapConfig:
    mode: str = "autotune"  # autotune | te_default | off | preset | file
    preset: Optional[str] = None  # mode=preset: a NeMo preset name
    file: Optional[str] = None  # mode=file: a --tp-comm-overlap-cfg YAML
    budget_s: float = 60.0
    budget_steps: int = 400
    strategy: str = "coordinate"
    force: bool = False  # re-tune even when the cache has this shape
    allow_off: bool = False
    cache_dir: Optional[str] = None  # default: ~/.cache/megatron_tp_overlap


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
    import typing
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


GROUPS: dict[str, Any] = _fields(AppConfig)  # group name -> its dataclass


def check_overrides(overrides: list[str]) -> list[str]:
    """Problems with Hydra command-line overrides, each naming the valid keys or choices."""
    problems = []
    for ov in overrides:
        if "=" not in ov or ov.startswith(("hydra.", "hydra/", "+hydra", "~")):
            continue
        key, value = ov.split("=", 1)
        key = key.lstrip("+")
        parts = key.split(".")
        if parts[0] not in GROUPS:
            problems.append(f"unknown key '{key}': top-level keys are {', '.join(GROUPS)}")
            continue
        if len(parts) == 1:  # a group choice, e.g. model=llama3_8b
            choices = group_choices(parts[0])
            if value not in choices:
                problems.append(f"unknown {parts[0]} '{value}': choose one of {', '.join(choices)}")
            continue
        cls = AppConfig
        for i, p in enumerate(parts):
            fields = _fields(cls)
            if p not in fields:
                where = ".".join(parts[:i]) or "the config"
                problems.append(f"unknown key '{key}': valid keys of {where} are {', '.join(fields)}")
                break
            cls = fields[p]
            if not dataclasses.is_dataclass(cls):
                if i != len(parts) - 1:
                    problems.append(f"unknown key '{key}': '{'.'.join(parts[:i + 1])}' is a value, not a group")
                break
    return problems


def validate(cfg: Any, world_size: int) -> list[str]:
    """Semantic problems of a resolved config (an AppConfig or an OmegaConf node of one)."""
    m, par, tr, ov = cfg.model, cfg.parallel, cfg.training, cfg.tp_overlap
    p: list[str] = []
    tp = par.tp if par.tp is not None else world_size
    if tp < 1 or par.pp < 1:
        p.append(f"parallel.tp = {tp}, parallel.pp = {par.pp}: must be >= 1")
        return p
    if world_size % (tp * par.pp):
        p.append(f"parallel.tp x parallel.pp = {tp * par.pp} must divide the number of processes ({world_size})")
    dp = max(world_size // (tp * par.pp), 1)
    if ov.mode not in OVERLAP_MODES:
        p.append(f"tp_overlap.mode = {ov.mode!r}: must be one of {', '.join(OVERLAP_MODES)}")
    if ov.mode != "off":
        if tp < 2:
            p.append(f"tp_overlap.mode = {ov.mode}: TP overlap needs parallel.tp >= 2 (got {tp}); use tp_overlap=off")
        if not par.sequence_parallel:
            p.append(f"tp_overlap.mode = {ov.mode}: userbuffers overlap needs parallel.sequence_parallel=true")
    if ov.mode == "preset":
        from .presets import PRESETS
        if ov.preset not in PRESETS:
            p.append(f"tp_overlap.preset = {ov.preset!r}: unknown; valid: {', '.join(PRESETS)}")
    if ov.mode == "file":
        from .errors import ConfigError
        from .validation import ValidationContext, load_and_validate
        if not ov.file:
            p.append("tp_overlap.file: required with tp_overlap=file (a --tp-comm-overlap-cfg YAML)")
        else:
            try:
                load_and_validate(ov.file, ValidationContext(fp8=tr.precision == "fp8", tp_size=max(tp, 2)))
            except ConfigError as e:
                p.append(f"tp_overlap.file: {e}")
    if ov.budget_s <= 0 or ov.budget_steps < 1:
        p.append(f"tp_overlap.budget_s = {ov.budget_s}, budget_steps = {ov.budget_steps}: must be > 0 and >= 1")
    from .search import STRATEGIES
    if ov.strategy not in STRATEGIES:
        p.append(f"tp_overlap.strategy = {ov.strategy!r}: must be one of {', '.join(STRATEGIES)}")
    if tr.precision not in ("bf16", "fp8"):
        p.append(f"training.precision = {tr.precision!r}: must be bf16 or fp8")
    kv = m.num_query_groups or m.num_attention_heads
    for name, value in (("model.num_attention_heads", m.num_attention_heads), ("model.num_query_groups", kv),
                        ("model.ffn_hidden_size", m.ffn_hidden_size)):
        if value % tp:
            p.append(f"{name} = {value}: must be divisible by parallel.tp = {tp}")
    if m.hidden_size % m.num_attention_heads:
        p.append(f"model.hidden_size = {m.hidden_size}: must be divisible by model.num_attention_heads = {m.num_attention_heads}")
    if m.num_attention_heads % kv:
        p.append(f"model.num_attention_heads = {m.num_attention_heads}: must be divisible by model.num_query_groups = {kv}")
    if par.sequence_parallel and tr.seq_length % tp:
        p.append(f"training.seq_length = {tr.seq_length}: must be divisible by parallel.tp = {tp} (sequence parallel)")
    if m.num_layers % par.pp:
        p.append(f"model.num_layers = {m.num_layers}: must be divisible by parallel.pp = {par.pp}")
    if tr.global_batch_size % (tr.micro_batch_size * dp):
        p.append(f"training.global_batch_size = {tr.global_batch_size}: must be a multiple of micro_batch_size x data-parallel size "
                 f"({tr.micro_batch_size} x {dp})")
    if tr.train_iters < 1:
        p.append(f"training.train_iters = {tr.train_iters}: must be >= 1")
    from .atomic import unwritable
    for key, folder in (("output.root", cfg.output.root), ("tp_overlap.cache_dir", ov.cache_dir)):
        why = unwritable(folder) if folder else None
        if why:
            p.append(f"{key} = {folder!r}: cannot write there ({why})")
    return p


def register() -> None:
    """Make ``AppConfig`` the schema of ``conf/config.yaml`` (typos in YAML or overrides are errors)."""
    from hydra.core.config_store import ConfigStore
    cs = ConfigStore.instance()
    cs.store(name="app_schema", node=AppConfig)
    for group, cls in GROUPS.items():
        cs.store(group=group, name=f"{group}_schema", node=cls)
