import dataclasses
import multiprocessing as mp

import pytest

from megatron_tp_overlap.engine.cache import TunedConfigCache, TuningKey
from megatron_tp_overlap.ub.presets import PRESETS

KEY = TuningKey(
    gpu="NVIDIA H200",
    te_version="2.20.2",
    tp=4,
    cp=1,
    tokens=8192,
    hidden=4096,
    ffn=14336,
    heads=32,
    kv_groups=8,
    kv_channels=128,
    gated_mlp=True,
    dtype="bf16",
    bf16_edge_layers=False,
    rs_dgrad=False,
    reference="0" * 12,
    space="yaml_only",
)


def test_round_trip_keeps_switched_off_gemms_and_every_key_field_matters(tmp_path):
    c = TunedConfigCache(tmp_path)
    cfg = PRESETS["userbuffers_bf16_h100_h8192_tp4_mbs1_seqlen8192"]
    assert c.get(KEY) is None
    c.put(KEY, cfg, frozenset({"qkv_wgrad"}), {"step_ms": 21.3})
    got = c.get(KEY)
    assert got.ub == cfg and got.disabled == {"qkv_wgrad"} and got.meta["step_ms"] == 21.3
    changed = {
        "gpu": "NVIDIA H100",
        "te_version": "2.21.0",
        "tp": 2,
        "cp": 2,
        "tokens": 4096,
        "hidden": 5120,
        "ffn": 25600,
        "heads": 64,
        "kv_groups": None,
        "kv_channels": 80,
        "gated_mlp": False,
        "dtype": "fp8",
        "bf16_edge_layers": True,
        "rs_dgrad": True,
        "reference": "1" * 12,
        "space": "allow_off",
        "moe": "experts=8,topk=2,ffn=1024,shared=2048",
    }
    assert set(changed) == {f.name for f in dataclasses.fields(TuningKey)}  # a new key field gets a case here
    for k, v in changed.items():
        assert c.get(dataclasses.replace(KEY, **{k: v})) is None, k


def test_a_dense_models_key_is_stored_as_before_moe_support(tmp_path):
    """An entry written before the key had ``moe`` (every entry until then: dense models) is still found: the dense key
    keeps its digest and its stored form; an MoE key differs from the dense one of the same shapes."""
    import hashlib
    import json

    old = {f.name: getattr(KEY, f.name) for f in dataclasses.fields(TuningKey) if f.name != "moe"}
    assert KEY.digest() == hashlib.sha256(json.dumps(old, sort_keys=True).encode()).hexdigest()[:16]
    c = TunedConfigCache(tmp_path)
    c.put(KEY, PRESETS["userbuffers_bf16_h100_h8192_tp4_mbs1_seqlen8192"])
    meta = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert meta["key"] == old and c.get(KEY) is not None
    assert dataclasses.replace(KEY, moe="experts=8").digest() != KEY.digest()


def test_corrupt_or_mismatched_entries_are_ignored_with_a_warning(tmp_path):
    c = TunedConfigCache(tmp_path)
    path = c.put(KEY, PRESETS["te_default"])
    path.write_text("qkv_fprop: {method: [\n")  # truncated YAML
    with pytest.warns(UserWarning, match="corrupt"):
        assert c.get(KEY) is None
    c.put(KEY, PRESETS["te_default"])
    path.with_suffix(".json").write_text("{not json")
    with pytest.warns(UserWarning, match="corrupt"):
        assert c.get(KEY) is None
    c.put(KEY, PRESETS["te_default"])
    path.write_text("qkv_dgrad: {method: bulk, num_sm: 2}\n")  # a YAML that is not the one its metadata describes
    with pytest.warns(UserWarning, match="does not match"):
        assert c.get(KEY) is None


def _writer(root, i):
    c = TunedConfigCache(root)
    cfg = list(PRESETS.values())[i % len(PRESETS)]
    for _ in range(20):
        c.put(KEY, cfg, meta={"writer": i})


def test_concurrent_writers_leave_a_valid_entry(tmp_path):
    procs = [mp.get_context("fork").Process(target=_writer, args=(str(tmp_path), i)) for i in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    got = TunedConfigCache(tmp_path).get(KEY)
    assert got.ub == list(PRESETS.values())[got.meta["writer"] % len(PRESETS)]  # yaml and json from the same writer
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".") and p.name != ".lock"]  # no temp files left


def test_a_reused_config_is_numerics_checked_once_and_dropped_when_it_fails(tmp_path):
    """Megatron's reuse path (rank 0 reads the cache, every rank gets the answer): the cached config goes live only
    after the numerics check passes in this run; a failing one puts the starting config back and tuning runs."""
    import torch.distributed as dist

    from megatron_tp_overlap.engine.space import TuningConfig
    from megatron_tp_overlap.integrations.megatron.tuning import _reuse
    from megatron_tp_overlap.ub.config import UbConfig

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        cache = TunedConfigCache(tmp_path / "cache")
        preset = next(iter(PRESETS.values()))
        cache.put(KEY, preset, frozenset({"fc2_wgrad"}), {"date": "2026-11-23"})
        applied, logs = [], []

        class Switcher:
            def apply(self, c):
                applied.append(c.label)

            def close(self):
                applied.append("closed")

        def check(verdict):
            return lambda c: (verdict, Switcher())

        out = tmp_path / "tuned.yaml"
        assert _reuse(cache, KEY, UbConfig(), out, logs.append, check("rel. error 1.3 > 0.02")) is None
        # back to the reference, and the check's switcher is done (tuning again makes its own)
        assert applied == ["reference", "closed"] and not out.exists() and "fails the numerics check" in logs[-1]
        config, _ = _reuse(cache, KEY, UbConfig(), out, logs.append, check(None))
        assert config == TuningConfig(preset, frozenset({"fc2_wgrad"})) and out.exists()
        assert "numerics checked in this run" in logs[-1]
    finally:
        dist.destroy_process_group()
