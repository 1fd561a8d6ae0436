"""Model dimensions from a Hugging Face model name or a local config directory.

Resolution order: a local ``config.json`` file or a directory with one; the Hugging Face hub when it is reachable
(and offline mode is off: ``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE`` as huggingface_hub reads them; reachable: a
TCP connection to the hub, or to the HTTPS proxy, opens within 2 s, since on an offline GPU node the hub client
otherwise retries for ~23 s per lookup); the local Hugging Face cache; the configs shipped with the package
(``model_configs/<org>/<name>/config.json``: Llama 2, Llama 3/3.1, Qwen3 0.6B-32B, GPT-3 1.3B-175B; MoE: Qwen3-30B-A3B
/235B-A22B, Mixtral 8x7B/8x22B, gpt-oss 20b/120b, Llama-4 Scout/Maverick). All load through
``transformers.AutoConfig``; :attr:`ModelDims.source` says which one answered (and the hub revision).
An unknown name is one clear error saying where it looked.
"""

from __future__ import annotations

import functools
import os
import socket
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from megatron_tp_overlap.model_features import LayerFreq, moe_fields, moe_pattern

SHIPPED = Path(__file__).with_name("model_configs")


@dataclass(frozen=True)
class ModelDims:
    name: str
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    vocab: int
    gated_mlp: bool  # SwiGLU: fc1 produces 2 x ffn
    source: str = (
        ""  # where the config came from: "local directory", "hub@<revision>", "HF cache@<revision>", "shipped"
    )
    # Mixture of experts (model_features.py; None: dense). ``ffn`` is then the dense layers' FFN.
    num_experts: Optional[int] = None  # routed experts per MoE layer
    moe_topk: Optional[int] = None  # experts per token
    moe_ffn: Optional[int] = None  # one routed expert's FFN
    shared_expert_ffn: Optional[int] = None  # the shared experts' FFN (None: no shared expert)
    moe_layer_freq: LayerFreq = 1  # Megatron's --moe-layer-freq: 1 in N layers MoE, or a 0/1 per layer
    not_reproduced: tuple[str, ...] = ()  # what the model has that the built GPT leaves out (GEMM shapes unchanged)

    @property
    def is_moe(self) -> bool:
        return bool(self.num_experts)

    @property
    def moe_layers(self) -> list[int]:
        """Indices of the MoE layers (none for a dense model)."""
        return [i for i, m in enumerate(moe_pattern(self.moe_layer_freq, self.layers)) if m] if self.is_moe else []

    @property
    def qkv_out(self) -> int:
        """Output features of the fused qkv projection."""
        return (self.heads + 2 * self.kv_heads) * self.head_dim

    @property
    def fc1_out(self) -> int:
        return (2 if self.gated_mlp else 1) * self.ffn


def shipped_models() -> list[str]:
    return sorted(str(p.parent.relative_to(SHIPPED)) for p in SHIPPED.glob("*/*/config.json"))


def _suggestion(name: str) -> str:
    """A shipped model close to ``name`` by full name or by its last part, case-insensitive (``llama3-8b``)."""
    import difflib

    by_key = {m.lower(): m for m in shipped_models()} | {m.split("/")[-1].lower(): m for m in shipped_models()}
    close = difflib.get_close_matches(name.lower(), by_key, n=1, cutoff=0.6)
    return f" (did you mean {by_key[close[0]]!r}?)" if close else ""


def _hub_offline() -> bool:
    """huggingface_hub's own rule (``constants.HF_HUB_OFFLINE``), read now rather than at its import."""
    from huggingface_hub.constants import ENV_VARS_TRUE_VALUES

    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in ENV_VARS_TRUE_VALUES


PROBE_TIMEOUT_S = 2.0


