"""Typed model of Transformer Engine's userbuffers ``ub_cfgs`` (TE 2.20) and its YAML form.

The YAML is exactly what Megatron-LM's ``--tp-comm-overlap-cfg`` reads (``yaml.safe_load`` of a
mapping ``gemm_name -> {knob: value}``, handed unchanged to ``te.module.base.initialize_ub``). A key
that is absent means "TE's default for this GEMM"; :func:`te_default` states those defaults.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from megatron_tp_overlap.errors import ConfigError, Problem, did_you_mean

MODULES = ("qkv", "proj", "fc1", "fc2")
PHASES = ("fprop", "dgrad", "wgrad")
GEMM_NAMES: tuple[str, ...] = tuple(f"{m}_{p}" for m in MODULES for p in PHASES)
METHODS = ("ring_exchange", "pipeline", "bulk", "external")

# The role each GEMM plays in TE's initialize_ub (TE 2.20, module/base.py).
AG_GEMMS = ("qkv_fprop", "fc1_fprop", "proj_dgrad", "fc2_dgrad")  # all-gather -> GEMM
RS_GEMMS = ("proj_fprop", "fc2_fprop")  # GEMM -> reduce-scatter
BULK_DGRAD_GEMMS = ("qkv_dgrad", "fc1_dgrad")  # bulk all-gather, or GEMM -> RS when non-bulk
BULK_WGRAD_GEMMS = ("qkv_wgrad", "fc1_wgrad")  # bulk reduce-scatter of the dgrad output
EXTERNAL_GEMMS = {"proj_wgrad": "proj_dgrad", "fc2_wgrad": "fc2_dgrad"}  # ride on the dgrad's AG
AG_RS_PAIRS = {"qkv_fprop": "proj_fprop", "fc1_fprop": "fc2_fprop"}  # one TP block

BOOL_KNOBS = (
    "set_sm_margin",
    "aggregate",
    "atomic_gemm",
    "use_ce",
    "fp8_buf",
    "pipeline_rs_overlap_first_gemm",
    "is_reduce_scatter",
)
INT_KNOBS = ("num_sm", "cga_size", "num_splits", "comm_priority", "gemm_priority")


def cached_hash(cls: type) -> type:
    """Class decorator (above ``@dataclass(frozen=True)``): the dataclass's own hash (of the tuple of its compared
    fields, the same value), computed once per object. Configs and options key the search's caches and sets, and
    rehashing their nested fields on every look-up was a large share of a simulated search's time. The cached value
    stays out of pickles and copies: string hashes differ between processes (ranks)."""
    names = tuple(f.name for f in fields(cls) if (f.compare if f.hash is None else f.hash))

    def __hash__(self) -> int:
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(tuple(getattr(self, n) for n in names))
            object.__setattr__(self, "_hash", h)  # frozen: its fields, hence its hash, never change
        return h

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    cls.__hash__ = __hash__  # type: ignore[method-assign]
    cls.__getstate__ = __getstate__  # type: ignore[attr-defined]
    return cls


@cached_hash
@dataclass(frozen=True)
class GemmOverlapConfig:
    """Overlap settings of one GEMM. ``None`` means "not set: TE's default applies"."""

    method: str | None = None
    num_sm: int | None = None  # SMs for the communication kernels (pipeline/bulk)
    cga_size: int | None = None  # CGA cluster size of the communication kernels, 1..4
    num_splits: int | None = None  # GEMM chunks of a pipelined overlap
    set_sm_margin: bool | None = None  # shrink the GEMM's grid by num_sm
    aggregate: bool | None = None  # ring_exchange: 2 chunks per step
    atomic_gemm: bool | None = None  # FP8 only: one atomic GEMM with counters
    use_ce: bool | None = None  # ring_exchange: copy engine instead of SM-driven copies
    fp8_buf: bool | None = None  # FP8 communication buffer (TE honours it for pipeline only)
    comm_priority: int | None = None  # CUDA stream priorities
    gemm_priority: int | None = None
    pipeline_rs_overlap_first_gemm: bool | None = None
    is_reduce_scatter: bool | None = None  # set by TE; allowed only when it matches the GEMM

    def to_dict(self) -> dict[str, Any]:
        """Only the keys that are set, in declaration order (what the YAML holds)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def merged_over(self, base: GemmOverlapConfig) -> GemmOverlapConfig:
        """``base`` with every key that is set here replacing it."""
        return dataclasses.replace(base, **self.to_dict())

    def describe(self) -> str:
        """Short human form, e.g. ``pipeline sm=16 splits=4 cga=2 margin``."""
        d = self.to_dict()
        parts = [d.pop("method", "default")]
        short = {"num_sm": "sm", "num_splits": "splits", "cga_size": "cga"}
        for k, v in d.items():
            if isinstance(v, bool):
                if v:
                    parts.append({"set_sm_margin": "margin", "aggregate": "agg"}.get(k, k))
                elif k == "use_ce":
                    parts.append("no_ce")
            else:
                parts.append(f"{short.get(k, k)}={v}")
        return " ".join(parts)


