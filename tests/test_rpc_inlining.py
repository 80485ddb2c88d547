"""How an inline run is judged: by what its function did, not by how the machine treated it."""

from __future__ import annotations

import os
import threading
import time

import pytest
from _busy_core import busy_core, pinned, preempted_for

from lightning_distgrad.rpc._calls.inlining import BUDGET_S, InlineRun, Inlining


def test_a_run_that_computes_past_the_budget_is_long():
    run = InlineRun()
    end = time.thread_time() + 2 * BUDGET_S
    while time.thread_time() < end:
        pass
    assert not run.short()


def test_a_run_that_sleeps_past_the_budget_is_long():
    """It waited for something: the rank's other messages waited with it."""
    run = InlineRun()
    time.sleep(2 * BUDGET_S)
    assert not run.short()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs CPU affinity (Linux)")
def test_a_run_that_only_waited_for_a_core_is_short():
    """Preempted past the budget with little CPU time of its own: a worker of the pool would
    have waited for a core as well."""
    with busy_core() as core, pinned([threading.get_native_id()], core):
        run = InlineRun()
        cpu, wall = time.thread_time(), time.perf_counter()
        preempted_for(3 * BUDGET_S)
        assert time.perf_counter() - wall > BUDGET_S
        assert time.thread_time() - cpu < BUDGET_S, "the busy process did not take the core"
        assert run.short()


def test_long_runs_in_a_row_send_a_function_to_the_pool_for_twice_as_many_requests_each_time():
    inlining = Inlining()
    assert inlining.allows(len)
    inlining.ran(len, ok=False)
    assert [inlining.allows(len) for _ in range(3)] == [False, False, True]
    inlining.ran(len, ok=False)  # the trial ran long too
    assert [inlining.allows(len) for _ in range(5)] == [False] * 4 + [True]
    assert inlining.allows(print), "another function's record is its own"


def test_a_short_trial_clears_the_record_of_long_runs():
    """Occasional long runs (a collection of garbage, a wait for the GIL) never add up to a
    long stay on the pool."""
    inlining = Inlining()
    for _ in range(3):
        inlining.ran(len, ok=False)
        while not inlining.allows(len):
            pass
        inlining.ran(len, ok=True)
        assert inlining.allows(len), "the next request runs inline again"
