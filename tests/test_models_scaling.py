import pytest

from megatron_tp_overlap.models import SHIPPED, load_model_dims, shipped_models
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
    assert (d.hidden, d.kv_heads, d.head_dim, d.source) == (256, 4, 64, "local directory")


def test_unknown_model_is_a_clear_error():
    with pytest.raises(
        ValueError, match="looked in a local directory, the Hugging Face cache and the models shipped.*Qwen/Qwen3-8B"
    ):
        load_model_dims("acme/NotAModel-7B")


class FakeHub:
    """``AutoConfig.from_pretrained`` with a mocked hub and cache; local paths load for real."""

    def __init__(self, monkeypatch, hub=None, cache=None, reachable=True):
        from transformers import AutoConfig

        from megatron_tp_overlap import models

        real = AutoConfig.from_pretrained
        self.calls = []

        def from_pretrained(name, local_files_only=False, **kw):
            self.calls.append((name, local_files_only))
            if "/" in name and name.startswith(("/", ".")):
                return real(name, local_files_only=True, **kw)
            found = cache if local_files_only else hub
            if found is None:
                raise OSError("not reachable / not cached")
            cfg = real(str(SHIPPED / "Qwen/Qwen3-4B"), local_files_only=True)
            cfg.hidden_size, cfg._commit_hash = found
            return cfg

        monkeypatch.setattr(AutoConfig, "from_pretrained", from_pretrained)
        monkeypatch.setattr(models, "_reachable", lambda url: reachable)  # the TCP probe (tests have no network)
        monkeypatch.setenv("HF_HUB_OFFLINE", "0")


def test_the_hub_answers_first_when_reachable_and_its_revision_is_recorded(monkeypatch):
    FakeHub(monkeypatch, hub=(1234, "abc123"), cache=(999, "old"))
    d = load_model_dims("Qwen/Qwen3-4B")  # also shipped: the hub's config wins
    assert (d.hidden, d.source) == (1234, "hub@abc123")


def test_the_cache_answers_when_the_hub_is_unreachable(monkeypatch):
    FakeHub(monkeypatch, hub=None, cache=(999, "c0ffee"))
    assert load_model_dims("acme/Private-7B").source == "HF cache@c0ffee"


def test_shipped_configs_are_the_last_resort(monkeypatch):
    hub = FakeHub(monkeypatch)
    d = load_model_dims("Qwen/Qwen3-8B")
    assert d.source == "shipped" and d.hidden == 4096
    assert [c[1] for c in hub.calls[:2]] == [False, True]  # hub, then cache, before the shipped file


def test_hub_offline_skips_the_hub(monkeypatch):
    hub = FakeHub(monkeypatch, hub=(1234, "abc"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert load_model_dims("Qwen/Qwen3-8B").source == "shipped" and all(c[1] for c in hub.calls)


def test_scaling_recommends_the_largest_efficient_tp():
    rec, v = scaling_report({1: 100.0, 2: 55.0, 4: 29.0, 8: 19.0}, tol=0.2)
    assert rec == 4
    assert [x.efficient for x in v] == [True, True, True, False]
    assert "not efficient" in v[3].reason and "66%" in v[3].reason
    assert scaling_report({1: 10.0, 2: 9.0})[0] == 1
    with pytest.raises(ValueError, match="TP=1"):
        scaling_report({2: 1.0})


def test_an_unreachable_hub_is_not_asked(monkeypatch):
    """An offline node: the hub client would retry for ~23 s per lookup; the probe says no and the cache answers."""
    hub = FakeHub(monkeypatch, hub=(1234, "abc"), cache=(999, "c0ffee"), reachable=False)
    assert load_model_dims("acme/Private-7B").source == "HF cache@c0ffee"
    assert all(local_only for _, local_only in hub.calls)


def test_the_reachability_probe_is_quick_and_goes_through_the_proxy(monkeypatch):
    import socket

    from megatron_tp_overlap import models

    with socket.socket() as s:  # a port nobody listens on: refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    models._reachable.cache_clear()
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.delenv("HTTPS_PROXY", raising=False)
    monkeypatch.delenv("https_proxy", raising=False)
    timeouts = []
    connect = socket.create_connection
    monkeypatch.setattr(
        socket, "create_connection", lambda a, timeout=None: timeouts.append(timeout) or connect(a, timeout)
    )
    assert not models._hub_reachable() and timeouts == [models.PROBE_TIMEOUT_S]  # bounded, whatever the network does
    monkeypatch.setattr(socket, "create_connection", connect)
    with socket.socket() as server:  # a listening "proxy": the probe asks it, not the (closed) endpoint
        server.bind(("127.0.0.1", 0))
        server.listen()
        monkeypatch.setenv("HTTPS_PROXY", f"http://127.0.0.1:{server.getsockname()[1]}")
        assert models._hub_reachable()
    models._reachable.cache_clear()
