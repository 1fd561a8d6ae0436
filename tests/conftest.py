import gc
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


def pytest_collection_finish(session):
    """Freeze what collection imported (torch's ~170k objects among it) out of the garbage collector's full
    collections: the simulated searches allocate fast and each full collection walked it all (about 8% of a
    simulated search's CPU), and a forked rank that walks it copies the pages it touches (``gc.freeze``'s own use case)."""
    gc.collect()
    gc.freeze()


@pytest.fixture
def thawed_heap():
    """A heap that nobody froze, for the tests of what freezing it does (engine/heap.py); the suite's freeze is made
    again after."""
    gc.unfreeze()
    yield
    gc.unfreeze()
    gc.collect()
    gc.freeze()
