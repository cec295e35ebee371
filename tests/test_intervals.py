"""The error bars of `compare` (pipeline/cost/intervals.py): a split-conformal quantile of the
identity simulation's relative residuals over the other sessions."""

from __future__ import annotations

import pytest

from ctxreplay.pipeline.cost import intervals


def test_residual_is_recorded_over_simulated() -> None:
    assert intervals.residual(1.1, 1.0) == pytest.approx(0.1)
    assert intervals.residual(None, 1.0) is None and intervals.residual(1.0, 0.0) is None


def test_conformal_quantile_needs_enough_sessions() -> None:
    # n = 9: the ceil(10 * 0.9) = 9th smallest |e|; n = 8: past n, no quantile
    res = [0.01 * i for i in range(1, 10)]
    assert intervals.conformal_q(res) == pytest.approx(0.09)
    assert intervals.conformal_q(res[:8]) is None
    assert intervals.conformal_q([-0.5, *res]) == pytest.approx(0.5)    # n = 10: the 10th, the largest |e|
    assert intervals.conformal_q([-0.5, *res, *res]) == pytest.approx(0.09)   # n = 19: the 18th; 0.5 is left out


def test_leave_one_out_quantile_leaves_the_session_out() -> None:
    res = {f"s{i}": 0.01 * i for i in range(1, 11)}
    q = intervals.loo_q(res)
    assert q["s10"] == pytest.approx(0.09) and q["s1"] == pytest.approx(0.10)
    assert intervals.loo_q({"a": 0.5}) == {"a": intervals.DEFAULT_Q}
    assert intervals.covers(1.05, 1.0, 0.05) and not intervals.covers(1.06, 1.0, 0.05)
