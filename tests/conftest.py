import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # tests/fakes.py

import pytest  # noqa: E402


@pytest.fixture
def fake_te(monkeypatch):
    """TE's userbuffers registry replaced by tests/fakes.FakeTE (for the switcher and fake modules)."""
    import fakes

    from megatron_tp_overlap.engine import switcher as ub_runtime

    te = fakes.FakeTE()
    monkeypatch.setattr(fakes, "STATE", te)
    monkeypatch.setattr(ub_runtime, "_te_base", lambda: te)
    return te


@pytest.fixture(autouse=True)
def _no_hub(monkeypatch):
    """Tests never reach the Hugging Face hub (CI has no network); tests of the hub path mock it."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
