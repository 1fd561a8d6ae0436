import multiprocessing as mp

import pytest

from megatron_tp_overlap.cache import CacheKey, TunedConfigCache
from megatron_tp_overlap.presets import PRESETS

KEY = CacheKey("NVIDIA H200", 4, 8192, 4096, 14336, 32, "bf16", "2.20.2")


def test_put_get_round_trip_and_keying(tmp_path):
    c = TunedConfigCache(tmp_path)
    cfg = PRESETS["userbuffers_bf16_h100_h8192_tp4_mbs1_seqlen8192"]
    assert c.get(KEY) is None
    c.put(KEY, cfg, {"step_ms": 21.3})
    got, meta = c.get(KEY)
    assert got == cfg and meta["step_ms"] == 21.3
    for other in (CacheKey(**{**KEY.__dict__, "tp": 2}), CacheKey(**{**KEY.__dict__, "te_version": "2.21.0"}),
                  CacheKey(**{**KEY.__dict__, "gpu": "NVIDIA H100 80GB HBM3"}), CacheKey(**{**KEY.__dict__, "dtype": "fp8"})):
        assert c.get(other) is None


def test_corrupt_entries_are_ignored_with_a_warning(tmp_path):
    c = TunedConfigCache(tmp_path)
    path = c.put(KEY, PRESETS["te_default"])
    path.write_text("qkv_fprop: {method: [\n")  # truncated YAML
    with pytest.warns(UserWarning, match="corrupt"):
        assert c.get(KEY) is None
    c.put(KEY, PRESETS["te_default"])
    path.with_suffix(".json").write_text("{not json")
    with pytest.warns(UserWarning, match="corrupt"):
        assert c.get(KEY) is None


def _writer(root, i):
    c = TunedConfigCache(root)
    cfg = list(PRESETS.values())[i % len(PRESETS)]
    for _ in range(20):
        c.put(KEY, cfg, {"writer": i})


def test_concurrent_writers_leave_a_valid_entry(tmp_path):
    procs = [mp.get_context("spawn").Process(target=_writer, args=(str(tmp_path), i)) for i in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    cfg, meta = TunedConfigCache(tmp_path).get(KEY)
    assert cfg == list(PRESETS.values())[meta["writer"] % len(PRESETS)]  # yaml and json from the same writer
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".") and p.name != ".lock"]  # no temp files left
