"""CPU stand-ins for TE's userbuffers registry and TE modules, with a synthetic cost model.

The fake modules carry TE's class names and flag attributes (what ``topology`` looks at) and run a
custom autograd Function (what ``measure`` hooks). Their forward/backward advance a synthetic clock
(:data:`CLOCK`) by :func:`gemm_cost_ms` of the live config; :class:`SimEvent` reads it, so the tuner
measures exact, known times without sleeping.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from megatron_tp_overlap.ub.config import GemmOverlapConfig, UbConfig, parse_ub_cfgs, te_default


class FakeCommOverlap:
    """Like TE's ``tex.CommOverlap``: its constructor exchanges handles with the other ranks over the bootstrap group."""

    def __init__(self, name: str, group: Any = None):
        self.name = name
        if group is not None:
            import torch.distributed as dist

            handles = [torch.zeros(1) for _ in range(dist.get_world_size(group))]
            dist.all_gather(handles, torch.ones(1), group=group)


class FakeTE:
    """Replaces ``transformer_engine.pytorch.module.base`` for the switcher."""

    def __init__(self) -> None:
        self._ub_communicators: dict | None = None
        self.calls: list[dict] = []
        self.destroys = 0
        self.cfg = UbConfig()
        self.tex = types.SimpleNamespace(CommOverlap=FakeCommOverlap, CommOverlapP2P=FakeCommOverlap)
        self.bootstrap_groups: list[Any] = []

    def is_ub_initialized(self) -> bool:
        return self._ub_communicators is not None

    def initialize_ub(self, shape, tp_size, ub_cfgs=None, **kw):
        """As TE does: a new bootstrap group on every call, then one communicator per GEMM (each one's constructor
        runs collectives on it)."""
        import torch.distributed as dist

        if self._ub_communicators is not None:
            raise RuntimeError("UB communicators are already initialized.")
        self.calls.append({"shape": shape, "tp_size": tp_size, "ub_cfgs": ub_cfgs, **kw})
        self.cfg = parse_ub_cfgs(ub_cfgs if isinstance(ub_cfgs, dict) else (ub_cfgs or [{}])[0])
        group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self.bootstrap_groups.append(group)
        self._ub_communicators = {}
        for name in ("qkv_fprop", "proj_fprop", "fc1_fprop", "fc2_fprop"):
            cls = self.tex.CommOverlapP2P if name.endswith("1_fprop") else self.tex.CommOverlap
            self._ub_communicators[name] = cls(name, group)

    def destroy_ub(self):
        self._ub_communicators = None
        self.destroys += 1
        torch.compiler.reset()  # as TE 2.20 does


class SimClock:
    """A clock that only the fake modules move: ``seconds()`` is the tuner's wall clock, in s."""

    def __init__(self) -> None:
        self.now = 0.0

    def advance(self, ms: float) -> None:
        self.now += ms / 1e3

    def seconds(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


CLOCK = SimClock()


class SimEvent:
    """``torch.cuda.Event(enable_timing=True)`` on :data:`CLOCK`."""

    def __init__(self) -> None:
        self.t: float | None = None

    def record(self, stream: Any = None) -> None:
        self.t = CLOCK.now

    def elapsed_time(self, end: SimEvent) -> float:
        return (end.t - self.t) * 1e3


STATE = FakeTE()
PENALTY_MS: dict[tuple[str, str, int], float] = {}  # (gemm, method, num_sm) -> extra ms on this process


def gemm_cost_ms(gemm: str, cfg: UbConfig, enabled: bool, tp: int = 2) -> float:
    """Synthetic time of one GEMM + its communication. Optimum per GEMM is known:

    - overlap off costs 1.0 ms; TE's default method costs 0.8 ms;
    - pipeline/bulk: best at num_sm=8 (0.3 ms), worse away from it; pipeline also prefers 4 splits;
    - ring_exchange with aggregate is best for all-gather GEMMs (0.4 ms vs 0.6 ms).
    """
    if not enabled:
        return 1.0
    c = (cfg.get(gemm) or GemmOverlapConfig()).merged_over(te_default(gemm, tp))
    extra = PENALTY_MS.get((gemm, c.method, c.num_sm), 0.0)
    return extra + _base_cost(c)


def _base_cost(c: GemmOverlapConfig) -> float:
    if c.method in ("pipeline", "bulk"):
        cost = 0.3 + 0.02 * abs((c.num_sm or 16) - 8)
        if c.method == "pipeline":
            cost += 0.05 * abs((c.num_splits or 4) - 4)
        return cost
    if c.method == "ring_exchange":
        return 0.4 if c.aggregate else 0.6
    return 0.0  # external: free


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, fwd_ms, bwd_ms):
        CLOCK.advance(fwd_ms)  # then saves, as TE does after its GEMMs (a non-reentrant recompute stops there)
        ctx.save_for_backward(x, w)
        ctx.bwd_ms = bwd_ms
        return x @ w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        CLOCK.advance(ctx.bwd_ms())
        return g @ w.t(), x.t() @ g, None, None


