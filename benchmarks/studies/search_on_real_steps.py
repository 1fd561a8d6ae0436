"""The search's decisions on real GPU steps: the tuner's search, unchanged, on Megatron-LM's own trial steps (TP=1,
one GPU), where the true cost of every config is known because it was put there.

    python benchmarks/studies/search_on_real_steps.py --script .device/megatron-lm/pretrain_gpt.py --out DIR

``tools/decision_sim.py`` scores the search on simulated steps; its noise models were fitted to H200 measurements,
but a model is a model. Here every step is a real one: Megatron's ``forward_backward_func`` on a real GPT
(``MegatronSteps.step``, as tuning runs it), per-slot GPU times from the tuner's own ``SlotTimer``, a simulated
switch between configs (one ``gc.collect()``, a device sync and ``--idle-s`` with the GPU idle, as a userbuffers
re-init leaves it, the host asleep or, ``--switch-busy``, spinning; the heap frozen as during tuning), and the search's
default options and time budget. What is not real is the cost of a config: each seed draws a world as the simulator
does (``decision_sim.make_world``: 1-3 GEMMs with a truly faster option, together ``gain`` of the step; or none,
``equal``), and every qkv/proj/fc1/fc2
module's forward (its fprop) and backward (its dgrad + wgrad) is made slower by a ``torch.cuda._sleep`` of that
GEMM's excess over its cheapest option (``World.excess_ms``, scaled from the simulator's 100 ms step to this one),
inside the slot's events. So the noise, drift, clocks after idle gaps and host effects are those of a real run,
and the answer is known: realized share of the available gain, the chosen config's true excess over the
reference, false winners where every config costs the same. Userbuffers' own noise (TP communication) is not in
it: that needs a multi-GPU run.

What the delays show is measured too, since a host-bound slot can absorb part of its delay (GLM-4-9B-like FP8's
attention forwards on one H200, results/2026-11-28_h200x4b/): at the start, per slot, the share of a delay of 1% of
the step that shows in the slot and on the step (``slot_visibility``), and around each search with a gain, the world's
gain on whole steps (``gain_on_steps``). ``real_steps_bar.py`` scores the searches on what the slots show as well.

Runs alternate between seeds with a gain and ``equal`` seeds until ``--runs`` or ``--minutes`` is reached; each run's
result is written as it ends (``search_on_real_steps.json``), and the table is printed last. ``--runs 1 --repeat N``:
one world searched N times (a worst seed, again: is it the world or the moment?). ``--preset``: worlds with
2-3 truly faster options and a preset-like whole config among the contenders, between the reference and the best (as
``decision_sim --preset``; on H200 the closest NeMo preset ran 1-2% behind the best config). ``--variants
select_passes=1 select_passes=3`` (or ``--select-passes 1 3``): each seed searched once per variant of the search
options on the same world, in alternating order (a paired comparison on the same real steps); ``--variants
max_steps=400 max_steps=0``: the old 400-step limit against the seconds alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # the studies, then the benchmarks they build on
from trial_noise import SWITCH_IDLE_S  # noqa: E402


def overlap_modules(model) -> list:
    """The TE linears of a TP=1 Megatron GPT as the tuner sees them at TP>1 (no userbuffers at TP=1, so named by
    their Megatron path; every GEMM counted as overlapped: 12 slots' worth of GEMMs, as in the simulator). In an MoE
    model the routed experts are left out (they never overlap) and a shared expert's fc1/fc2 have the flags
    megatron-core gives them at TP>1 (the AG/RS only): slots of their own (``shared_fc1.fwd``, ...)."""
    from megatron_tp_overlap.engine.topology import COLUMN_FLAGS, ROW_FLAGS, OverlapModule
    from megatron_tp_overlap.integrations.megatron.coverage import ROLES

    flags = {  # every flag on, but a column module's dgrad as bulk (a reduce-scatter dgrad would drop its wgrad)
        "column": {f: f != "ub_overlap_rs_dgrad" for f in COLUMN_FLAGS},
        "row": dict.fromkeys(ROW_FLAGS, True),
        "shared column": {f: f == "ub_overlap_ag_fprop" for f in COLUMN_FLAGS},
    }
    found = []
    for i, chunk in enumerate(model):
        for path, m in chunk.named_modules():
            name = ROLES.get(path.rsplit(".", 1)[-1])
            shared = "shared_experts" in path
            if name is None or (".experts." in path and not shared):  # routed experts: no userbuffers
                continue
            kind = "row" if name in ("proj", "fc2") else "column"
            found.append(
                OverlapModule(
                    m, kind, name, f"{i}.{path}", flags["shared column" if shared and kind == "column" else kind]
                )
            )
    return found


class Delays:
    """A ``torch.cuda._sleep`` after each module's forward and after its backward, inside the ``SlotTimer``'s events
    (these hooks are registered first, the timer's per trial, and hooks run in registration order). How often each
    slot runs in a step is counted on real steps (:meth:`count`): a recomputed forward (activation recompute) runs
    twice, and an MoE model's dense fc1/fc2 only in its dense layers. With ``host_trace`` (``--host-trace``; no
    pre-hook otherwise), while ``host`` is a dict each forward slot adds the host seconds its module calls take to it
    (from a pre-hook to the forward hook: Python and kernel launches), ``cpu`` the thread's CPU seconds in them (less
    than the host's where the thread waited: blocked in a launch, or not on a core), and ``faults`` its minor page
    faults in them (a search's trials faulted 94-225 times per step, the same trials replayed after it 8-12, in
    `proj.fwd`, `fc1.fwd` and `fc2.fwd` by the kind of trial: the frame stack's, results/2026-11-30_h200x2i/)."""

    def __init__(self, modules: list, calls_per_step: int, ms_per_cycle: float, host_trace: bool = False):
        from megatron_tp_overlap.engine.measure import _first_tensor, module_node

        self.cycles: dict[str, int] = {}  # slot ("qkv.fwd") -> cycles per call
        self.calls, self.per_cycle = calls_per_step, ms_per_cycle
        self.slot_calls: dict[str, int] = {}  # slot -> calls per step, once counted
        self.counting: dict[str, int] | None = None
        self.host_trace = host_trace
        self.host: dict[str, float] | None = None  # slot -> host seconds in its module calls (``--host-trace``)
        self.cpu: dict[str, float] = {}  # slot -> the thread's CPU seconds in them (while ``host`` is a dict)
        self.faults: dict[str, int] = {}  # slot -> the thread's minor page faults in them (while ``host`` is a dict)
        began: dict[str, tuple[float, float, int]] = {}
        import resource

        import torch

        def minflt() -> int:
            return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt

        def sleep(slot: str) -> None:
            if self.counting is not None:
                self.counting[slot] = self.counting.get(slot, 0) + 1
            if self.cycles.get(slot, 0) > 0:
                torch.cuda._sleep(self.cycles[slot])

        def pre(prefix: str):
            def hook(module, args):
                if self.host is not None:
                    began[prefix] = time.perf_counter(), time.thread_time(), minflt()

            return hook

        def fwd(prefix: str):
            def hook(module, args, out):
                if self.host is not None and prefix in began:
                    slot, (wall, cpu, flt) = f"{prefix}.fwd", began.pop(prefix)
                    self.host[slot] = self.host.get(slot, 0.0) + time.perf_counter() - wall
                    self.cpu[slot] = self.cpu.get(slot, 0.0) + time.thread_time() - cpu
                    self.faults[slot] = self.faults.get(slot, 0) + minflt() - flt
                sleep(f"{prefix}.fwd")
                t = _first_tensor(out)
                node = module_node(t) if t is not None and t.requires_grad else None
                if node is not None:
                    node.register_hook(lambda gi, go: sleep(f"{prefix}.bwd"))

            return hook

        for m in modules:
            if host_trace:
                m.module.register_forward_pre_hook(pre(m.slot_prefix))
            m.module.register_forward_hook(fwd(m.slot_prefix))

    def count(self, step) -> dict[str, int]:
        """Calls per slot in one real ``step``."""
        self.counting = {}
        step()
        self.slot_calls, self.counting = self.counting, None
        return self.slot_calls

    def set(self, slot_ms: dict[str, float]) -> None:
        """Per slot, the extra GPU ms of one step (spread over the slot's calls in a step)."""
        self.cycles = {s: int(ms / self.slot_calls.get(s, self.calls) / self.per_cycle) for s, ms in slot_ms.items()}


def thread_os() -> dict[str, float]:
    """The calling thread's core now and its counters (``getrusage(RUSAGE_THREAD)``): user and system CPU seconds,
    voluntary and involuntary context switches, minor page faults; and the process's (every thread's: the backward
    runs on autograd's device thread) system CPU seconds and minor page faults. Linux only."""
    import resource

    with open("/proc/thread-self/stat") as f:
        core = int(f.read().rsplit(")", 1)[1].split()[36])  # field 39, "processor"
    r, p = resource.getrusage(resource.RUSAGE_THREAD), resource.getrusage(resource.RUSAGE_SELF)
    return {
        "core": core,
        "user": r.ru_utime,
        "sys": r.ru_stime,
        "vcsw": r.ru_nvcsw,
        "ivcsw": r.ru_nivcsw,
        "faults": r.ru_minflt,
        "proc_sys": p.ru_stime,
        "proc_faults": p.ru_minflt,
    }


def os_delta(before: dict[str, float], after: dict[str, float], wall_s: float, steps: int) -> dict:
    """What the thread did over a trial's measured steps (and the device sync that ends them): its core at the start
    and the end, user and system CPU ms per step against the wall's, and its context switches (voluntary: it waited;
    involuntary: it was preempted); per step its minor page faults, and the process's system CPU ms and faults (on
    2 x H200 the thread's system time was 0.97-1.54 ms per step in a search's trials and 0.25-0.35 in the same trials
    replayed after it: results/2026-11-30_h200x2h/ rp2)."""
    per = 1000 / max(steps, 1)
    out = {
        "cores": [before["core"], after["core"]],
        "wall_ms": round(per * wall_s, 3),
        "user_ms": round(per * (after["user"] - before["user"]), 3),
        "sys_ms": round(per * (after["sys"] - before["sys"]), 3),
        "vcsw": after["vcsw"] - before["vcsw"],
        "ivcsw": after["ivcsw"] - before["ivcsw"],
    }
    if "faults" in before:
        out["faults"] = round((after["faults"] - before["faults"]) / max(steps, 1), 1)
        out["proc_sys_ms"] = round(per * (after["proc_sys"] - before["proc_sys"]), 3)
        out["proc_faults"] = round((after["proc_faults"] - before["proc_faults"]) / max(steps, 1), 1)
    return out


class RealSteps:
    """``evaluate`` for the searcher on real steps; a config's cost is the world's, put in by ``Delays``."""

    def __init__(
        self,
        steps,
        modules,
        topo,
        delays: Delays,
        idle_s: float,
        scale: float,
        busy: bool = False,
    ):
        self.steps, self.modules, self.topo, self.delays = steps, modules, topo, delays
        self.idle_s, self.scale, self.busy = idle_s, scale, busy  # busy: the switch spins (``--switch-busy``)
        self.host_ms: list[dict[str, float] | None] = []
        self.os_stats: list[dict | None] = []  # per call with ``--host-trace``: os_delta of its measured steps
        self.world, self.live, self.t0, self.switches = None, None, 0.0, 0
        self.gaps_ms: list[float] = []  # per call, the host ms since the last call ended: the search's own work
        self.switched: list[bool] = []  # per call, whether a simulated switch came first
        self.ended = 0.0  # when the last call ended (perf_counter s)

    def start(self, world) -> None:
        self.world, self.live, self.t0, self.switches = world, None, time.perf_counter(), 0
        self.gaps_ms, self.switched, self.ended, self.host_ms, self.os_stats = [], [], self.t0, [], []

    def slot_excess_ms(self, config) -> dict[str, float]:
        """A GEMM's excess spread over the slots it runs in (a shared expert runs fc1/fc2's configs): the step's
        put-in total is the world's."""
        slots = self.topo.slots()
        share = {g: sum(g in gemms for gemms in slots.values()) for gemms in slots.values() for g in gemms}
        return {
            s: self.scale * sum(self.world.excess_ms(g, config) / share[g] for g in gemms) for s, gemms in slots.items()
        }

    def _timed(self, n: int) -> tuple[dict[str, list[float]], list[float]]:
        """``n`` steps timed by the tuner's ``SlotTimer`` (no host sync between them): per slot and per step, ms."""
        import torch

        from megatron_tp_overlap.engine.measure import SlotTimer

        timer = SlotTimer(self.modules)
        with timer:
            for _ in range(n):
                timer.begin_step()
                self.steps.step()
                timer.end_step()
            torch.cuda.synchronize()
            return timer.collect(list(self.topo.slots()))

    def measure_with(self, slot_ms: dict[str, float], steps: int = 5) -> tuple[dict[str, float], float]:
        """Mean ms per slot and per step of ``steps`` steps with the delays ``slot_ms`` put in (``Delays.set``), after
        one warm-up step: outside the search (the next trial switches again)."""
        self.delays.set(slot_ms)
        self.live = None
        self.steps.step()
        per_slot, step_ms = self._timed(steps)
        return {s: statistics.fmean(v) for s, v in per_slot.items() if v}, statistics.fmean(step_ms)

    def measure_of(self, config, steps: int = 5) -> tuple[dict[str, float], float]:
        """Mean ms per slot and per step of ``config`` (its delays put in; :meth:`measure_with`)."""
        return self.measure_with(self.slot_excess_ms(config), steps)

    def step_ms_of(self, config) -> float:
        """Mean ms of a step of ``config`` (:meth:`measure_of`)."""
        return self.measure_of(config)[1]

    def trial_of(self, config, steps: int, warmup: int) -> tuple[dict[str, float], float]:
        """Median ms per slot and per step of a racing trial of ``config``: always after a simulated switch."""
        self.live = None
        m = self(config, steps, warmup)
        return {s: statistics.median(v) for s, v in m.slot_ms.items() if v}, statistics.median(m.step_ms)

    def __call__(self, config, n: int, warmup: int):
        from trial_noise import simulated_switch

        from megatron_tp_overlap.engine.search import Measurement

        t = time.perf_counter()
        self.gaps_ms.append(round(1000 * (t - self.ended), 2))
        self.switched.append(config != self.live)
        if config != self.live:
            simulated_switch(self.idle_s, self.busy)
            self.delays.set(self.slot_excess_ms(config))
            self.live, self.switches = config, self.switches + 1
        for _ in range(warmup):
            self.steps.step()
        traced = self.delays.host_trace
        self.delays.host, self.delays.cpu, self.delays.faults = ({} if traced else None), {}, {}  # per call
        before, t_steps = thread_os() if traced else None, time.perf_counter()
        slot_ms, step_ms = self._timed(n)
        wall = time.perf_counter() - t_steps
        host, self.delays.host = self.delays.host, None
        self.host_ms.append({s: round(1000 * v / max(n, 1), 4) for s, v in host.items()} if host is not None else None)
        if before is not None:
            cpu = {s: round(1000 * v / max(n, 1), 4) for s, v in self.delays.cpu.items()}
            faults = {s: round(v / max(n, 1), 1) for s, v in self.delays.faults.items()}
            self.os_stats.append(os_delta(before, thread_os(), wall, n) | {"cpu_ms": cpu, "faults_in": faults})
        else:
            self.os_stats.append(None)
        now = self.ended = time.perf_counter()
        return Measurement(slot_ms, step_ms, now - self.t0, n + warmup, now - t)


def slot_visibility(measure, slots: list[str], delay_ms: float, rounds: int = 6) -> dict[str, dict[str, float]]:
    """Per slot, the share of a delay put in that slot alone that shows in the slot's own measurement (``in_slot``)
    and on the whole step (``on_step``). ``measure(slot)``: (per slot ms, step ms) with ``delay_ms`` put in ``slot``
    (None: none; :meth:`RealSteps.measure_with`), in ``rounds`` ABBA-ordered pairs; the median pair's difference over
    ``delay_ms``. The study scores a search against the delays it puts in. A slot that absorbs part of its delay
    breaks that: GLM-4-9B-like FP8's attention forwards on one H200 showed 30% and 60% of a delay taken out in their
    own slots (results/2026-11-28_h200x4b/), and then a gain put in there is not one the steps have."""
    out = {}
    for s in slots:
        own, step = [], []
        for r in range(rounds):
            m = {k: measure(k) for k in ((None, s) if r % 2 == 0 else (s, None))}
            own.append(m[s][0][s] - m[None][0][s])
            step.append(m[s][1] - m[None][1])
        med = lambda v: round(statistics.median(v) / delay_ms, 3)  # noqa: E731
        out[s] = {"in_slot": med(own), "on_step": med(step)}
    return out


def probe_delays(real: RealSteps) -> dict:
    """Whole-step GPU ms of the reference and of "no overlap" in a world with a 3% gain, against the difference
    the world says they have: the put-in delays are really there (medians of 7 steps each)."""
    from trial_noise import gpu_ms

    from megatron_tp_overlap.engine.space import TuningConfig, all_off, build_space
    from megatron_tp_overlap.tools.research import decision_sim as sim
    from megatron_tp_overlap.ub.config import UbConfig

    world = sim.make_world(build_space(sim.TOPO, sim.CTX, [UbConfig()]), 0.03, random.Random(0))
    ref = TuningConfig(UbConfig(), frozenset(), "reference")
    real.start(world)
    out = {}
    for name, cfg in (("reference", ref), ("no overlap", all_off(real.topo, ref))):
        real.delays.set(real.slot_excess_ms(cfg))
        out[f"{name}_ms"] = statistics.median(gpu_ms(real.steps.step) for _ in range(7))
    out["true_difference_ms"] = real.scale * (world.step_ms(all_off(real.topo, ref)) - world.step_ms(ref))
    real.delays.set({})
    return out


def gain_on_steps(real, ref, best, rounds: int = 6) -> float:
    """The world's available gain as whole steps show it (ms per step): ``real.step_ms_of`` the reference and the best
    config in ``rounds`` pairs, ABBA order, and the median pair's difference. On a host-bound step a delay put in one
    slot can fill a gap where the GPU waits for the host, so less of it shows on the step than was put in
    (GLM-4-9B-like FP8 on one H200: 1.57 of 5.26 ms in ``probe_delays``; results/2026-11-28_h200x4b/)."""
    diffs = []
    for r in range(rounds):
        order = (ref, best) if r % 2 == 0 else (best, ref)
        ms = {cfg: real.step_ms_of(cfg) for cfg in order}
        diffs.append(ms[ref] - ms[best])
    return round(statistics.median(diffs), 3)


MISS_PAIRS = 40  # ABBA pairs per miss (miss_shown): a host-bound slot's pairs spread 0.1-0.25 ms (0.02-0.04 ms se)
MISS_STEPS = 8  # steps per measurement there: twice a racing trial's (SearchOptions.halving_steps)


def miss_shown(measure, slots: list[str], pairs: int = MISS_PAIRS) -> dict[str, dict[str, float]]:
    """Per slot in ``slots`` (those where the chosen config keeps a delay the best takes out): how much of that delay,
    at its own size, the slot's own measurement and the whole step show. ``measure(which)`` for "best" and "chosen":
    (per slot ms, step ms); ``pairs`` ABBA-ordered pairs; mean and standard error of chosen minus best (ms). What a
    host-bound slot shows of a delay varies with its size and the moment, so ``slot_visibility``'s share of 1% of a
    step does not say what a miss costs (Granite-3-8B-like FP8's proj.fwd on H200: 60-66% of a 0.30 ms delay; of the
    0.133-0.154 ms one a search left, 0.01-0.15 ms in four measurements; results/2026-11-28_h200x2b/)."""
    own: dict[str, list[float]] = {s: [] for s in slots}
    step = []
    for r in range(pairs):
        m = {k: measure(k) for k in (("best", "chosen") if r % 2 == 0 else ("chosen", "best"))}
        for s in slots:
            own[s].append(m["chosen"][0][s] - m["best"][0][s])
        step.append(m["chosen"][1] - m["best"][1])

    def mean_se(v: list[float]) -> tuple[float, float]:
        return round(statistics.fmean(v), 4), round(statistics.stdev(v) / math.sqrt(len(v)), 4)

    on_step, on_step_se = mean_se(step)
    out = {}
    for s in slots:
        in_slot, se = mean_se(own[s])
        out[s] = {"in_slot_ms": in_slot, "in_slot_se_ms": se, "on_step_ms": on_step, "on_step_se_ms": on_step_se}
    return out


MISS_CHECKS = {  # miss_checks' four measurements, as real_steps_bar.py names them
    "miss_shown": "on steps",
    "miss_in_trials": "in racing trials",
    "miss_in_trials_frozen": "frozen heap",
    "miss_in_trials_on_reference": "against the reference",
}


def miss_checks(real: RealSteps, pick: dict, missed: list[str], options) -> dict[str, dict]:
    """:func:`miss_shown` of the delays left in ``missed`` four ways, to tell why a search's looks missed a gain that
    steps show (Granite-3-8B-like FP8 22500 on H200: 32-40 looks read -0.01 to +0.03 ms of a 0.154 ms delay that 40
    pairs of steps right after showed at 0.10-0.15; results/2026-11-28_h200x2b/): ``miss_shown`` on steps that follow
    steps (as training runs); ``miss_in_trials`` in racing trials, each after a switch; ``miss_in_trials_frozen``
    the same in the frozen heap (as the search's trials run); ``miss_in_trials_on_reference`` the same with the
    reference's delays in every other slot (the looks' incumbent is the reference), the faster options against it.
    ``pick``: the configs by name ("best", "chosen", "best on reference", "reference")."""
    from megatron_tp_overlap.engine import heap

    def trials(fast: str, slow: str):
        names = {"best": fast, "chosen": slow}
        return lambda w: real.trial_of(pick[names[w]], options.halving_steps, options.warmup_steps)

    out = {"miss_shown": miss_shown(lambda w: real.measure_of(pick[w], MISS_STEPS), missed)}
    out["miss_in_trials"] = miss_shown(trials("best", "chosen"), missed)
    with heap.frozen():
        out["miss_in_trials_frozen"] = miss_shown(trials("best", "chosen"), missed)
    out["miss_in_trials_on_reference"] = miss_shown(trials("best on reference", "reference"), missed)
    return out


def slot_gains(real, ref, best, chosen) -> dict[str, list[float]]:
    """Per slot with a gain: [the delay (ms) the best config takes out of the reference's, the chosen config's]."""
    r, b, c = (real.slot_excess_ms(x) for x in (ref, best, chosen))
    return {s: [round(r[s] - b[s], 4), round(r[s] - c[s], 4)] for s in r if r[s] - b[s] > 0 or r[s] - c[s] != 0}


def one_search(
    real: RealSteps,
    seed: int,
    gain: float,
    preset: bool = False,
    variant: str = "",
    trace: tuple[str, ...] = (),
    replay: tuple[str, ...] = (),
    deadline: float = math.inf,
) -> dict:
    from megatron_tp_overlap.engine import heap
    from megatron_tp_overlap.engine.search import Searcher, SearchOptions
    from megatron_tp_overlap.engine.space import TuningConfig, all_off, apply, build_space
    from megatron_tp_overlap.tools.research import decision_sim as sim
    from megatron_tp_overlap.ub.config import UbConfig

    rng = random.Random(seed)
    space = build_space(sim.TOPO, sim.CTX, [UbConfig()])
    world = sim.make_world(space, gain, rng, fewest=2 if preset else 1)
    ref = TuningConfig(UbConfig(), frozenset(), "reference")
    baselines = {"no overlap": all_off(real.topo, ref)}
    if preset and (p := sim.preset_of(world, space, ref)) is not None:
        baselines["preset"] = p
    options = SearchOptions(**parse_variant(variant))
    best = sim.best_config(world, space, ref)
    real.world = world  # the gain as whole steps show it, just before the search and just after
    on_steps = [gain_on_steps(real, ref, best)] if gain > 0 else []
    real.start(world)
    with heap.frozen():  # as tuning does
        say = lambda line: print(f"[seed {seed}] {line}", flush=True)  # noqa: E731 - the search's own lines
        searcher = Searcher(real.topo, space, real, sim.CTX, options, log=say)
        res = searcher.run(ref, baselines)
        replayed = []
        if replay:  # the looks again, the search's heap and objects as they were (look_replay.py)
            import look_replay

            n = len(res.trials)
            replayed = look_replay.searched(res.trials, real.gaps_ms[:n], real.host_ms[:n], real.os_stats[:n])
            # the searcher and what it holds stay alive through the replay: the steps meet the search's heap (its
            # trials faulted 94-225 times per step, replayed with the searcher let go 8-12; results/2026-11-30_h200x2i/)
            replayed += look_replay.replay(real, res.trials, real.gaps_ms[:n], replay, options.warmup_steps, deadline)
        del searcher
    on_steps += [gain_on_steps(real, ref, best)] if gain > 0 else []
    ref_ms, chosen_ms = world.step_ms(ref), world.step_ms(res.best)
    best_ms = world.step_ms(best)
    realized = (ref_ms - chosen_ms) / (ref_ms - best_ms) if ref_ms > best_ms else None
    false_winner = gain <= 0 and res.best_name != "reference"
    # the GEMMs a miss is about: the world's faster ones a gain left, or the choices a false winner accepted
    about = {g for g, _ in world.fast} if gain > 0 else {g for g, c in res.choices.items() if c.get("accepted")}
    traced = [s for s, gemms in real.topo.slots().items() if about & set(gemms)]
    gains = slot_gains(real, ref, best, res.best) if gain > 0 else {}
    missed, pick = [s for s, (b, c) in gains.items() if b - c > 1e-4], {"best": best, "chosen": res.best}
    on_ref = ref  # the reference with the world's faster options of the slots left: the looks' other slots' delays
    for g, label in world.fast:
        if any(g in real.topo.slots()[s] for s in missed):
            on_ref = apply(on_ref, next(o for o in space[g] if o.label == label), real.topo)
    pick |= {"best on reference": on_ref, "reference": ref}
    d = res.decision
    decided = next((c.config for c in res.contenders if c.name == d.get("candidate")), ref)
    return {
        "seed": seed,
        "variant": variant or "defaults",
        "select_passes": options.select_passes,
        "max_steps": options.max_steps,
        "preset_excess_pct": round(100 * (world.step_ms(baselines["preset"]) - best_ms) / sim.STEP_MS, 3)
        if "preset" in baselines
        else None,  # the preset-like contender's true cost over the best config, % of the step
        "kind": "gain" if gain > 0 else "equal",
        "available_gain_pct": round(100 * (ref_ms - best_ms) / sim.STEP_MS, 3),
        "gain_put_in_ms": round(real.scale * (ref_ms - best_ms), 3),
        "gain_on_steps_ms": on_steps,  # measured on whole steps before and after the search (gain_on_steps)
        # per slot, the delay put in (ms) the best config and the chosen one take out of the reference's: with
        # slot_visibility, the gain scored on what the slots show (real_steps_bar.py)
        "slot_gain_ms": gains,
        "realized": realized,
        "excess_pct": round(100 * (chosen_ms - ref_ms) / sim.STEP_MS, 3),  # true, of the simulated step
        "false_winner": false_winner,
        "chosen": res.best_name,
        "reason": res.reason,
        "steps": res.steps_run,
        "seconds": round(res.elapsed_s, 1),
        "switches": real.switches,
        "budget_hit": res.budget_hit,
        "search_end": res.search_end,  # why the racing rounds ended
        "cut_short": res.cut_short,
        "phase_seconds": phase_seconds(res.trials),
        "choices_accepted": sorted(g for g, c in res.choices.items() if c.get("accepted")),
        "decision_quadruples": d.get("quadruples"),
        "decision_ran_on_under_worth": d.get("ran_on_under_worth"),  # the looks that ran on (decision.py)
        "decision_level": d.get("level"),  # of the look that ended the ABBA
        "later_passes": {k: v.get("chosen") for k, v in d.items() if k.endswith("_pass")},  # what each took (passes.py)
        "decision_half_width_pct": d.get("noise_pct_of_step"),
        "decision_gain_ms": d.get("slot_interval", {}).get("gain_ms"),  # measured in the overlapped layers
        "decision_step_gain_ms": d.get("step_interval", {}).get("gain_ms"),  # measured on the whole step
        # ... and in the overlapped layers once the rest of the step is taken out: the rest guard's interval (the
        # slots' own where the slots did not read the candidate faster)
        "decision_rest_adjusted": d.get("rest_adjusted_interval"),
        "true_gain_of_decided_ms": round(real.scale * (ref_ms - world.step_ms(decided)), 3) if d else None,
        "reference_step_ms": d.get("reference_step_ms"),
        "confirm_blocks": confirm_blocks(res.trials),
        # per final contender: its true cost over the best config (% of the step), and what the selection round
        # measured as its gain over the reference (ms; the runoff's input)
        "contenders_behind_best_pct": {
            c.name: round(100 * (world.step_ms(c.config) - best_ms) / sim.STEP_MS, 3) for c in res.contenders
        },
        "selection_gain_ms": d.get("selection_gain_ms"),
        # why a gain was left: the world's truly faster options, each GEMM's leader after the racing, per slot what
        # the racing measured (counts; the runners-up by name), how much of the rest's slowdown it took out and the
        # trial level it counted
        "world_fast": sorted(f"{g}: {label}" for g, label in world.fast),
        "choices": res.choices,
        "per_slot": {
            s: {k: v if isinstance(v, (int, float)) or k == "runners_up" else len(v) for k, v in c.items()}
            for s, c in res.coverage.items()
        },
        "miss_trace": miss_trace(res.trials, traced, real.slot_excess_ms, *trial_context(real))
        if false_winner or realized is not None and realized < 0.999
        else None,
        # ``--trace``: the same rows for these slots in every search, whatever its outcome (trial_precedent.py)
        "trace": miss_trace(res.trials, list(trace), real.slot_excess_ms, *trial_context(real)) if trace else None,
        # per slot the chosen config leaves a delay in, what that delay shows at its size after the search
        **(miss_checks(real, pick, missed, options) if missed else dict.fromkeys(MISS_CHECKS, {})),
        "look_replay": replayed or None,  # ``--replay-looks`` (look_replay.py)
        # ``--host-trace``: per trial, the thread's core, CPU time and context switches over its measured steps
        "trial_os": os_stats[: len(res.trials)] if any(os_stats := getattr(real, "os_stats", [])) else None,
    }


def trial_context(real) -> tuple[list | None, list | None, list | None]:
    """What ``real`` kept per call besides the measurement: (host gaps before it, switched, forward host ms)."""
    return real.gaps_ms, getattr(real, "switched", None), getattr(real, "host_ms", None)


def miss_trace(
    trials: list,
    slots: list[str],
    excess_ms,
    gaps_ms: list[float] | None = None,
    switched: list[bool] | None = None,
    host_ms: list[dict[str, float] | None] | None = None,
) -> dict[str, list[list]]:
    """Per slot in ``slots``, every measured trial as [phase, position (steps), the slot's median ms, the delay put
    in for the trial's config (ms), the delays put in every slot (ms, in the order of the JSON's ``slots``), the
    slot's ms per measured step, the rest of the step's (step minus every slot) ms per measured step, and, where
    ``gaps_ms`` has one per trial, the host ms between the trial before and this one (the search's own work;
    ``trial_precedent.py``), and then, where ``switched`` has one per trial too, whether a switch came first, and
    then, where ``host_ms`` has the slot (``--host-trace``), the host ms of its module calls per step]: kept
    for a seed that left a gain or named a false winner, so that its JSON tells a look that read noise from one that
    could not see a put-in cost (FP8 seed 21304 on 4 x H100 left a 0.32 ms proj_fprop gain, re-measured once, and a
    rerun took it: benchmarks/results/2026-11-26_h100x4c/), and whether the other slots' delays move the slot's own
    reading (``slot_coupling.py``)."""
    out: dict[str, list[list]] = {s: [] for s in slots}
    gaps = gaps_ms if gaps_ms is not None and len(gaps_ms) == len(trials) else [None] * len(trials)
    flags = switched if switched is not None and len(switched) == len(trials) else [None] * len(trials)
    hosts = host_ms if host_ms is not None and len(host_ms) == len(trials) else [None] * len(trials)
    for t, gap, flag, host in zip(trials, gaps, flags, hosts):
        if t.error:
            continue
        put_in = excess_ms(t.config)
        every = [round(v, 4) for v in put_in.values()]
        for s in slots:
            if s in t.slot_ms:
                steps = [round(v, 4) for v in t.slot_samples.get(s, [])]
                rest = [round(v, 4) for v in t.rest_samples]  # host_modes.py reads both
                row = [t.phase, int(t.position), round(t.slot_ms[s], 4), round(put_in[s], 4), every, steps, rest]
                row += [gap] if gap is not None else []
                row += [flag] if None not in (gap, flag) else []
                out[s].append(row + ([host[s]] if None not in (gap, flag, host) and s in host else []))
    return out


def phase_seconds(trials: list) -> dict[str, float]:
    """Seconds per search phase (screen, halving = racing, recheck, select, confirm, ...), brackets apart."""
    out: dict[str, float] = {}
    for t in trials:
        out[t.phase] = round(out.get(t.phase, 0.0) + t.seconds, 1)
    return out


def parse_variant(variant: str, flag: str = "--variants") -> dict[str, int | float]:
    """``"max_steps=400,max_seconds=120.0"`` -> SearchOptions overrides, each of its field's type (int or float); a
    key SearchOptions lacks, or a value not of its type or its rules, raises ValueError (naming ``flag``)."""
    from megatron_tp_overlap.engine.search import SearchOptions

    kinds = {f.name: f.type for f in dataclasses.fields(SearchOptions) if f.type in ("int", "float", int, float)}
    out: dict[str, int | float] = {}
    for kv in filter(None, variant.split(",")):
        k, _, v = kv.partition("=")
        kind = int if kinds.get(k) in ("int", int) else float
        try:
            if k not in kinds:
                raise ValueError
            out[k] = kind(v)
        except ValueError:
            raise ValueError(
                f"{flag} {variant!r}: {kv!r} must be KEY=NUMBER with KEY a numeric SearchOptions field (an int "
                "field takes an int)"
            ) from None
    try:
        SearchOptions(**out)  # its own rules
    except ValueError as e:
        raise ValueError(f"{flag} {variant!r}: {e}") from None
    return out


def variant_of(run: dict) -> str:
    """The run's variant; runs of earlier trees recorded only their select_passes."""
    return run.get("variant") or f"select_passes={run.get('select_passes')}"


def confirm_blocks(trials: list) -> list[list]:
    """The final decision's blocks: [contender, after a switch (1) or continuing its config (0), GPU ms of the
    overlapped layers per step, ms of the rest of the step (the step minus every slot; both medians over the
    block)]: what the rest guard (``SearchOptions.rest_guard``) can be checked on, for every decision."""
    out, prev = [], None
    for t in trials:
        if t.phase != "confirm" or t.error or not t.slot_samples:
            continue
        per_step = [sum(v) for v in zip(*t.slot_samples.values())]
        rest = round(statistics.median(t.rest_samples), 4) if t.rest_samples else None
        out.append(
            [t.tested["*"], int(prev is None or prev != t.tested["*"]), round(statistics.median(per_step), 4), rest]
        )
        prev = t.tested["*"]
    return out


def gap_effect_ms(blocks: list[list]) -> float | None:
    """Mean over configs of (continuing block - block after a switch), ms: what a config's block that follows
    only a trial's sync gap measures against one that follows a switch."""
    diffs = []
    for name in {b[0] for b in blocks}:
        cont = [b[2] for b in blocks if b[0] == name and not b[1]]
        after = [b[2] for b in blocks if b[0] == name and b[1]]
        if cont and after:
            diffs.append(statistics.mean(cont) - statistics.mean(after))
    return statistics.mean(diffs) if diffs else None


def inner(
    out: Path,
    runs: int,
    minutes: float,
    idle_s: float,
    first_seed: int,
    gains: tuple[float, float],
    argv: list[str],
    trial_microbatches: int = 0,
    preset: bool = False,
    variants: tuple[str, ...] = (),
    common_factor: int = 0,
    common_factor_steps: int = 0,
    repeat: int = 1,
    precedent: tuple[int, float, tuple[str, ...]] = (0, 0.0, ()),
    trace: tuple[str, ...] = (),
    switch_busy: bool = False,
    host_trace: bool = False,
    replay: tuple[str, ...] = (),
) -> None:
    import megatron.training.training as training
    import torch
    from megatron.training import get_args
    from trial_noise import gpu_ms, sleep_ms_per_cycle

    from megatron_tp_overlap.engine.topology import build_topology
    from megatron_tp_overlap.integrations.megatron.launcher import run_script
    from megatron_tp_overlap.integrations.megatron.run_shape import RunShape
    from megatron_tp_overlap.integrations.megatron.tuning import MegatronSteps
    from megatron_tp_overlap.tools.research import decision_sim as sim

    t_start = time.perf_counter()

    def train(forward_step_func, model, optimizer, scheduler, data_iterator, *rest, **kw):
        steps = MegatronSteps(
            model, forward_step_func, optimizer, data_iterator, RunShape.from_args(get_args()), trial_microbatches
        )
        modules = overlap_modules(model)
        topo = build_topology(modules)
        assert topo.active == sim.TOPO.active, (topo, sim.TOPO)  # the world's 12 GEMMs all run somewhere
        if topo.slots() == sim.TOPO.slots():
            topo = dataclasses.replace(sim.TOPO, layers=topo.layers)
        delays = Delays(modules, topo.layers * steps.n_mb, sleep_ms_per_cycle(), host_trace)
        for _ in range(10):
            steps.step()
        calls = delays.count(steps.step)
        step_ms = statistics.median(gpu_ms(steps.step) for _ in range(10))
        real = RealSteps(steps, modules, topo, delays, idle_s, step_ms / sim.STEP_MS, switch_busy)
        result = {"megatron_args": argv[1:], "step_ms": step_ms, "ms_per_cycle": delays.per_cycle, "idle_s": idle_s}
        result["switch_busy"] = switch_busy
        result["trial_microbatches"] = steps.n_mb
        result["slots"], result["slot_calls_per_step"] = topo.slots(), calls
        result["preset"], result["variants"] = preset, list(variants)
        result["runs"] = []
        result["probe"] = probe_delays(real)  # the put-in delay, measured on whole steps
        # how much of a delay of 1% of the step shows, put in each slot alone (in the slot, on the step)
        d = 0.01 * step_ms
        result["slot_visibility"] = slot_visibility(
            lambda s: real.measure_with({s: d} if s else {}), list(topo.slots()), d
        )
        delays.set({})
        print(f"[search_on_real_steps] slot_visibility {json.dumps(result['slot_visibility'])}", flush=True)

        def save() -> None:  # after each part: a run cut short keeps what it measured
            if int(os.environ.get("RANK", "0")) == 0:
                out.mkdir(parents=True, exist_ok=True)
                tmp = out / "search_on_real_steps.json.tmp"
                tmp.write_text(json.dumps(result, indent=1) + "\n")
                os.replace(tmp, out / "search_on_real_steps.json")

        save()
        if common_factor:  # does a slow stretch slow every part of a step alike? (common_factor.py)
            import common_factor as cf

            from megatron_tp_overlap.engine.search import SearchOptions

            trials = cf.record(real, common_factor, common_factor_steps or SearchOptions().halving_steps)
            result["common_factor"] = {"trials": trials, "summary": cf.summarize(trials)}
            print(cf.line(result["common_factor"]["summary"]), flush=True)
            save()  # with --runs 0 nothing else would write it (2026-11-26: the trials were lost so)
            delays.set({})
        if precedent[0]:  # does a trial right after the search's kind of work read apart? (trial_precedent.py)
            import trial_precedent as tp

            rounds, work_ms, kinds = precedent
            result["precedent"] = tp.record(real, rounds, work_ms, works={k: tp.WORKS[k] for k in kinds} or None)
            print("\n".join(tp.summary_lines(tp.summarize(result["precedent"]))), flush=True)
            save()
            delays.set({})
        for i in range(runs):
            gain = random.Random(first_seed + i).uniform(*gains) / 100 if i % 2 == 0 else 0.0
            order = list(variants) or [""]
            if i % 4 >= 2:  # each kind of seed runs the variants in both orders (drift over the pair cancels)
                order.reverse()
            for v in order * repeat:
                if time.perf_counter() - t_start > 60 * minutes:
                    break
                rec = one_search(real, first_seed + i, gain, preset, v, trace, replay, t_start + 60 * minutes)
                rec["wall_s"] = round(time.perf_counter() - t_start, 1)
                result["runs"].append(rec)
                print(f"[search_on_real_steps] {json.dumps(rec)}", flush=True)
                save()
                delays.set({})
        torch.cuda.synchronize()
        return 0, 0  # no training; pretrain() carries on to its end

    training.train = train
    run_script(argv)


def summarize(runs: list[dict]) -> dict:
    gains = [r for r in runs if r["kind"] == "gain"]
    equal = [r for r in runs if r["kind"] == "equal"]
    real = [r["realized"] for r in gains if r["realized"] is not None]
    return {
        "runs_with_gain": len(gains),
        "realized_mean": statistics.mean(real) if real else math.nan,
        "realized_min": min(real) if real else math.nan,
        "worst_excess_pct": max((r["excess_pct"] for r in runs), default=math.nan),
        "equal_runs": len(equal),
        "false_winners": sum(r["false_winner"] for r in equal),
        "steps_median": statistics.median(r["steps"] for r in runs) if runs else math.nan,
        "seconds_median": statistics.median(r["seconds"] for r in runs) if runs else math.nan,
        "switches_median": statistics.median(r["switches"] for r in runs) if runs else math.nan,
        "gap_effect_ms": [round(g, 3) for r in runs if (g := gap_effect_ms(r.get("confirm_blocks", []))) is not None],
        "equal_measured_gain_ms": [r["decision_gain_ms"] for r in equal if r.get("decision_gain_ms") is not None],
    }


def table(result: dict) -> str:
    rows = [
        "| seed | variant | kind | gain put in, % | preset behind best, % | autotuned behind best, % | realized | "
        "true excess % | chosen | "
        "steps | s | switches | decision: gain measured ms (put in) | +- % of step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["runs"]:
        real = "-" if r["realized"] is None else f"{100 * r['realized']:.1f}%"
        pre = "-" if r.get("preset_excess_pct") is None else f"{r['preset_excess_pct']:.2f}"
        auto = r.get("contenders_behind_best_pct", {}).get("autotuned")
        auto = "-" if auto is None else f"{auto:.2f}"
        rows.append(
            f"| {r['seed']} | {variant_of(r)} | {r['kind']} | {r['available_gain_pct']:.2f} | {pre} | {auto} | "
            f"{real} | {r['excess_pct']:+.2f} | {r['chosen']} | {r['steps']} | {r['seconds']} | {r['switches']} | "
            f"{r['decision_gain_ms']} ({r['true_gain_of_decided_ms']}) | {r['decision_half_width_pct']} |"
        )
    pr = result["probe"]
    rows += [
        "",
        f"step {result['step_ms']:.1f} ms; put-in delays measured: 'no overlap' {pr['no overlap_ms']:.2f} ms vs "
        f"reference {pr['reference_ms']:.2f} ms, put in {pr['true_difference_ms']:.2f} ms apart",
    ]
    if "common_factor" in result:
        import common_factor as cf

        rows.append(cf.line(result["common_factor"]["summary"]))
    for v in sorted({variant_of(r) for r in result["runs"]}):
        s = summarize([r for r in result["runs"] if variant_of(r) == v])
        rows += [
            f"{v}: seeds with a gain: {s['runs_with_gain']}, realized mean {100 * s['realized_mean']:.1f}%, "
            f"min {100 * s['realized_min']:.1f}%; worst true excess over the reference {s['worst_excess_pct']:+.2f}%; "
            f"equal seeds: {s['equal_runs']}, false winners {s['false_winners']}; "
            f"median {s['steps_median']:.0f} steps, {s['seconds_median']:.1f} s, {s['switches_median']:.0f} switches",
            f"  final decision on equal seeds, measured gain (ms): {s['equal_measured_gain_ms']}; a continuing block "
            f"minus a block after a switch, per run (ms): {s['gap_effect_ms']}",
        ]
    return "\n".join(rows)


def main() -> None:
    from look_replay import VARIANTS
    from megatron_autotune import add_trial_microbatches

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--script", help="Megatron-LM's pretrain_gpt.py (core_v0.19.0)")
    p.add_argument("--runs", type=int, default=40, help="searches at most (seeds alternate: gain, equal)")
    p.add_argument("--minutes", type=float, default=7.0, help="no search starts after this many minutes")
    p.add_argument("--idle-s", type=float, default=SWITCH_IDLE_S, help="host seconds per simulated switch")
    p.add_argument(
        "--switch-busy", action="store_true", help="the simulated switch spins through --idle-s (default: it sleeps)"
    )
    p.add_argument(
        "--host-trace",
        action="store_true",
        help="traced trials also keep the host ms of each forward slot's module calls per step (Delays.host)",
    )
    p.add_argument("--first-seed", type=int, default=1000)
    p.add_argument(
        "--repeat", type=int, default=1, help="search each world this many times in a row (the worst world, again)"
    )
    p.add_argument(
        "--gain-pct",
        type=float,
        nargs=2,
        default=(0.5, 5.0),
        metavar=("LOW", "HIGH"),
        help="the available gain of a seed with one, uniform in this range, %% of the simulator's step "
        "(decision_sim: 0.5 5)",
    )
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument(
        "--shape", default="", help="model keys of benchmarks/megatron_autotune.MODEL, e.g. hidden=5120,ffn=14336"
    )
    p.add_argument("--fp8", action="store_true", help="FP8 GEMMs (--fp8-format hybrid)")
    p.add_argument(
        "--preset", action="store_true", help="2-3 faster options per world and a preset-like contender (see above)"
    )
    p.add_argument(
        "--select-passes",
        type=int,
        nargs="*",
        default=[],
        metavar="N",
        help="the same as --variants select_passes=N ...",
    )
    p.add_argument(
        "--variants",
        nargs="*",
        default=[],
        metavar="KEY=NUMBER[,KEY=NUMBER]",
        help="search each seed once per variant of the search options, e.g. max_steps=400 max_steps=0 (default: the "
        "defaults, once)",
    )
    p.add_argument(
        "--extra",
        default="",
        help="more Megatron-LM arguments, one string (an MoE model, activation recompute, CUDA graphs), e.g. "
        "--extra='--num-experts 8 --moe-router-topk 2 --moe-grouped-gemm'",
    )
    p.add_argument(
        "--common-factor",
        type=int,
        default=0,
        metavar="TRIALS",
        help="first, this many racing-like trials of an equal world: does a slow stretch slow every part of a step "
        "alike? (common_factor.py)",
    )
    p.add_argument(
        "--common-factor-steps",
        type=int,
        default=0,
        metavar="STEPS",
        help="measured steps per trial of --common-factor (default: the racing's, halving_steps); 16: how a trial's "
        "level falls with its length (trial_level.py)",
    )
    p.add_argument(
        "--precedent",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="first, this many rounds of work then two trials of one config: does a trial right after the search's "
        "kind of work read apart from one right after a trial? (trial_precedent.py)",
    )
    p.add_argument("--precedent-work-ms", type=float, default=20.0, help="each --precedent work's ms")
    p.add_argument(
        "--precedent-kinds",
        nargs="+",
        default=[],
        metavar="KIND",
        help="these kinds of --precedent only (default: all)",
    )
    p.add_argument(
        "--trace",
        nargs="+",
        default=[],
        metavar="SLOT",
        help="keep every trial of these slots in every search (``trace``, as ``miss_trace``), e.g. qkv.fwd proj.fwd",
    )
    p.add_argument(
        "--replay-looks",
        nargs="+",
        default=[],
        metavar="VARIANT",
        help=f"after each search, replay its looks per call in these variants until --minutes (look_replay.py: "
        f"{', '.join(VARIANTS)})",
    )
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    add_trial_microbatches(p)
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    a, rest = p.parse_known_args()
    if a.common_factor and a.common_factor < 8:
        print(f"--common-factor {a.common_factor}: must be 0 (not run) or at least 8 trials", file=sys.stderr)
        sys.exit(2)
    if a.common_factor_steps < 0 or a.common_factor_steps == 1:
        print(f"--common-factor-steps {a.common_factor_steps}: must be 0 (the racing's) or at least 2", file=sys.stderr)
        sys.exit(2)
    if a.precedent < 0 or a.precedent_work_ms <= 0:
        bad = f"--precedent {a.precedent}: must be 0 (not run) or more rounds" if a.precedent < 0 else ""
        print(bad or f"--precedent-work-ms {a.precedent_work_ms}: must be more than 0 ms", file=sys.stderr)
        sys.exit(2)
    from megatron_tp_overlap.engine.topology import SHARED_PREFIX
    from megatron_tp_overlap.tools.research.decision_sim import SLOTS

    known = [*SLOTS, *(SHARED_PREFIX + s for s in SLOTS if s.startswith(("fc1", "fc2")))]  # an MoE's shared experts
    if unknown := [s for s in a.trace if s not in known]:
        print(f"--trace {' '.join(unknown)}: not a slot; slots are {', '.join(known)}", file=sys.stderr)
        sys.exit(2)
    from trial_precedent import WORKS

    if unknown := [k for k in a.precedent_kinds if k not in WORKS]:
        kinds = "; ".join(WORKS)
        print(f"--precedent-kinds {unknown[0]!r}: not a kind; kinds are {kinds}", file=sys.stderr)
        sys.exit(2)
    if a.repeat < 1:
        print(f"--repeat {a.repeat}: must be at least 1 (searches of each world)", file=sys.stderr)
        sys.exit(2)
    if unknown := [v for v in a.replay_looks if v not in VARIANTS]:
        print(f"--replay-looks {unknown[0]!r}: not a variant; variants are {', '.join(VARIANTS)}", file=sys.stderr)
        sys.exit(2)
    out = Path(a.out)
    if a.inner:
        inner(
            out,
            a.runs,
            a.minutes,
            a.idle_s,
            a.first_seed,
            tuple(a.gain_pct),
            rest,
            a.trial_microbatches,
            a.preset,
            tuple(a.variants),
            a.common_factor,
            a.common_factor_steps,
            a.repeat,
            (a.precedent, a.precedent_work_ms, tuple(a.precedent_kinds)),
            tuple(a.trace),
            a.switch_busy,
            a.host_trace,
            tuple(a.replay_looks),
        )
        return
    from megatron_autotune import FP8_ARGS, one_gpu_args, parse_model_shape

    shape = parse_model_shape(a.shape)
    import shlex

    args = one_gpu_args(a.seq, 10, **shape) + (FP8_ARGS if a.fp8 else []) + shlex.split(a.extra)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", __file__, "--inner", "--out", str(out)]
    cmd += ["--trial-microbatches", str(a.trial_microbatches)]
    cmd += ["--runs", str(a.runs), "--minutes", str(a.minutes), "--idle-s", str(a.idle_s)]
    cmd += ["--common-factor", str(a.common_factor), "--common-factor-steps", str(a.common_factor_steps)]
    cmd += ["--repeat", str(a.repeat), "--precedent", str(a.precedent), "--precedent-work-ms", str(a.precedent_work_ms)]
    cmd += ["--trace", *a.trace] if a.trace else []
    cmd += ["--precedent-kinds", *a.precedent_kinds] if a.precedent_kinds else []
    cmd += ["--switch-busy"] if a.switch_busy else []
    cmd += ["--host-trace"] if a.host_trace else []
    cmd += ["--replay-looks", *a.replay_looks] if a.replay_looks else []
    variants = a.variants + [f"select_passes={n}" for n in a.select_passes]
    for v in variants:
        try:
            parse_variant(v)  # a typo fails here, in one line, before any GPU work
        except ValueError as e:
            print(e, file=sys.stderr)
            sys.exit(2)
    cmd += (["--preset"] if a.preset else []) + (
        ["--variants", *variants] if variants else []
    )  # before the options below: "--variants A B SCRIPT" would take the script for a value
    cmd += ["--first-seed", str(a.first_seed), "--gain-pct", *map(str, a.gain_pct), a.script, *args]
    print(" ".join(cmd), flush=True)
    rc = subprocess.run(cmd).returncode
    result = json.loads((out / "search_on_real_steps.json").read_text())
    (out / "search_on_real_steps.md").write_text(table(result) + "\n")
    print(table(result))
    sys.exit(rc)


if __name__ == "__main__":
    main()
