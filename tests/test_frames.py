"""engine/frames.py: a trial's frames on a chunk of the data stack of their own, whatever the caller's depth."""

from __future__ import annotations

import resource
import sys

import pytest

from megatron_tp_overlap.engine import frames


def _leaf(k: int) -> int:
    a = b = c = d = k  # a few locals: frames of a realistic size
    return a + b + c + d


def _calls(k: int) -> int:
    x1 = x2 = x3 = x4 = x5 = x6 = 0
    return _leaf(k) + x1 + x2 + x3 + x4 + x5 + x6 if k == 0 else _calls(k - 1)


def _step() -> int:
    """A stand-in for a training step's Python work: the same short call chains, many times."""
    return sum(_calls(5) for _ in range(200))


def _faults_per_step() -> int:
    _step()
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    _step()
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before


def _at_depth(depth: int, fn):
    return fn() if depth == 0 else _at_depth(depth - 1, fn)


@pytest.mark.skipif(not frames.CHUNKED or sys.platform != "linux", reason="CPython >= 3.11 frames, Linux page faults")
def test_a_step_called_at_a_chunks_end_maps_a_chunk_per_call_and_through_fresh_stack_never():
    """Bare, at some caller depths each of the step's call chains crosses a chunk's end: a map, a page fault and an
    unmap per chain (200 per step here). Through ``fresh_stack`` none, at every depth."""
    bare = {d: _at_depth(d, _faults_per_step) for d in range(300)}
    fresh = {d: _at_depth(d, lambda: frames.fresh_stack(_faults_per_step)) for d in range(300)}
    if not any(n >= 150 for n in bare.values()):  # 3.11-3.13 on x86-64: 18 depths of 300
        pytest.skip("no depth crossed a chunk's end here (an interpreter that keeps its chunks): nothing to keep")
    assert max(fresh.values()) <= 2, {d: n for d, n in fresh.items() if n > 2}


def test_fresh_stack_is_the_call_itself():
    """Arguments, keywords, the result and an exception pass through unchanged."""
    assert frames.fresh_stack(divmod, 7, 2) == (3, 1)
    assert frames.fresh_stack(sorted, [3, 1], reverse=True) == [3, 1]
    with pytest.raises(ZeroDivisionError):
        frames.fresh_stack(divmod, 1, 0)
    if frames.CHUNKED:  # the reserve: a frame of its own chunk
        assert frames.fresh_stack.__code__.co_stacksize >= frames.RESERVE_KIB * 1024 // 8


def test_the_searcher_runs_every_trial_through_fresh_stack(monkeypatch):
    """Every trial of a search (racing, looks, brackets, the final decision) starts at the same place of the frame
    stack: the searcher calls ``evaluate`` through ``fresh_stack`` and only so."""
    import random

    from megatron_tp_overlap.engine import search
    from megatron_tp_overlap.engine.space import TuningConfig, build_space
    from megatron_tp_overlap.tools.research import decision_sim as sim
    from megatron_tp_overlap.ub.config import UbConfig

    space = build_space(sim.TOPO, sim.CTX, [UbConfig()])
    world = sim.make_world(space, 0.02, random.Random(3))
    run = sim.SimulatedRun(world, "iid", random.Random(4), 400)
    calls = {"fresh": 0, "evaluate": 0}

    def evaluate(config, steps, warmup):
        calls["evaluate"] += 1
        assert sys._getframe(1).f_code is frames.fresh_stack.__code__  # called from fresh_stack's frame
        return run(config, steps, warmup)

    def counted(fn, *args, **kwargs):
        calls["fresh"] += 1
        return frames.fresh_stack(fn, *args, **kwargs)

    monkeypatch.setattr(search, "fresh_stack", counted)
    ref = TuningConfig(UbConfig(), frozenset(), "reference")
    opts = search.SearchOptions(max_seconds=30)
    search.Searcher(sim.TOPO, space, evaluate, sim.CTX, opts).run(ref, {})
    assert calls["evaluate"] > 20 and calls["fresh"] == calls["evaluate"]
