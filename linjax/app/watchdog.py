"""A stage that stops making progress ends with an error naming it, instead of waiting forever.

A deadlock inside a compiled program (two LAPACK calls waiting on the same XLA:CPU
thread pool) leaves every thread asleep, so nothing in Python ever runs again and no exception
can reach the main thread. A watchdog thread therefore watches a heartbeat (linjax/heartbeat.py):
long loops (training steps, evaluation windows and samples, decode steps, lm-eval forward
passes) call `heartbeat.progress()`, and when a watched stage has not called it for `seconds`,
the watchdog prints which stage stalled and the Python stack of every thread, then ends the
process with exit status 3. `linjax run` resumes from its last finished stage when started again.

    with watchdog.watch("ruler", seconds=1200):
        for sample in samples:
            ...
            heartbeat.progress()

`linjax` also prints every thread's stack on SIGUSR1 and goes on (`kill -USR1 PID`): what a run that
seems stuck is doing (compiling, stepping, waiting on a file) without stopping it.

`seconds` of None or ≤ 0 turns the watchdog off. Compilation counts as no progress, so the
limit must exceed the longest compile of the stage (minutes for a large model). Temporary files
and folders registered with `heartbeat.temporary(path)` are removed before the process ends.
"""

from __future__ import annotations

import contextlib
import faulthandler
import math
import os
import signal
import sys
import threading
import time

from linjax import heartbeat
from linjax.app.arguments import non_negative_float

DEFAULT_SECONDS = 1200.0
EXIT_STATUS = 3

# The heartbeat and the temporary-file registry are core (linjax/heartbeat.py), so that the loops
# that beat do not import the app; re-exported here for `watchdog.progress()` in scripts.
progress = heartbeat.progress
temporary = heartbeat.temporary


def dump_stacks_on_sigusr1() -> None:
    """SIGUSR1 prints the Python stack of every thread to the process's standard error (where its log is
    redirected); the process goes on. The original stream, since a replaced sys.stderr (an in-process
    caller capturing output) may have no file descriptor for the signal handler to write to."""
    if hasattr(signal, "SIGUSR1") and sys.__stderr__ is not None:  # no SIGUSR1 on Windows
        faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)


def _stalled(stage: str, seconds: float, hint: str) -> None:
    message = (f"\nerror: {stage} made no progress for {seconds:.0f} s, so the watchdog stopped it "
               f"(a deadlock or a stuck device call; the stacks of every thread follow). {hint}\n")
    sys.stderr.write(message)
    sys.stderr.flush()
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    heartbeat.remove_temporaries()
    os._exit(EXIT_STATUS)


@contextlib.contextmanager
def watch(stage: str, seconds: float | None = DEFAULT_SECONDS, *, hint: str = "",
          on_stall=_stalled):
    """Runs the body under a watchdog for `stage`; `on_stall(stage, seconds, hint)` is called from
    the watchdog thread when no `progress()` came for `seconds` (by default it ends the process)."""
    if seconds is not None and not (isinstance(seconds, (int, float)) and math.isfinite(seconds)):
        # nan compares false with everything: such a watchdog would spin and never fire
        raise ValueError(f"watchdog seconds must be a finite number (0: off), got {seconds!r}")
    if not seconds or seconds <= 0:
        yield
        return
    done = threading.Event()
    progress()

    def guard():
        interval = min(seconds / 10, 5.0)
        beat, stalled, last_tick = heartbeat.last_progress(), 0.0, time.monotonic()
        while not done.wait(interval):
            now = time.monotonic()
            # Count only time in which this process ran. A tick far later than asked means it was
            # stopped (SIGSTOP, Ctrl-Z, a scheduler suspending the job) or the machine slept: the
            # monotonic clock went on, but that is no stall, and a resumed run must not be killed
            # for it. A deadlock leaves this thread ticking on time, so it still fires.
            ran = min(now - last_tick, 2 * interval)
            last_tick = now
            latest = heartbeat.last_progress()
            if latest != beat:
                beat, stalled = latest, min(now - latest, ran)
            else:
                stalled += ran
            if stalled > seconds:
                on_stall(stage, seconds, hint)
                return

    thread = threading.Thread(target=guard, name=f"linjax-watchdog[{stage}]", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def add_argument(parser) -> None:
    """`--watchdog SECONDS` on a long-running command."""
    # finite and ≥ 0, checked as it is parsed: `--watchdog nan` would never fire
    parser.add_argument("--watchdog", type=non_negative_float, default=DEFAULT_SECONDS, metavar="SECONDS",
                        help=f"end with an error naming the stage when it makes no progress for this long "
                             f"(default {DEFAULT_SECONDS:.0f}; 0: never)")
