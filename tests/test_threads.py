"""Native thread pools of the learning stages: sized to the free cores, so a busy machine does not make OpenMP
barriers wait on parked threads (dispatch.common.threads)."""

from __future__ import annotations

import pytest
from gemv_dispatch.dispatch.common import threads


@pytest.mark.parametrize(("cores", "load", "expected"), [
    (2, 0.0, 2), (2, 0.6, 1), (2, 2.3, 1), (2, 7.0, 1), (16, 3.6, 12), (16, 0.4, 16)])
def test_budget_is_the_free_cores_and_at_least_one(cores, load, expected, monkeypatch):
    monkeypatch.delenv(threads.ENV, raising=False)
    assert threads.thread_budget(cores, load) == expected


def test_omp_num_threads_decides_when_set(monkeypatch):
    monkeypatch.setenv(threads.ENV, "3")
    assert threads.thread_budget(2, 5.0) == 3
    monkeypatch.setenv(threads.ENV, "zero")  # not a count: ignored
    assert threads.thread_budget(2, 0.0) == 2


def test_usable_cores_are_the_affinity_not_the_machine(monkeypatch):
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {3}, raising=False)
    assert threads.usable_cores() == 1


def test_bounded_threads_limits_the_openmp_pool(monkeypatch):
    import sklearn.ensemble  # noqa: F401  (loads scikit-learn's OpenMP runtime)
    from threadpoolctl import threadpool_info

    monkeypatch.setenv(threads.ENV, "1")
    with threads.bounded_threads() as limit:
        assert limit == 1
        pools = [pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "openmp"]
        assert pools and set(pools) == {1}
