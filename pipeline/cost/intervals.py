"""Error bars of the cache simulator's cost figures, from the identity simulation's residuals.

The residual of a session is what the simulator missed when it replayed the session as it was
(pipeline `identity`): `ε = recorded_cost / sim_cost − 1`, over the session's calls with recorded
usage. Its size over many sessions is how far the simulator's cost of a session is from the
truth. The interval half-width `q` is a split-conformal quantile of `|ε|` over *other* sessions:
with n residuals sorted ascending, `q` is the ⌈(n + 1) × 0.9⌉-th; under exchangeability (the
session is like the others) `|ε_s| ≤ q` holds with probability ≥ 90 %, whatever the residuals'
distribution. With fewer than 9 other sessions that index is past n and `DEFAULT_Q` is used: the
same quantile measured leave-one-session-out on the 34 real sessions the bench reads
(`bench/bench_cachesim.py`).

How the intervals read on `compare`'s figures:

- the raw simulation of a session under pipeline P: the true cost lies in `sim_P × [1 − q, 1 + q]`;
- the anchored estimate `est_P = recorded + (sim_P − sim_identity)`: the recorded cost is known,
  only the simulated change `Δ = sim_P − sim_identity` is uncertain, and we take its relative error
  to be the simulator's on a whole session: `est_P ± q × |Δ|` (zero width under identity). This
  assumes what the simulator misses on the recorded requests it misses in proportion on the
  changed part; it cannot be checked without the counterfactual's real bill;
- a total: the sum of the sessions' bounds (the sessions' errors taken as fully correlated, the
  conservative choice).

Leave-one-session-out check (the bench prints it): for every session s, calibrate without s,
simulate s under identity, take `q` from the other sessions' residuals and count whether
`recorded_s ∈ sim_s × [1 − q, 1 + q]`; the goal is ≥ 90 % of sessions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

COVERAGE = 0.9
DEFAULT_Q = 0.18
"""|ε| quantile used when a comparison has fewer than 9 other sessions with usage: the bench's
leave-one-session-out conformal quantile over the real sessions it reads (docs/cache-simulation.md)."""


def residual(recorded_cost: float | None, sim_cost: float | None) -> float | None:
    """ε = recorded / simulated − 1 (None when either is missing or the simulation is 0)."""
    if recorded_cost is None or sim_cost is None or sim_cost <= 0:
        return None
    return recorded_cost / sim_cost - 1.0


def conformal_q(residuals: list[float], coverage: float = COVERAGE) -> float | None:
    """The ⌈(n + 1) × coverage⌉-th smallest |ε| of n residuals, None when that is past n."""
    a = sorted(abs(r) for r in residuals if r is not None and math.isfinite(r))
    k = math.ceil((len(a) + 1) * coverage)
    return a[k - 1] if 0 < k <= len(a) else None


def loo_q(residuals: Mapping[str, float], coverage: float = COVERAGE,
          default: float = DEFAULT_Q) -> dict[str, float]:
    """Per session: the conformal quantile of the other sessions' residuals (`default` when too few)."""
    out = {}
    for s in residuals:
        q = conformal_q([r for t, r in residuals.items() if t != s], coverage)
        out[s] = default if q is None else q
    return out


def covers(recorded_cost: float, sim_cost: float, q: float) -> bool:
    """Whether the raw simulation's interval sim × [1 − q, 1 + q] holds the recorded cost."""
    return sim_cost * (1 - q) <= recorded_cost <= sim_cost * (1 + q)


__all__ = ["COVERAGE", "DEFAULT_Q", "conformal_q", "covers", "loo_q", "residual"]
