"""Where ranks outnumber cores, a poller yields its core between polls for ``YIELD_S`` after
traffic, and a waiter for ``YIELD_S`` after it began to wait, before either naps: a rank that
needs the core gets it either way, and a core that nobody needs does not halt. A waiter whose
yield ran another thread naps from then on: every core is in demand."""

from __future__ import annotations

import os
import threading

import pytest
from _dist_utils import wait_until
from _transports import make_transport
from mpi4py import MPI

from lightning_distgrad.rpc._transport import Transport, engine

#: A YIELD_S longer than any test runs: the poller yields throughout.
LONG_WINDOW = 3600.0
WINDOWS = [pytest.param(LONG_WINDOW, id="window"), pytest.param(0.0, id="no window")]


def crowded_transport() -> Transport:
    """A transport that polls as where ranks outnumber cores (its progress thread not started)."""
    transport = make_transport(MPI.COMM_SELF)
    transport.spin = False
    return transport


def record_waits(transport: Transport, monkeypatch) -> list[tuple[str, int]]:
    """("yield" or "nap", thread ident) for each yield of the core and each nap of the bell."""
    events: list[tuple[str, int]] = []
    sched_yield, nap = os.sched_yield, transport._bell.wait

    def yielded() -> None:
        events.append(("yield", threading.get_ident()))
        sched_yield()

    def napped(timeout: float) -> None:
        events.append(("nap", threading.get_ident()))
        nap(timeout)

    monkeypatch.setattr(engine.os, "sched_yield", yielded)
    monkeypatch.setattr(transport._bell, "wait", napped)
    return events


def progress_thread_waits(window: float, handlers_running: int, monkeypatch) -> set[str]:
    """How the progress thread of a crowded transport waits between polls right after traffic
    ("yield", "nap"), with ``YIELD_S = window`` and ``handlers_running`` handlers on the pool."""
    monkeypatch.setattr(engine, "YIELD_S", window)
    transport = crowded_transport()
    events = record_waits(transport, monkeypatch)
    transport._last_traffic = engine.time.monotonic()  # traffic just now
    transport.busy(handlers_running)
    transport.start()
    try:
        role = transport._role
        assert wait_until(lambda: sum(t == role.holder for _, t in events) >= 50), events
        return {kind for kind, t in events if t == role.holder}
    finally:
        transport.busy(-handlers_running)
        transport.stop()
        transport.free()


@pytest.mark.parametrize("window", WINDOWS)
def test_after_traffic_the_poller_yields_its_core_before_it_naps(monkeypatch, window):
    waits = progress_thread_waits(window, 0, monkeypatch)
    assert waits == ({"yield"} if window else {"nap"})


def test_while_handlers_run_on_the_pool_the_poller_naps_however_recent_the_traffic(monkeypatch):
    """The handlers need the core (and the GIL) more than a poller that expects nothing."""
    assert progress_thread_waits(LONG_WINDOW, 1, monkeypatch) == {"nap"}


def waiter_waits(transport: Transport, events: list[tuple[str, int]]) -> list[str]:
    """How this thread waits ("yield", "nap") for an answer that comes 50 ms from now."""
    answered = threading.Event()
    transport.start()
    try:
        transport.call_later(0.05, answered.set)  # fired by the waiter, which polls
        assert transport.drive_until(answered.is_set)
    finally:
        transport.stop()
        transport.free()
    me = threading.get_ident()
    return [kind for kind, t in events if t == me]


@pytest.mark.parametrize("window", WINDOWS)
def test_a_waiter_yields_its_core_before_it_naps(monkeypatch, window):
    monkeypatch.setattr(engine, "YIELD_S", window)
    # However long a yield takes here (other processes of the machine may take the core).
    monkeypatch.setattr(engine, "GAVE_CORE_AWAY_S", LONG_WINDOW)
    transport = crowded_transport()
    waited = waiter_waits(transport, record_waits(transport, monkeypatch))
    assert waited, "the waiter neither yielded nor napped"
    assert set(waited) == ({"yield"} if window else {"nap"})


def test_a_waiter_whose_yield_ran_another_thread_naps_from_then_on(monkeypatch):
    """Every core is in demand: the waiter leaves its core to them and is rung instead."""
    monkeypatch.setattr(engine, "YIELD_S", LONG_WINDOW)
    transport = crowded_transport()
    events = record_waits(transport, monkeypatch)
    recorded_yield = engine.os.sched_yield

    def yield_to_another_thread() -> None:  # as when another runnable thread takes the core
        recorded_yield()
        engine.time.sleep(100 * engine.GAVE_CORE_AWAY_S)

    monkeypatch.setattr(engine.os, "sched_yield", yield_to_another_thread)
    waited = waiter_waits(transport, events)
    assert waited[0] == "yield" and waited.count("yield") == 1, waited
    assert "nap" in waited, waited
