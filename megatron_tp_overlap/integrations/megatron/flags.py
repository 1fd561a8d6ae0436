"""Megatron-LM's command line: the ``--tp-comm-overlap-autotune*`` flags (generated from
:class:`~engine.options.TuneOptions`), the checks of a flag combination before any GPU work, and the flags
that reproduce a tuned config (the recipe). Pure: CPU-testable without Megatron."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from megatron_tp_overlap.atomic import unwritable
from megatron_tp_overlap.engine.options import PREFIX, TUNED_YAML_NAME, TuneOptions, option_fields
from megatron_tp_overlap.errors import ConfigError
from megatron_tp_overlap.integrations.megatron.run_shape import RunShape
from megatron_tp_overlap.ub.config import UbConfig
from megatron_tp_overlap.ub.layer_cfg import LayerCfgClasses, to_layer_cfg

FLAG = "--" + PREFIX.replace("_", "-")


def flag_name(option: str) -> str:
    """``seconds`` -> ``--tp-comm-overlap-autotune-seconds``."""
    return f"{FLAG}-{option.replace('_', '-')}"


_TYPES = {"float": float, "int": int, "str": str, "Optional[str]": str}


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron ``extra_args_provider``: the switch and one flag per :class:`TuneOptions` field."""
    g = parser.add_argument_group("tp-comm-overlap autotune (megatron-tp-overlap)")
    g.add_argument(
        FLAG,
        action="store_true",
        help="Tune the userbuffers config (ub_cfgs) on the real model before the "
        "first iteration, apply it, and write it as a --tp-comm-overlap-cfg YAML.",
    )
    for f in option_fields():
        kw: dict[str, Any] = {"default": f.default, "help": f.metadata["help"], "dest": f"{PREFIX}_{f.name}"}
        if f.type == "bool":
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = _TYPES[f.type]
            if "choices" in f.metadata:
                kw["choices"] = f.metadata["choices"]
        g.add_argument(flag_name(f.name), **kw)
    return parser


def options_from_args(args: argparse.Namespace) -> TuneOptions:
    return TuneOptions(**{f.name: getattr(args, f"{PREFIX}_{f.name}", f.default) for f in option_fields()})


def reference_from_args(args: argparse.Namespace) -> UbConfig:
    """The config the run would use without tuning: ``--tp-comm-overlap-cfg``, else TE's defaults."""
    from megatron_tp_overlap.ub.config import load_yaml

    cfg = getattr(args, "tp_comm_overlap_cfg", None)
    return load_yaml(cfg) if cfg else UbConfig()


def default_output(explicit: Optional[str], reference_yaml: Optional[str], save_dir: Optional[str]) -> Path:
    """Where the tuned YAML goes: the explicit path, else next to the starting YAML, else in the checkpoint
    folder, else the working directory."""
    if explicit:
        return Path(explicit)
    if reference_yaml:
        return Path(reference_yaml).with_name(Path(reference_yaml).stem + ".tuned.yaml")
    return Path(save_dir or ".") / TUNED_YAML_NAME


def output_problems(out: Path, name: str) -> list[str]:
    """Problems writing the tuned YAML and its report at ``out`` (checked before any GPU work)."""
    if out.is_dir():
        return [f"{name} = {str(out)!r}: is a directory; give a file path (e.g. {out / TUNED_YAML_NAME})"]
    why = unwritable(out.parent)
    return [f"{name} = {str(out)!r}: cannot write the tuned YAML there ({why})"] if why else []


def output_path(args: argparse.Namespace) -> Path:
    return default_output(
        getattr(args, f"{PREFIX}_output", None), getattr(args, "tp_comm_overlap_cfg", None), getattr(args, "save", None)
    )


def check_arguments(args: argparse.Namespace, te_available: bool = True) -> list[str]:
    """Problems with a Megatron-LM flag combination (empty when fine), before any GPU work."""
    if not getattr(args, PREFIX, False):
        return []
    run = RunShape.from_args(args)
    p = [f"{FLAG}: {x}" for x in run.problems(te_available)]
    p += options_from_args(args).problems(flag_name)
    cfg = getattr(args, "tp_comm_overlap_cfg", None)
    if cfg:
        from megatron_tp_overlap.ub.rules import ValidationContext, load_and_validate

        try:
            load_and_validate(
                cfg,
                ValidationContext(fp8=bool(run.fp8), tp_size=max(run.tp, 2), tokens=run.init_tokens),
            )
        except ConfigError as e:
            p.append(f"--tp-comm-overlap-cfg: {e}")
    return p + output_problems(output_path(args), flag_name("output"))