KNOBS: tuple[str, ...] = tuple(f.name for f in fields(GemmOverlapConfig))


@cached_hash
@dataclass(frozen=True)
class UbConfig:
    """A whole ``ub_cfgs`` mapping; hashable, entries kept in :data:`GEMM_NAMES` order."""

    entries: tuple[tuple[str, GemmOverlapConfig], ...] = ()

    @staticmethod
    def of(mapping: Mapping[str, GemmOverlapConfig]) -> UbConfig:
        unknown = [k for k in mapping if k not in GEMM_NAMES]
        if unknown:
            raise ConfigError([Problem(k, None, f"unknown GEMM name; valid: {', '.join(GEMM_NAMES)}") for k in unknown])
        return UbConfig(tuple((n, mapping[n]) for n in GEMM_NAMES if n in mapping))

    def __contains__(self, name: str) -> bool:
        return any(n == name for n, _ in self.entries)

    def __iter__(self) -> Iterator[str]:
        return (n for n, _ in self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, name: str) -> GemmOverlapConfig | None:
        return next((c for n, c in self.entries if n == name), None)

    def items(self) -> Iterable[tuple[str, GemmOverlapConfig]]:
        return self.entries

    def with_entry(self, name: str, cfg: GemmOverlapConfig | None) -> UbConfig:
        """A copy with ``name`` set to ``cfg`` (``None`` removes the entry: TE default)."""
        d = dict(self.entries)
        if cfg is None:
            d.pop(name, None)
        else:
            d[name] = cfg
        return UbConfig.of(d)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """The plain ``ub_cfgs`` dict that ``initialize_ub`` and Megatron's YAML take."""
        return {n: c.to_dict() for n, c in self.entries}

    def method(self, name: str, tp_size: int = 2) -> str:
        """The method TE will use for ``name`` (the entry's, else TE's default)."""
        c = self.get(name)
        return c.method if c is not None and c.method is not None else te_default(name, tp_size).method  # type: ignore[return-value]

    def dgrad_is_reduce_scatter(self, dgrad: str) -> bool:
        """qkv_dgrad / fc1_dgrad turn into a GEMM -> reduce-scatter overlap when not bulk."""
        return dgrad in BULK_DGRAD_GEMMS and self.method(dgrad) != "bulk"

    def describe(self) -> str:
        return "; ".join(f"{n}: {c.describe()}" for n, c in self.entries) or "TE defaults"


def is_reduce_scatter(name: str, cfg: UbConfig | None = None) -> bool:
    """Whether TE builds a reduce-scatter communicator for ``name`` under ``cfg``."""
    if name in BULK_DGRAD_GEMMS:
        return cfg is not None and cfg.dgrad_is_reduce_scatter(name)
    return name in RS_GEMMS or name in BULK_WGRAD_GEMMS


