"""Which thread holds the transport's progress role, and the standby that takes it over.

The *holder* polls MPI and delivers what arrives (``engine``); a small request is run right
where it is delivered, on the holder (an *inline run*, see :meth:`ProgressRole.begin_inline`),
so that serving it costs no hand-off to another thread. A request may block, though (a nested
RPC, a lock, a sleep), and a blocked holder would stall every message of its rank. So the role
can move: the holder *steps out* of it before an inline run waits for anything
(:meth:`ProgressRole.step_out`), and a *standby* thread takes it over at once; the standby also
watches inline runs and takes the role from one that has run for :data:`WATCH_S` and is not
running now (it sleeps, waits for a lock or I/O), or that has computed for
:data:`LONG_RUN_CPU_S` of its thread's CPU time (a long computation). A run that the machine
only preempted uses no CPU meanwhile, so it keeps the role however long it waits for a core.
The old holder finishes its run as a plain worker, then becomes the standby (or ends, if there
is one).

The standby costs nothing while no inline run happens: it sleeps until one starts after a quiet
spell, then looks every :data:`WATCH_S` until :data:`QUIET_S` pass without one (and none runs).
"""

from __future__ import annotations

import contextlib
import enum
import math
import threading
import time
from collections.abc import Callable, Iterator

import torch

#: The standby takes the role from an inline run that has lasted this long and is not
#: running (it sleeps or waits)...
WATCH_S = 0.005
#: ...or that has used this much CPU time since the standby first saw it (a long computation:
#: the two threads then share the GIL, and the rank's messages still move).
LONG_RUN_CPU_S = 0.02
#: Without an inline run starting for this long (and none running), the standby sleeps until
#: the next one starts.
QUIET_S = 0.1
#: ``ProgressRole._standby`` while a standby thread starts.
_STARTING = -1


class Poller(enum.Enum):
    """Which thread polls MPI: the holder of the progress role, or a thread that waits for
    a result and polls in its place (``Transport.drive_until``)."""

    PROGRESS_THREAD = "progress thread"
    WAITER = "a thread waiting for a result"


