"""Routing diagnostics for the CUDA engine session (Session.route_hook), used by tests and bisection.

Top-k expert routing is discontinuous: when the 6th and 7th biased router scores of a token are
within the numeric noise of two evaluation paths (prefill vs decode, GPU vs CPU), the two paths pick
different experts and the logits of that position — and, through attention, of later ones — differ
by 1e-2 or more although both are right. `RouteRecorder` logs each path's choice per position and
layer; `RouteReplayer` makes a second session use the recorded choice, so the two paths can be held
to float tolerance with the discontinuity removed.
"""

from __future__ import annotations

import torch


class RouteRecorder:
    """Records ids [k] and the relative gap between the k-th and (k+1)-th scores, per (layer, position)."""

    def __init__(self, session):
        self.session = session
        self.ids: dict[int, dict[int, torch.Tensor]] = {}
        self.gap: dict[int, dict[int, float]] = {}
        session.route_hook = self

    def __call__(self, li: int, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        k = ids.shape[1]
        top = torch.sort(scores, dim=-1, descending=True).values
        gap = ((top[:, k - 1] - top[:, k]) / top[:, k - 1].abs().clamp(min=1e-30)).cpu().tolist()
        p0 = self.session.pos
        for t in range(ids.shape[0]):
            self.ids.setdefault(li, {})[p0 + t] = ids[t].clone()
            self.gap.setdefault(li, {})[p0 + t] = gap[t]
        return ids

    def differences(self, other: "RouteRecorder") -> list[tuple[int, int]]:
        """(layer, position) where the two recorders chose different expert sets."""
        out = []
        for li, per in self.ids.items():
            for p, a in per.items():
                b = other.ids.get(li, {}).get(p)
                if b is not None and not torch.equal(torch.sort(a).values, torch.sort(b).values):
                    out.append((li, p))
        return sorted(out, key=lambda lp: (lp[1], lp[0]))


class RouteReplayer:
    """Makes `session` route every (layer, position) as `recorded` did."""

    def __init__(self, session, recorded: RouteRecorder):
        self.session, self.recorded = session, recorded
        session.route_hook = self

    def __call__(self, li: int, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        p0 = self.session.pos
        rows = [self.recorded.ids[li][p0 + t].to(ids.device) for t in range(ids.shape[0])]
        return torch.stack(rows).to(ids.dtype)