class _FakeTEModule(torch.nn.Module):
    gemms: dict[str, tuple[str, ...]] = {}
    tp = 2

    def __init__(self, hidden: int, scale: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.eye(hidden) + 0.01 * torch.randn(hidden, hidden))
        self.scale = scale

    def enabled(self, gemm: str) -> bool:
        raise NotImplementedError

    def _ms(self, phase: str) -> float:
        return self.scale * sum(gemm_cost_ms(g, STATE.cfg, self.enabled(g), self.tp) for g in self.gemms[phase])

    def forward(self, x):
        return _Sleep.apply(x, self.weight, self._ms("fwd"), lambda: self._ms("bwd"))


class LayerNormLinear(_FakeTEModule):
    """Column-parallel (qkv / fc1)."""

    def __init__(self, hidden: int, ub_name: str, scale: float = 1.0):
        super().__init__(hidden, scale)
        self.ub_name, self.parallel_mode = ub_name, "column"
        self.ub_overlap_ag_fprop, self.ub_overlap_rs_dgrad = True, False
        self.ub_bulk_dgrad, self.ub_bulk_wgrad = True, True
        self.ub_overlap_rs_fprop = self.ub_overlap_ag_dgrad = False
        n = ub_name
        self.gemms = {"fwd": (f"{n}_fprop",), "bwd": (f"{n}_dgrad", f"{n}_wgrad")}

    def enabled(self, g: str) -> bool:
        if g.endswith("fprop"):  # TE's LayerNormLinear: `ub_overlap_ag_fprop and is_grad_enabled and ...`
            return self.ub_overlap_ag_fprop and torch.is_grad_enabled()
        if g.endswith("dgrad"):
            return self.ub_bulk_dgrad or self.ub_overlap_rs_dgrad
        return self.ub_bulk_wgrad


class Linear(_FakeTEModule):
    """Row-parallel (proj / fc2)."""

    def __init__(self, hidden: int, ub_name: str, scale: float = 1.0):
        super().__init__(hidden, scale)
        self.ub_name, self.parallel_mode = ub_name, "row"
        self.ub_overlap_rs_fprop, self.ub_overlap_ag_dgrad = True, True
        self.ub_overlap_ag_fprop = self.ub_overlap_rs_dgrad = self.ub_bulk_dgrad = self.ub_bulk_wgrad = False
        n = ub_name
        self.gemms = {"fwd": (f"{n}_fprop",), "bwd": (f"{n}_dgrad", f"{n}_wgrad")}

    def enabled(self, g: str) -> bool:
        return self.ub_overlap_rs_fprop if g.endswith("fprop") else self.ub_overlap_ag_dgrad


class Block(torch.nn.Module):
    def __init__(self, hidden: int, scale: float = 1.0):
        super().__init__()
        self.qkv, self.proj = LayerNormLinear(hidden, "qkv", scale), Linear(hidden, "proj", scale)
        self.fc1, self.fc2 = LayerNormLinear(hidden, "fc1", scale), Linear(hidden, "fc2", scale)

    def forward(self, x):
        return self.fc2(self.fc1(self.proj(self.qkv(x)))) + x