class ProgressRole:
    """The holder of the progress role among this transport's progress threads.

    ``lock`` is the transport's; ``run()`` is the poll loop, which returns once the calling
    thread no longer holds the role or the transport stopped; ``on_handoff()`` runs under the
    lock whenever the role moves (the delivery turn goes with it); ``on_failure(error)``
    ends the job when a progress thread fails.
    """

    def __init__(
        self,
        lock: threading.Lock,
        run: Callable[[], None],
        on_handoff: Callable[[], None],
        on_failure: Callable[[BaseException], None],
    ):
        self._lock = lock
        self._run = run
        self._on_handoff = on_handoff
        self._on_failure = on_failure
        # Guarded by the lock:
        self.holder: int | None = None  # ident of the thread that holds the role
        self._holder_tid = 0  # its native id
        self._holder_cpu: Callable[[], float] = time.monotonic  # its CPU time (see _cpu_time)
        self.handoffs = 0  # times the role moved
        self._standby: int | None = None  # ident of the standby thread, if any
        self._inline_since: float | None = None  # start of the holder's inline run
        self._last_inline = -math.inf
        self._quiet = True  # the standby sleeps until an inline run starts
        self._stopped = False
        self._ended = threading.Event()  # the loop ended for good
        self._wake = threading.Event()

    def start(self) -> None:
        """Start the first holder."""
        self._spawn(holder=True)

    def mark_stopped(self) -> None:
        """Under the lock, from the holder's loop once it ended for good."""
        self._stopped = True
        self._ended.set()
        self._wake.set()  # the standby ends too

    def join(self) -> None:
        """Wait until the holder's loop has ended for good (see :meth:`mark_stopped`)."""
        self._ended.wait()

    def _spawn(self, holder: bool) -> None:
        if not holder:
            self._standby = _STARTING  # under the lock
        threading.Thread(
            target=self._main, args=(holder,), daemon=True, name="distgrad-progress"
        ).start()

    def _main(self, holder: bool) -> None:
        me = threading.get_ident()
        try:
            with self._lock:
                if holder:
                    self._become_holder(me)
                else:
                    self._standby = me
            while True:
                if self.holder == me:
                    self._run()
                with self._lock:
                    if self._stopped:
                        return
                    if self.holder == me:
                        continue
                    if self._standby not in (None, me):
                        return  # there is a standby already
                    self._standby = me
                if not self._stand_by(me):
                    return
        except BaseException as e:
            self._on_failure(e)

    def _stand_by(self, me: int) -> bool:
        """Wait until this thread takes the role (True) or the transport stops (False)."""
        watched: tuple[float, float] | None = None  # (an inline run's start, CPU time seen)
        while True:
            self._wake.wait(None if self._quiet else WATCH_S)
            self._wake.clear()
            with self._lock:
                if self._stopped:
                    return False
                now, since = time.monotonic(), self._inline_since
                stuck = False
                if since is not None:
                    cpu = self._holder_cpu()
                    if watched is None or watched[0] != since:
                        watched = (since, cpu)
                    stuck = cpu - watched[1] >= LONG_RUN_CPU_S or (
                        now - since >= WATCH_S and not _running(self._holder_tid)
                    )
                if self.holder is None or stuck:
                    self._take(me)
                    return True
                # Never while a run lasts: a long computation on a crowded core may take far
                # longer than QUIET_S to use LONG_RUN_CPU_S.
                if since is None and now - self._last_inline > QUIET_S:
                    self._quiet = True

    def _become_holder(self, me: int) -> None:
        """Under the lock, on thread ``me``."""
        self.holder, self._holder_tid = me, threading.get_native_id()
        self._holder_cpu = _cpu_time(me)

    def _take(self, me: int) -> None:
        """Under the lock: thread ``me`` takes the role (left by a holder that stepped out,
        or taken from one whose inline run is stuck)."""
        if self.holder is not None:
            self.handoffs += 1
            self._on_handoff()
        self._become_holder(me)
        self._standby = None
        self._inline_since = None

    # -- on the holder -----------------------------------------------------------------

    def begin_inline(self) -> bool:
        """True if this thread is the holder and not in an inline run already: then one
        starts, watched by the standby, and must end with :meth:`end_inline`."""
        me = threading.get_ident()
        with self._lock:
            if self.holder != me or self._inline_since is not None or self._stopped:
                return False
            now = time.monotonic()
            self._inline_since = self._last_inline = now
            wake = self._quiet
            self._quiet = False
            if self._standby is None:
                self._spawn(holder=False)
        if wake:
            self._wake.set()  # the standby watches from now on
        return True

    def end_inline(self) -> bool:
        """The inline run begun by :meth:`begin_inline` on this thread ended; False if it
        lost the role meanwhile (it stepped out, or was taken over)."""
        me = threading.get_ident()
        with self._lock:
            kept = self.holder == me
            if kept:
                self._inline_since = None
            return kept

    def step_out(self) -> bool:
        """Before the holder's inline run waits: the role moves to the standby at once (a
        new thread if there is none). True if this thread held the role in an inline run."""
        me = threading.get_ident()
        with self._lock:
            if self.holder != me or self._inline_since is None:
                return False
            self.holder = None
            self._inline_since = None
            self.handoffs += 1
            self._on_handoff()
            if self._standby is None:
                self._spawn(holder=False)
        self._wake.set()
        return True


def _cpu_time(ident: int) -> Callable[[], float]:
    """A clock of the CPU time of thread ``ident`` (``threading.get_ident()``), readable from
    other threads; wall time where the platform has no such clock."""
    try:
        clock = time.pthread_getcpuclockid(ident)
    except (AttributeError, OSError):
        return time.monotonic
    return lambda: time.clock_gettime(clock)


def _running(tid: int) -> bool:
    """Whether thread ``tid`` of this process runs or waits only for a core (Linux: its state
    in /proc is R), rather than sleeping or waiting for a lock or I/O."""
    try:
        with open(f"/proc/self/task/{tid}/stat", "rb") as f:
            stat = f.read()
    except OSError:  # no /proc: take it as blocked, so the role moves
        return False
    return stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3] == b"R"


def in_default_modes() -> bool:
    """Whether this thread's torch modes are those of a fresh thread."""
    return (
        torch.is_grad_enabled()
        and not torch.is_inference_mode_enabled()
        and not torch.is_autocast_enabled("cpu")
        and not torch.is_autocast_enabled("cuda")
    )


@contextlib.contextmanager
def default_modes() -> Iterator[None]:
    """Grad mode on, inference mode and autocast off, as on a fresh thread."""
    with contextlib.ExitStack() as modes:
        modes.enter_context(torch.inference_mode(False))
        modes.enter_context(torch.enable_grad())
        modes.enter_context(torch.autocast("cpu", enabled=False))
        if torch.cuda.is_available():
            modes.enter_context(torch.autocast("cuda", enabled=False))
        yield
