import pytest

from megatron_tp_overlap.models import load_model_dims, shipped_models
from megatron_tp_overlap.tools.scaling import scaling_report

pytest.importorskip("transformers")


def test_shipped_models():
    names = shipped_models()
    for n in (
        "meta-llama/Meta-Llama-3-8B",
        "meta-llama/Llama-2-70b-hf",
        "Qwen/Qwen3-0.6B",
        "Qwen/Qwen3-32B",
        "gpt3/gpt3-20b",
    ):
        assert n in names


@pytest.mark.parametrize(
    "name, dims",
    [
        ("meta-llama/Meta-Llama-3-8B", (4096, 14336, 32, 8, 128, 32, True)),
        ("meta-llama/Meta-Llama-3-70B", (8192, 28672, 64, 8, 128, 80, True)),
        ("Qwen/Qwen3-8B", (4096, 12288, 32, 8, 128, 36, True)),
        ("Qwen/Qwen3-0.6B", (1024, 3072, 16, 8, 128, 28, True)),  # head_dim 128 != 1024 / 16
        ("gpt3/gpt3-20b", (6144, 24576, 48, 48, 128, 44, False)),
    ],
)
def test_dims(name, dims):
    d = load_model_dims(name)
    assert (d.hidden, d.ffn, d.heads, d.kv_heads, d.head_dim, d.layers, d.gated_mlp) == dims


def test_derived_shapes():
    d = load_model_dims("meta-llama/Meta-Llama-3-8B")
    assert d.qkv_out == (32 + 16) * 128 and d.fc1_out == 2 * 14336


def test_local_directory(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, '
        '"num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 100}'
    )
    d = load_model_dims(str(tmp_path))
    assert (d.hidden, d.kv_heads, d.head_dim) == (256, 4, 64)


def test_unknown_model_is_a_clear_error():
    with pytest.raises(ValueError, match="looked in a local directory, the models shipped.*Qwen/Qwen3-8B"):
        load_model_dims("acme/NotAModel-7B")


def test_scaling_recommends_the_largest_efficient_tp():
    rec, v = scaling_report({1: 100.0, 2: 55.0, 4: 29.0, 8: 19.0}, tol=0.2)
    assert rec == 4
    assert [x.efficient for x in v] == [True, True, True, False]
    assert "not efficient" in v[3].reason and "66%" in v[3].reason
    assert scaling_report({1: 10.0, 2: 9.0})[0] == 1
    with pytest.raises(ValueError, match="TP=1"):
        scaling_report({2: 1.0})