def flags_for(ub: UbConfig, yaml_path: str | Path) -> tuple[list[str], str | None]:
    """Megatron-LM flags that reproduce ``ub`` (written at ``yaml_path``), and why they cannot (or None).

    Megatron builds every qkv/fc1 layer with bulk dgrad overlap, or with GEMM + reduce-scatter dgrad under
    ``--tp-comm-overlap-rs-dgrad``: one mode for both, which the YAML alone cannot switch.
    """
    flags = ["--tp-comm-overlap", "--tp-comm-overlap-cfg", str(yaml_path)]
    rs = {g: ub.dgrad_is_reduce_scatter(g) for g in ("qkv_dgrad", "fc1_dgrad")}
    if all(rs.values()):
        flags.append("--tp-comm-overlap-rs-dgrad")
    elif any(rs.values()):
        mixed = ", ".join(f"{g} {'reduce-scatter' if v else 'bulk'}" for g, v in rs.items())
        return flags, (
            f"{mixed}: Megatron-LM runs qkv and fc1 dgrad in one mode (--tp-comm-overlap-rs-dgrad or not); "
            "this config needs both modes"
        )
    return flags, None


@dataclass(frozen=True)
class KindSwitch:
    """A whole kind of TP overlap that megatron-core switches off in every layer (``TransformerConfig`` field, also a
    Megatron-Bridge model-config field), and the Megatron-LM flag that does it."""

    field: str
    flag: str
    gemms: frozenset[str]


KIND_SWITCHES: dict[str, KindSwitch] = {  # megatron-core 0.19 (extensions/transformer_engine.py; TE Linear flags)
    "AG overlap": KindSwitch(
        "tp_comm_overlap_ag",
        "--no-tp-comm-overlap-ag",
        frozenset({"qkv_fprop", "fc1_fprop", "proj_dgrad", "proj_wgrad", "fc2_dgrad", "fc2_wgrad"}),
    ),
    "RS overlap": KindSwitch("tp_comm_overlap_rs", "--no-tp-comm-overlap-rs", frozenset({"proj_fprop", "fc2_fprop"})),
    "bulk dgrad": KindSwitch("tp_comm_bulk_dgrad", "--no-tp-comm-bulk-dgrad", frozenset({"qkv_dgrad", "fc1_dgrad"})),
    "bulk wgrad": KindSwitch("tp_comm_bulk_wgrad", "--no-tp-comm-bulk-wgrad", frozenset({"qkv_wgrad", "fc1_wgrad"})),
}


def switch_sets(rs_dgrad: bool) -> dict[str, frozenset[str]]:
    """The GEMM sets a Megatron-LM run can switch off as a whole (for the search). Under
    ``--tp-comm-overlap-rs-dgrad`` the bulk flags do not reach qkv/fc1 dgrad (it is a reduce-scatter then)."""
    return {n: k.gemms for n, k in KIND_SWITCHES.items() if not (rs_dgrad and n == "bulk dgrad")}


# NeMo's callback owns these two (its ``setup`` sets them on the model config from its own arguments)
NEMO_CALLBACK_FIELDS = ("tp_comm_overlap", "tp_comm_overlap_cfg")


