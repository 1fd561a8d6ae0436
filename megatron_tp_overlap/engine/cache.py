"""Tuned configs kept for reuse, on one machine or a shared filesystem.

One key, :class:`TuningKey`: everything a tuned config depends on (GPU, TE version, TP/CP, tokens per
micro-batch, every GEMM dimension, dtype, dgrad mode, the starting config and the search space). Safe under
concurrent runs: a file lock around read-modify-write and atomic replacement of every file; a corrupt entry
is ignored with a warning (the next tuning replaces it), never fatal.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from filelock import FileLock

from megatron_tp_overlap.atomic import _umask, atomic_write_text
from megatron_tp_overlap.errors import ConfigError
from megatron_tp_overlap.ub.config import UbConfig, dumps_yaml, loads_yaml

CACHE_ENV = "MEGATRON_TP_OVERLAP_CACHE"


@dataclass(frozen=True)
class TuningKey:
    gpu: str
    te_version: str
    tp: int
    cp: int
    tokens: int  # sequence length x micro-batch size / CP (the userbuffers shape)
    hidden: int
    ffn: int
    heads: int
    kv_groups: Optional[int]  # None: multi-head attention
    kv_channels: int
    gated_mlp: bool
    dtype: str  # bf16 | fp8 | ...
    bf16_edge_layers: bool
    rs_dgrad: bool
    reference: str  # digest of the config tuning starts from
    space: str  # what the search may choose (e.g. "allow_off")
    moe: str = ""  # an MoE model's layout (experts, top-k, expert and shared-expert FFN, MoE layers); "" when dense

    def record(self) -> dict[str, Any]:
        """The key as stored: a dense model's without ``moe`` (its entries from before MoE support still match)."""
        d = asdict(self)
        if not d["moe"]:
            del d["moe"]
        return d

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.record(), sort_keys=True).encode()).hexdigest()[:16]


def config_digest(ub: UbConfig) -> str:
    return hashlib.sha256(json.dumps(ub.to_dict(), sort_keys=True).encode()).hexdigest()[:12]


@dataclass(frozen=True)
class CachedConfig:
    ub: UbConfig
    disabled: frozenset[str]  # GEMMs whose overlap the tuned config switches off
    meta: dict[str, Any]


def default_cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "megatron_tp_overlap"))


class TunedConfigCache:
    def __init__(self, root: str | Path | None = None):
        self.root = Path(root).expanduser() if root is not None else default_cache_dir()

    def _paths(self, key: TuningKey) -> tuple[Path, Path]:
        d = key.digest()
        return self.root / f"{d}.yaml", self.root / f"{d}.json"

    def _lock(self) -> FileLock:
        self.root.mkdir(parents=True, exist_ok=True)
        # the umask's mode, not filelock's 0644: a cache shared by a group is locked by each of its accounts
        return FileLock(str(self.root / ".lock"), timeout=120, mode=0o666 & ~_umask())

    def get(self, key: TuningKey) -> CachedConfig | None:
        """The cached config for ``key``, or None (missing, corrupt, or written for another key). A cache this
        account may read but not lock (another account's folder or lock file, a read-only mount) is read without
        the lock: the YAML's digest in its metadata tells a torn pair (a writer in between) from a whole one."""
        yaml_path, _ = self._paths(key)
        if not yaml_path.exists():
            return None
        try:
            lock = self._lock()
            lock.acquire()
        except OSError:  # PermissionError, EROFS: readers need no lock
            return self._read(key, retry=True)
        try:
            return self._read(key)
        finally:
            lock.release()

    def _read(self, key: TuningKey, retry: bool = False) -> CachedConfig | None:
        yaml_path, meta_path = self._paths(key)
        for last in (False, True) if retry else (True,):
            try:
                meta = json.loads(meta_path.read_text())
                if meta.get("key") != key.record():
                    raise ValueError("key mismatch")
                ub = loads_yaml(yaml_path.read_text(), str(yaml_path))
                if meta.get("ub_cfgs_digest") != config_digest(ub):  # YAML and metadata of different writes
                    raise ValueError("the YAML does not match its metadata")
                return CachedConfig(ub, frozenset(meta.get("overlap_off", [])), meta)
            except (OSError, ValueError, ConfigError) as e:
                if isinstance(e, PermissionError):  # another account's entry: not corrupt, the caller says so
                    raise
                if last:
                    warnings.warn(f"ignoring corrupt tuned-config cache entry {yaml_path}: {e}", stacklevel=3)
        return None

    def put(
        self, key: TuningKey, ub: UbConfig, disabled: frozenset[str] = frozenset(), meta: dict[str, Any] | None = None
    ) -> Path:
        yaml_path, meta_path = self._paths(key)
        with self._lock():
            atomic_write_text(yaml_path, dumps_yaml(ub, header=f"megatron-tp-overlap cache entry {key.digest()}"))
            record = {
                "key": key.record(),
                "ub_cfgs_digest": config_digest(ub),
                "overlap_off": sorted(disabled),
                **(meta or {}),
            }
            atomic_write_text(meta_path, json.dumps(record, indent=1) + "\n")
        return yaml_path
