"""Model dimensions from a Hugging Face model name or a local config directory, offline.

Configs of common models ship with the package (``model_configs/<org>/<name>/config.json``: Llama 2,
Llama 3/3.1, Qwen3 0.6B-32B, GPT-3 1.3B-175B) and load through ``transformers.AutoConfig``; a name
that is neither shipped nor in the local Hugging Face cache is a clear error (no hub access).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

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


def load_model_dims(name_or_path: str) -> ModelDims:
    """Dimensions of ``name_or_path``: a local directory with config.json, a shipped model, or one
    already in the Hugging Face cache (offline)."""
    from transformers import AutoConfig

    local = Path(name_or_path)
    shipped = SHIPPED / name_or_path
    source = local if (local / "config.json").is_file() else shipped if (shipped / "config.json").is_file() else None
    try:
        cfg = AutoConfig.from_pretrained(str(source) if source else name_or_path, local_files_only=True)
    except (OSError, ValueError) as e:
        if source is not None:  # the file is there: say what is wrong with it
            raise ValueError(
                f"model {name_or_path!r}: {source / 'config.json'} is not a readable model config: "
                f"{str(e).splitlines()[0]}"
            ) from None
        raise ValueError(
            f"model {name_or_path!r}{_suggestion(name_or_path)}: looked in a local directory, "
            f"the models shipped with this package and the Hugging Face cache (no hub access); shipped: "
            f"{', '.join(shipped_models())}"
        ) from None
    if getattr(cfg, "model_type", None) == "gpt2":
        h, heads = cfg.n_embd, cfg.n_head
        return ModelDims(
            name_or_path, h, cfg.n_inner or 4 * h, heads, heads, h // heads, cfg.n_layer, cfg.vocab_size, False
        )
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    act = str(getattr(cfg, "hidden_act", "silu"))
    return ModelDims(
        name_or_path,
        cfg.hidden_size,
        cfg.intermediate_size,
        heads,
        kv,
        head_dim,
        cfg.num_hidden_layers,
        cfg.vocab_size,
        act in ("silu", "swish"),
    )