@dataclass
class Recipe:
    """What reproduces a tuned config in a fresh run: the YAML, the flags to add and to drop, the
    ``TransformerConfig`` / Megatron-Bridge fields, NeMo's, and why it cannot be reproduced (or None)."""

    yaml: str
    add: list[str]
    drop: list[str]
    fields: dict[str, Any]
    problem: Optional[str] = None
    tp: int = 0  # the tensor-parallel size: NeMo's dataclass spells out TE's defaults for it
    nemo_problem: Optional[str] = None  # why NeMo's TransformerLayerTPOverlapCfg cannot hold the YAML

    def line(self) -> str:
        """One line to paste."""
        parts = [" ".join(self.add)] if self.add else []
        if self.drop:
            parts.append(f"and drop {' '.join(self.drop)}")
        return " ".join(parts) if parts else "nothing to change"

    def nemo_callback(self) -> dict[str, str]:
        """NeMo 2: ``MegatronCommOverlapCallback`` keyword arguments, as Python source (NeMo takes the config as a
        ``TransformerLayerTPOverlapCfg``, which :func:`~ub.layer_cfg.load_layer_cfg` reads from the YAML)."""
        if not self.fields.get("tp_comm_overlap", False):
            return {"tp_comm_overlap": "False"}
        return {"tp_comm_overlap": "True", "tp_comm_overlap_cfg": f"load_layer_cfg({self.yaml!r}, tp_size={self.tp})"}

    def nemo_model_fields(self) -> dict[str, Any]:
        """NeMo 2: the model config fields (the callback does not set them)."""
        return {k: v for k, v in self.fields.items() if k not in NEMO_CALLBACK_FIELDS}

    def nemo_line(self) -> str:
        kwargs = ", ".join(f"{k}={v}" for k, v in self.nemo_callback().items())
        model = ", ".join(f"{k}={v!r}" for k, v in self.nemo_model_fields().items())
        return f"MegatronCommOverlapCallback({kwargs})" + (f"; model config: {model}" if model else "")

    def to_dict(self) -> dict[str, Any]:
        return {
            "yaml": self.yaml,
            "add_flags": self.add,
            "drop_flags": self.drop,
            "transformer_config": self.fields,
            "line": self.line(),
            "problem": self.problem,
            "nemo": {
                "callback": self.nemo_callback(),
                "model_config": self.nemo_model_fields(),
                "line": self.nemo_line(),
                "problem": self.nemo_problem,
            },
        }


def recipe(ub: UbConfig, disabled: frozenset[str], active: frozenset[str], yaml_path: str | Path, *, tp: int) -> Recipe:
    """The recipe of ``ub`` with the GEMMs in ``disabled`` switched off, in a run of tensor-parallel size ``tp``
    that overlaps ``active``."""
    off = disabled & active
    if active and off == active:  # no overlap at all: the run needs no userbuffers
        return Recipe("", [], ["--tp-comm-overlap", "--tp-comm-overlap-cfg"], {"tp_comm_overlap": False}, tp=tp)
    add, problem = flags_for(ub, yaml_path)
    fields: dict[str, Any] = {"tp_comm_overlap": True, "tp_comm_overlap_cfg": str(yaml_path)}
    if "--tp-comm-overlap-rs-dgrad" in add:
        fields["tp_comm_overlap_rs_dgrad"] = True
    covered: set[str] = set()
    for k in KIND_SWITCHES.values():
        if k.gemms & active and k.gemms & active <= off:
            add.append(k.flag)
            fields[k.field] = False
            covered |= k.gemms & active
    if off - covered:
        why = f"overlap off for {', '.join(sorted(off - covered))} alone: no Megatron flag or YAML key says that"
        problem = f"{problem}; {why}" if problem else why
    return Recipe(str(yaml_path), add, [], fields, problem, tp, _layer_cfg_problem(ub, tp))


def _layer_cfg_problem(ub: UbConfig, tp: int) -> Optional[str]:
    try:
        to_layer_cfg(ub, tp, LayerCfgClasses())  # the mirror classes: same fields as NeMo's
    except ConfigError as e:
        return "; ".join(str(x) for x in e.problems)
    return None


def follow_fields(*configs: Any) -> Callable[[Recipe], None]:
    """Keeps ``TransformerConfig``-like ``configs`` saying what a recipe says: ``tp_comm_overlap``, the dgrad mode
    and the kind switches (each back to the value it started with where the recipe does not set it), so that a
    config saved with a checkpoint reproduces the tuned run. Call the result with every new recipe."""
    names = ["tp_comm_overlap", "tp_comm_overlap_rs_dgrad", *(k.field for k in KIND_SWITCHES.values())]
    started = [(c, {n: getattr(c, n) for n in names if hasattr(c, n)}) for c in configs]

    def apply(r: Recipe) -> None:
        for config, values in started:
            for name, value in values.items():
                setattr(config, name, r.fields.get(name, value))

    return apply