def te_default(name: str, tp_size: int) -> GemmOverlapConfig:
    """TE 2.20's default config for ``name`` (``get_default_config`` in ``initialize_ub``).

    Stream priorities are left unset: TE takes them from the device at run time.
    """
    if name not in GEMM_NAMES:
        raise KeyError(name)
    if name in AG_GEMMS:
        method = "ring_exchange"
    elif name in RS_GEMMS:
        method = "pipeline"
    elif name in EXTERNAL_GEMMS:
        method = "external"
    else:
        method = "bulk"
    ring = method == "ring_exchange"
    return GemmOverlapConfig(
        method=method,
        num_sm=1 if ring else 16,
        cga_size=1 if ring else 2,
        num_splits=tp_size if ring else 4,
        set_sm_margin=not ring,
        aggregate=False,
        atomic_gemm=False,
        use_ce=True,
        fp8_buf=name in AG_GEMMS or name in BULK_DGRAD_GEMMS or name in EXTERNAL_GEMMS,
        pipeline_rs_overlap_first_gemm=False,
    )


# ----------------------------------------------------------------------------------------------
# Parsing: plain data -> UbConfig, collecting every structural problem (names, keys, types).
# Semantic rules (which method where, ranges that depend on the GPU) live in validation.py.
# ----------------------------------------------------------------------------------------------


def _coerce(key: str, knob: str, value: Any, problems: list[Problem], where: str | None) -> Any:
    if knob == "method":
        if not isinstance(value, str) or value not in METHODS:
            problems.append(Problem(key, value, f"method must be one of {', '.join(METHODS)}", where))
            return None
        return value
    if knob in BOOL_KNOBS:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):  # TE's own examples write aggregate: 0/1
            return bool(value)
        if isinstance(value, (tuple, list)):  # NeMo's PipelineOverlapCfg.fp8_buf default is (False,)
            problems.append(
                Problem(
                    key,
                    value,
                    "must be a boolean (a tuple such as NeMo's (False,) is truthy: write true or false)",
                    where,
                )
            )
            return None
        problems.append(Problem(key, value, "must be a boolean (true/false)", where))
        return None
    if knob in INT_KNOBS:
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append(Problem(key, value, "must be an integer", where))
            return None
        return value
    raise AssertionError(knob)


def parse_ub_cfgs(raw: Any, source: str | None = None, lines: Mapping[str, int] | None = None) -> UbConfig:
    """Turn a loaded ``ub_cfgs`` mapping into a :class:`UbConfig`; raise :class:`ConfigError`."""
    lines = lines or {}

    def where(key: str) -> str | None:
        line = lines.get(key)
        return f"{source}:{line}" if source and line else source

    if raw is None:
        return UbConfig()
    if not isinstance(raw, Mapping):
        raise ConfigError([Problem("<top level>", raw, "must be a mapping of GEMM name -> settings", source)], source)
    problems: list[Problem] = []
    entries: dict[str, GemmOverlapConfig] = {}
    for name, body in raw.items():
        if name == "ub_cfgs" and isinstance(body, Mapping):  # a config pasted with its TransformerConfig field name
            rule = (
                "a top-level `ub_cfgs:` wrapper: the file holds the GEMM entries themselves (as Megatron's "
                "--tp-comm-overlap-cfg reads it); drop `ub_cfgs:` and unindent what it holds"
            )
            problems.append(Problem("<ub_cfgs>", None, rule, where("ub_cfgs")))
            continue
        if name not in GEMM_NAMES:
            problems.append(
                Problem(
                    str(name),
                    body,
                    f"unknown GEMM name{did_you_mean(name, GEMM_NAMES)}; valid: {', '.join(GEMM_NAMES)}",
                    where(str(name)),
                )
            )
            continue
        if not isinstance(body, Mapping):
            problems.append(
                Problem(name, body, "must be a mapping of knob -> value (e.g. {method: bulk, num_sm: 4})", where(name))
            )
            continue
        values: dict[str, Any] = {}
        for knob, value in body.items():
            key = f"{name}.{knob}"
            if knob not in KNOBS:
                rule = f"unknown key{did_you_mean(knob, KNOBS)}; valid: {', '.join(KNOBS)}"
                problems.append(Problem(key, value, rule, where(key)))
                continue
            v = _coerce(key, knob, value, problems, where(key))
            if v is not None:
                values[knob] = v
        entries[name] = GemmOverlapConfig(**values)
    if problems:
        raise ConfigError(problems, source)
    return UbConfig.of(entries)


