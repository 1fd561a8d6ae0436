"""What a NeMo preset was written for, and the one line that says when a run starts from a preset written for another
shape (GPU, dtype, hidden, TP, tokens a micro-batch) than its own.

NeMo's preset names carry their shape (``userbuffers_bf16_h100_h8192_tp4_mbs1_seqlen8192``: dtype, GPU, hidden, TP,
optionally CP, micro-batch, sequence length, optionally ``lora``); a name without ``cp`` was written for no context
parallelism. A starting config is recognised by the preset name given with it (a YAML's ``# preset NAME`` header, as
``megatron-tp-overlap preset NAME`` and the main job write) when its content is that preset's, else by content alone:
Bridge and NeMo recipes hand the preset over as a dataclass, without its name. Several presets share one content
(e.g. the fp8 h100 h8192 TP4 and fp8 b200 h8192 TP2 ones); the line then names them all.

The userbuffers see ``seq x micro-batch / CP`` tokens a micro-batch, so the sequence length, micro-batch and CP count
as one field: a run at micro-batch 2, seq 4096 has the buffers of a preset's micro-batch 1, seq 8192.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Optional

from megatron_tp_overlap.ub.config import UbConfig
from megatron_tp_overlap.ub.presets import NEMO_PRESETS, PRESETS

TAG = "[tp-overlap-autotune]"
DTYPES = ("bf16", "fp8", "fp16", "fp32")
_INT_TOKENS = {
    "hidden": r"h(\d{4,})",
    "tp": r"tp(\d+)",
    "cp": r"cp(\d+)",
    "micro_batch": r"mbs(\d+)",
    "seq": r"seqlen(\d+)",
}
_GPU_TOKEN = r"[a-z]{1,2}\d{3}"  # h100, b200, gb200 (a hidden size token, h8192, has 4+ digits)
_HEADER = re.compile(r"^#\s*(?:NeMo(?:'s)?\s+)?preset\s+([A-Za-z0-9_]+)\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class Shape:
    """What a preset was written for, or what a run is; None: not known (a preset name that does not say)."""

    gpu: Optional[str] = None  # "H100"
    dtype: Optional[str] = None
    hidden: Optional[int] = None
    tp: Optional[int] = None
    cp: Optional[int] = None
    micro_batch: Optional[int] = None
    seq: Optional[int] = None
    lora: bool = False

    @property
    def tokens(self) -> Optional[int]:
        """Rows of the userbuffers: seq x micro-batch / CP."""
        if self.seq is None or self.micro_batch is None:
            return None
        return self.seq * self.micro_batch // (self.cp or 1)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v not in (None, False)}

    def describe(self, only: Optional[set[str]] = None) -> str:
        """``H100, bf16, hidden 8192, TP 4, micro-batch 1, seq 8192`` (the fields in ``only``, else every known one;
        CP only where it is not 1 or is asked for)."""
        label = {"hidden": "hidden ", "tp": "TP ", "cp": "CP ", "micro_batch": "micro-batch ", "seq": "seq "}
        parts = []
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None or f.name == "lora" or (only is not None and f.name not in only):
                continue
            if f.name == "cp" and v == 1 and only is None:
                continue
            parts.append(f"{label.get(f.name, '')}{v}")
        return ", ".join(parts + (["LoRA"] if self.lora and only is None else []))


def parse_preset_name(name: str) -> Optional[Shape]:
    """The shape a NeMo preset name says it was written for (None: not a ``userbuffers_*`` name); a field the name
    does not carry stays None, except CP: a name with a sequence length and no ``cp`` was written for CP 1."""
    parts = name.lower().split("_")
    if parts[0] != "userbuffers":
        return None
    found: dict[str, Any] = {}
    for token in parts[1:]:
        if token in DTYPES:
            found["dtype"] = token
        elif token == "lora":
            found["lora"] = True
        elif re.fullmatch(_GPU_TOKEN, token):
            found["gpu"] = token.upper()
        else:
            for key, pattern in _INT_TOKENS.items():
                m = re.fullmatch(pattern, token)
                if m:
                    found[key] = int(m.group(1))
    if "seq" in found:
        found.setdefault("cp", 1)
    return Shape(**found)


def gpu_model(device_name: str) -> str:
    """``H100`` from ``NVIDIA H100 80GB HBM3`` (torch.cuda.get_device_name); the name less ``NVIDIA`` otherwise."""
    for token in re.split(r"[\s\-_]+", device_name):
        if re.fullmatch(r"[A-Za-z]{1,2}\d{2,4}[A-Za-z]?", token):
            return token.upper()
    return re.sub(r"^NVIDIA\s+", "", device_name.strip()) or device_name


def run_shape(run: Any, device_name: str) -> Shape:
    """The run's side, from a RunShape-like object (tp, seq_length, micro_batch_size, cp, hidden, dtype)."""
    return Shape(
        gpu=gpu_model(device_name),
        dtype=run.dtype,
        hidden=run.hidden,
        tp=run.tp,
        cp=getattr(run, "cp", 1) or 1,
        micro_batch=run.micro_batch_size,
        seq=getattr(run, "decoder_seq_length", None) or run.seq_length,
    )


