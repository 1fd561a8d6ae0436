"""Cheap numerical fingerprints of a step's outputs and gradients, to reject configs that compute
something else (seen on H200 with TE 2.20: a reduce-scatter ``pipeline`` qkv_dgrad switched in at run
time gave input gradients with relative error 1.2 against the no-overlap reference).

A fingerprint is, per tensor, its projection onto a fixed standard-normal tensor of the same shape
(seeded, identical on every call) and its norm. For an error ``e`` the projection moves by about
``||e||``, so ``|dot_a - dot_b| / ||b||`` estimates the relative L2 error, and a wrong sign or a
permutation shows, unlike in a norm.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


class Fingerprint:
    """``fp(tensors) -> float64 tensor [n, k + 1]``: per tensor, its dots with ``k`` fixed probes
    and its L2 norm. Probes are regenerated from seeds on the tensor's device (nothing cached)."""

    def __init__(self, seed: int = 1234, probes: int = 4):
        self.seed, self.k = seed, probes

    def __call__(self, tensors: Iterable[torch.Tensor | None]) -> torch.Tensor:
        rows = []
        for i, t in enumerate(tensors):
            if t is None:
                rows.append(torch.zeros(self.k + 1, dtype=torch.float64))
                continue
            t = t.detach().float()
            g = torch.Generator(device=t.device)
            dots = []
            for j in range(self.k):
                g.manual_seed(self.seed + 7919 * i + j)
                dots.append((t * torch.randn(t.shape, generator=g, device=t.device)).sum())
            rows.append(torch.stack([*dots, t.norm()]).double().cpu())
        return torch.stack(rows) if rows else torch.zeros(0, self.k + 1, dtype=torch.float64)


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest estimated relative L2 error of fingerprint ``a`` against reference ``b``
    (inf when shapes differ or anything is non-finite)."""
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    if a.shape != b.shape:
        return math.inf
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return math.inf
    if a.numel() == 0:
        return 0.0
    err = (a[:, :-1] - b[:, :-1]).pow(2).mean(dim=1).sqrt()  # ~ ||a - b|| per tensor
    return float((err / b[:, -1].clamp_min(1e-30)).max())