def fake_model(layers: int = 2, hidden: int = 8, scale: float = 1.0) -> torch.nn.Module:
    return torch.nn.Sequential(*[Block(hidden, scale) for _ in range(layers)])


def fake_init_args(tp: int = 2) -> Any:
    from megatron_tp_overlap.engine.switcher import UbInitArgs

    return UbInitArgs(shape=[64, 8], tp_size=tp, dtype="bf16", bootstrap_backend="nccl")


class ColumnLinear(Linear):
    """A column-parallel TE ``Linear`` as megatron-core builds an MoE layer's shared-expert fc1: only the all-gather
    of its forward overlaps (``TELinear`` passes ub_overlap_ag/ub_overlap_rs alone)."""

    def __init__(self, hidden: int, ub_name: str, scale: float = 1.0):
        super().__init__(hidden, ub_name, scale)
        self.parallel_mode = "column"
        self.ub_overlap_ag_fprop, self.ub_overlap_rs_fprop, self.ub_overlap_ag_dgrad = True, False, False

    def enabled(self, g: str) -> bool:
        return self.ub_overlap_ag_fprop if g.endswith("fprop") else False


class GroupedLinear(torch.nn.Module):
    """TE's grouped GEMM of the routed experts: no userbuffers flags (TE cannot overlap it)."""

    def __init__(self, hidden: int, tp_size: int = 2):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.eye(hidden))
        self.parallel_mode, self.tp_size = "column", tp_size

    def forward(self, x):
        return x @ self.weight


class Router(torch.nn.Module):
    """A router's state outside parameters: tokens per expert counted in every forward, an aux-loss-free expert bias
    moved after every backward (megatron-core's ``finalize_model_grads`` hook, where the framework set it)."""

    def __init__(self, hidden: int, experts: int = 4):
        super().__init__()
        self.weight = torch.nn.Parameter(0.01 * torch.ones(experts, hidden))
        self.register_buffer("local_tokens_per_expert", torch.zeros(experts))
        self.register_buffer("expert_bias", torch.zeros(experts))

    def forward(self, x):
        logits = x @ self.weight.t()
        with torch.no_grad():
            self.local_tokens_per_expert += torch.bincount(logits.argmax(-1), minlength=len(self.expert_bias))
            self.expert_bias -= 1e-3 * torch.sign(self.local_tokens_per_expert - self.local_tokens_per_expert.mean())
        return x * torch.sigmoid(logits.sum(-1, keepdim=True))


class SharedExperts(torch.nn.Module):
    def __init__(self, hidden: int, scale: float):
        super().__init__()
        self.linear_fc1, self.linear_fc2 = ColumnLinear(hidden, "fc1", scale), Linear(hidden, "fc2", scale)

    def forward(self, x):
        return self.linear_fc2(self.linear_fc1(x))


class MoEBlock(torch.nn.Module):
    """Attention (qkv/proj), a router, routed experts and a shared expert, named as megatron-core names them."""

    def __init__(self, hidden: int, scale: float = 1.0):
        super().__init__()
        self.qkv, self.proj = LayerNormLinear(hidden, "qkv", scale), Linear(hidden, "proj", scale)
        self.router, self.experts = Router(hidden), GroupedLinear(hidden)
        self.shared_experts = SharedExperts(hidden, scale)

    def forward(self, x):
        h = self.proj(self.qkv(x)) + x
        r = self.router(h)
        return self.experts(r) + self.shared_experts(h) + h


def fake_moe_model(dense: int = 1, moe: int = 1, hidden: int = 8, scale: float = 1.0) -> torch.nn.Module:
    """``dense`` dense blocks, then ``moe`` MoE blocks (megatron-core's --moe-layer-freq with dense layers first)."""
    return torch.nn.Sequential(
        *[Block(hidden, scale) for _ in range(dense)], *[MoEBlock(hidden, scale) for _ in range(moe)]
    )