def mismatch(written_for: Shape, run: Shape) -> list[str]:
    """The fields where ``run`` is not what the preset was written for (fields the name does not carry: skipped)."""
    out = []
    for key in ("gpu", "dtype", "hidden", "tp"):
        a, b = getattr(written_for, key), getattr(run, key)
        if a is not None and b is not None and str(a).lower() != str(b).lower():
            out.append(key)
    if written_for.tokens is not None and run.tokens is not None and written_for.tokens != run.tokens:
        out += [k for k in ("cp", "micro_batch", "seq") if getattr(written_for, k) != getattr(run, k)]
    return out


def presets_equal_to(cfg: UbConfig) -> list[str]:
    """The NeMo presets whose content is ``cfg`` (several share one; TE's defaults are no NeMo preset)."""
    return [n for n in NEMO_PRESETS if PRESETS[n] == cfg]


def preset_named_in(source: Any) -> Optional[str]:
    """The preset a starting YAML's leading comments name (``# preset NAME``, ``# NeMo preset NAME``); None for
    anything else (a dataclass, an unreadable file: it is loaded, and complained about, elsewhere)."""
    if not isinstance(source, (str, Path)):
        return None
    try:
        with open(source, encoding="utf-8") as f:
            for line in f:
                if not line.startswith("#"):
                    break
                m = _HEADER.match(line.strip())
                if m:
                    return m.group(1)
    except (OSError, UnicodeDecodeError):
        return None
    return None


@dataclass(frozen=True)
class StartingConfig:
    """Which preset(s) the starting config is, what each was written for, the run, and where they differ."""

    presets: tuple[str, ...]
    by: str  # "name" or "content"
    written_for: dict[str, Shape]
    run: Shape
    mismatch: tuple[str, ...]  # empty when the run is what one of the presets was written for

    def line(self) -> Optional[str]:
        """The one log line, or None when the run is what a preset was written for."""
        if not self.mismatch:
            return None
        if len(self.presets) == 1:
            preset = self.written_for[self.presets[0]]
            what = f"NeMo's preset {self.presets[0]}, written for {preset.describe()}"
            run = self.run.describe(set(self.mismatch))
            rows = {"cp", "micro_batch", "seq"} & set(self.mismatch)
            if "cp" in rows or len(rows) > 1:  # what the buffers see, where one field does not say it
                run += f", {self.run.tokens} tokens a micro-batch against the preset's {preset.tokens}"
        else:  # the run against each: its whole shape
            each = [f"{n} (written for {self.written_for[n].describe()})" for n in self.presets]
            what = "equal to NeMo's presets " + ", ".join(each[:-1]) + " and " + each[-1]
            run = self.run.describe()
        return f"{TAG} the starting config is {what}; this run: {run} (the search starts from it; the tuned config is for this run)"

    def to_dict(self) -> dict[str, Any]:
        return {
            "presets": list(self.presets),
            "recognised_by": self.by,
            "written_for": {n: s.to_dict() for n, s in self.written_for.items()},
            "run": self.run.to_dict(),
            "mismatch": list(self.mismatch),
            "line": self.line(),
        }


def starting_config(reference: UbConfig, name: Optional[str], run: Shape) -> Optional[StartingConfig]:
    """What the starting config ``reference`` is (a preset named ``name`` when its content is that preset's, else the
    presets equal to it) and how ``run`` differs from what it was written for; None when it is no NeMo preset."""
    if name is not None and name in PRESETS and PRESETS[name] == reference and parse_preset_name(name) is not None:
        names, by = [name], "name"
    else:
        names, by = presets_equal_to(reference), "content"
    if not names:
        return None
    shapes = {n: parse_preset_name(n) or Shape() for n in names}
    per = {n: mismatch(s, run) for n, s in shapes.items()}
    differ = [] if any(not m for m in per.values()) else sorted({k for m in per.values() for k in m}, key=_order)
    return StartingConfig(tuple(names), by, shapes, run, tuple(differ))


def _order(key: str) -> int:
    return [f.name for f in fields(Shape)].index(key)


def starting_line(reference: UbConfig, name: Optional[str], run: Shape) -> Optional[str]:
    """The one line, or None (no NeMo preset, or the run is what it was written for)."""
    s = starting_config(reference, name, run)
    return s.line() if s is not None else None


def preset_header(name: str) -> str:
    """The comment header of a preset written as YAML: its name (which :func:`preset_named_in` reads back) and what
    it was written for."""
    shape = parse_preset_name(name)
    return f"preset {name}" + (f"\nNeMo's, written for {shape.describe()}" if shape is not None else "")


def announce(reference: UbConfig, name: Optional[str], run: Any, device_name: str, log: Any) -> Optional[dict]:
    """At tuning start (every way in): logs the one line when the starting config is a preset written for another
    shape than ``run`` (a RunShape) on ``device_name``; returns the report's ``starting_config`` field (None: the
    starting config is no NeMo preset)."""
    s = starting_config(reference, name, run_shape(run, device_name))
    if s is None:
        return None
    if s.line():
        log(s.line())
    return s.to_dict()
