"""A cache of tuned configs shared by runs on one machine (or a shared filesystem).

Keyed by what a tuned config depends on: GPU model, TP size, tokens per micro-batch (sequence x
micro-batch), hidden, ffn, heads, dtype/fp8 and TE version. Safe under concurrent runs: a file lock
around read-modify-write and atomic replacement of every file; a corrupt entry is ignored with a
warning (and overwritten by the next tuning), never fatal.
"""
from __future__ import annotations

import hashlib
import json
import os
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock

from .atomic import atomic_write_text
from .errors import ConfigError
from .ub_config import UbConfig, dumps_yaml, loads_yaml


@dataclass(frozen=True)
class CacheKey:
    gpu: str
    tp: int
    tokens: int  # sequence length x micro-batch size (the userbuffers shape)
    hidden: int
    ffn: int
    heads: int
    dtype: str  # bf16 | fp8
    te_version: str

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


def default_cache_dir() -> Path:
    return Path(os.environ.get("MEGATRON_TP_OVERLAP_CACHE", Path.home() / ".cache" / "megatron_tp_overlap"))


class TunedConfigCache:
    def __init__(self, root: str | Path | None = None):
        self.root = Path(root) if root is not None else default_cache_dir()

    def _paths(self, key: CacheKey) -> tuple[Path, Path]:
        d = key.digest()
        return self.root / f"{d}.yaml", self.root / f"{d}.json"

    def _lock(self) -> FileLock:
        self.root.mkdir(parents=True, exist_ok=True)
        return FileLock(str(self.root / ".lock"), timeout=120)

    def get(self, key: CacheKey) -> tuple[UbConfig, dict[str, Any]] | None:
        """The cached config and its metadata, or None (missing, corrupt, or for another key)."""
        yaml_path, meta_path = self._paths(key)
        if not yaml_path.exists():
            return None
        with self._lock():
            try:
                meta = json.loads(meta_path.read_text())
                if meta.get("key") != asdict(key):
                    raise ValueError("key mismatch")
                return loads_yaml(yaml_path.read_text(), str(yaml_path)), meta
            except (OSError, ValueError, ConfigError) as e:
                warnings.warn(f"ignoring corrupt tuned-config cache entry {yaml_path}: {e}", stacklevel=2)
                return None

    def put(self, key: CacheKey, cfg: UbConfig, meta: dict[str, Any] | None = None) -> Path:
        yaml_path, meta_path = self._paths(key)
        with self._lock():
            atomic_write_text(yaml_path, dumps_yaml(cfg, header=f"megatron-tp-overlap cache entry {key.digest()}"))
            atomic_write_text(meta_path, json.dumps({"key": asdict(key), **(meta or {})}, indent=1) + "\n")
        return yaml_path