class _LineLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys (PyYAML silently keeps the last one)."""


def _yaml_lines(text: str, source: str) -> dict[str, int]:
    """``{"qkv_fprop": 3, "qkv_fprop.num_sm": 4, ...}`` (1-based) from the YAML node tree."""
    node = yaml.compose(text, Loader=_LineLoader)
    out: dict[str, int] = {}
    dups: list[Problem] = []
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for k, v in node.value:
            name = str(k.value)
            if name in seen:
                dups.append(Problem(name, None, "duplicate GEMM entry", f"{source}:{k.start_mark.line + 1}"))
            seen.add(name)
            out[name] = k.start_mark.line + 1
            if isinstance(v, yaml.MappingNode):
                inner: set[str] = set()
                for kk, _ in v.value:
                    key = f"{name}.{kk.value}"
                    if kk.value in inner:
                        dups.append(Problem(key, None, "duplicate key", f"{source}:{kk.start_mark.line + 1}"))
                    inner.add(kk.value)
                    out[key] = kk.start_mark.line + 1
    if dups:
        raise ConfigError(dups, source)
    return out


def parse_yaml(text: str, source: str = "<string>") -> tuple[UbConfig, dict[str, int]]:
    """Parse YAML text in Megatron's ``--tp-comm-overlap-cfg`` format (structure only).

    Returns the config and the line of every key, for errors found later.
    """
    try:
        raw = yaml.safe_load(text)
        lines = _yaml_lines(text, source)
    except yaml.YAMLError as e:
        # the context mark is where the broken construct starts (e.g. an unclosed `[`); the problem mark is where
        # the parser gave up, often a line later
        mark = getattr(e, "context_mark", None) or getattr(e, "problem_mark", None)
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError([Problem("<yaml>", None, f"malformed YAML: {problem}", where)], source) from e
    return parse_ub_cfgs(raw, source, lines), lines


def loads_yaml(text: str, source: str = "<string>") -> UbConfig:
    return parse_yaml(text, source)[0]


def read_text(path: str | Path) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except IsADirectoryError:
        raise ConfigError(
            [Problem("<file>", str(path), "is a directory, not a YAML file", str(path))], str(path)
        ) from None
    except OSError as e:
        raise ConfigError([Problem("<file>", str(path), f"cannot read: {e.strerror}", str(path))], str(path)) from e
    except UnicodeDecodeError as e:
        rule = f"not UTF-8 text (byte {e.start}: {e.object[e.start : e.start + 1]!r}); a YAML file is expected"
        raise ConfigError([Problem("<file>", str(path), rule, str(path))], str(path)) from None


def load_yaml(path: str | Path) -> UbConfig:
    return loads_yaml(read_text(path), str(path))


def dumps_yaml(cfg: UbConfig, header: str | None = None) -> str:
    """YAML that Megatron's ``--tp-comm-overlap-cfg`` reads; ``header`` becomes ``#`` comments."""
    body = yaml.safe_dump(cfg.to_dict(), sort_keys=False, default_flow_style=False) if len(cfg) else "{}\n"
    if header:
        body = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines()) + body
    return body