@functools.lru_cache(maxsize=8)
def _reachable(url: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether a TCP connection to ``url``'s host and port opens within ``timeout_s`` (once per process)."""
    u = urllib.parse.urlparse(url if "://" in url else f"http://{url}")
    if not u.hostname:
        return False
    try:
        with socket.create_connection((u.hostname, u.port or (443 if u.scheme == "https" else 80)), timeout=timeout_s):
            return True
    except OSError:  # no route, no DNS, refused, timed out
        return False


def _hub_reachable() -> bool:
    """The hub (``HF_ENDPOINT``), or the HTTPS proxy the hub client would go through, answers a TCP connect."""
    if _hub_offline():
        return False
    proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy")
    return _reachable(proxy or os.environ.get("HF_ENDPOINT") or "https://huggingface.co")


def find_config(name_or_path: str) -> tuple[Any, str]:
    """The ``transformers`` config of ``name_or_path`` and where it came from, in the resolution order above."""
    from transformers import AutoConfig

    if not name_or_path.strip():
        raise ValueError("empty: give a Hugging Face model name (e.g. Qwen/Qwen3-8B) or a folder holding config.json")
    local = Path(name_or_path).expanduser()
    if local.is_file():
        return _config_file(local), "local file"
    if (local / "config.json").is_file():
        try:
            return AutoConfig.from_pretrained(str(local), local_files_only=True), "local directory"
        except (OSError, ValueError) as e:  # the file is there: say what is wrong with it
            raise ValueError(
                f"model {name_or_path!r}: {local / 'config.json'} is not a readable model config: "
                f"{str(e).splitlines()[0]}"
            ) from None
    tried = ["a local directory"]
    for where, kw in (("hub", {}), ("HF cache", {"local_files_only": True})):
        if where == "hub" and not _hub_reachable():
            continue
        tried.append(f"the Hugging Face {'hub' if where == 'hub' else 'cache'}")
        try:
            cfg = AutoConfig.from_pretrained(name_or_path, **kw)
        except (OSError, ValueError):  # unreachable, gated, unknown, or not cached
            continue
        return cfg, f"{where}@{getattr(cfg, '_commit_hash', None) or 'unknown revision'}"
    shipped = SHIPPED / name_or_path
    if (shipped / "config.json").is_file():
        return AutoConfig.from_pretrained(str(shipped), local_files_only=True), "shipped"
    if local.is_dir():  # a folder given, and no model of that name elsewhere: say what the folder lacks
        raise ValueError(f"the folder {local} holds no config.json (a Hugging Face model folder has one)")
    raise ValueError(
        f"model {name_or_path!r}{_suggestion(name_or_path)}: looked in {', '.join(tried)} and the models shipped "
        f"with this package ({', '.join(shipped_models())})"
    )


def _config_file(path: Path) -> Any:
    """A Hugging Face config given as its JSON file; one line when the file is not one."""
    import json

    from transformers import AutoConfig

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"the file {path} is not a JSON model config ({type(e).__name__})") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise ValueError(
            f"the file {path} is JSON but not a Hugging Face model config (no model_type): give the model's "
            "config.json or its folder"
        )
    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"the file {path} is not a readable model config: {str(e).splitlines()[0][:200]}") from None


def load_model_dims(name_or_path: str) -> ModelDims:
    """Dimensions of ``name_or_path`` (see the module docstring for where it looks)."""
    cfg, source = find_config(name_or_path)
    if getattr(cfg, "model_type", None) == "gpt2":
        h, heads = cfg.n_embd, cfg.n_head
        return ModelDims(
            name_or_path, h, cfg.n_inner or 4 * h, heads, heads, h // heads, cfg.n_layer, cfg.vocab_size, False, source
        )
    t, extra = moe_fields(cfg)  # the decoder's config; refuses what cannot be built
    heads = t.num_attention_heads
    kv = getattr(t, "num_key_value_heads", None) or heads
    head_dim = getattr(t, "head_dim", None) or t.hidden_size // heads
    act = str(getattr(t, "hidden_act", "silu"))
    return ModelDims(
        name_or_path,
        t.hidden_size,
        extra.pop("ffn"),
        heads,
        kv,
        head_dim,
        t.num_hidden_layers,
        t.vocab_size,
        act in ("silu", "swish"),
        source,
        **extra,
    )
