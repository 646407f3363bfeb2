"""How a launched engine's life ends, other than by its frontend's ``Shutdown``.

A frontend launches its engines (``duoserve.frontend.launcher``) and normally stops them by
saying ``Shutdown`` once it drained. Two other ends hold at every stage of an engine's life
(importing, loading, building kernels, compiling, serving):

- Its launcher is gone (killed, crashed): ``stop_with_launcher``. A pidfd of the launcher
  turns readable the moment it exits; the engine then stops where it is.
- SIGTERM or SIGINT (``StopSignals``), from a supervisor, ``kill``, or a terminal's Ctrl-C
  reaching the whole process group::

      starting --signal--> stop at once
      serving  --signal--> draining --nothing unfinished, or --shutdown-timeout passed--> exit 0
                               \\--a second signal--> stop at once

  Draining, the engine goes on serving (its frontend, draining too when the signal reached
  it as well, sends nothing new; one that did not places the requests of an engine that
  exited elsewhere). Requests still there at the deadline end with the process; their
  frontend migrates them or, shutting down itself, ends them.

"Stop at once" raises ``SystemExit`` in the main thread wherever it is, so the clean-up on
the way out runs (the engine's sockets, the shared-memory segments it still owns); a
thread exits the process hard if that clean-up has not ended it within ``STOP_GRACE_S``.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import threading
import time

STOP_GRACE_S = 5.0   # the clean-up's time once an engine stops at once, then a hard exit
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

logger = logging.getLogger(__name__)


def _exit_hard_after(seconds: float) -> None:
    """A clean-up that hangs (a ZeroMQ context waiting on a socket left open) must not keep
    the process: exit without it once ``seconds`` passed."""
    def hard_exit() -> None:
        time.sleep(seconds)
        os._exit(1)

    threading.Thread(target=hard_exit, name="stop-grace", daemon=True).start()


def stop_at_once(code: int) -> None:
    """Raise ``SystemExit(code)`` here (the main thread, from a signal handler), the process
    ending hard after ``STOP_GRACE_S`` if the clean-up does not end it."""
    _exit_hard_after(STOP_GRACE_S)
    raise SystemExit(code)


def stop_with_launcher(launcher_pid: int) -> None:
    """A thread waits on a pidfd of the launcher, readable the moment it exits (killed or not):
    then the main thread gets SIGHUP, whose handler stops the engine at once wherever it is.
    (The fork server is no watcher: every process forked from it holds its pipe open.)"""
    def launcher_gone(signum, frame) -> None:
        raise SystemExit(0)   # the watch thread exits hard if this does not end the process

    try:
        pidfd = os.pidfd_open(launcher_pid)
    except ProcessLookupError:   # gone already
        raise SystemExit(0) from None
    except (AttributeError, OSError):   # no pidfd here: the serving loop's check remains
        return
    signal.signal(signal.SIGHUP, launcher_gone)

    def watch() -> None:
        select.select([pidfd], [], [])
        logger.warning("the process that launched this engine is gone: stopping")
        os.kill(os.getpid(), signal.SIGHUP)
        time.sleep(STOP_GRACE_S)   # the handler's clean-up did not end the process (or never ran)
        os._exit(1)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()


class StopSignals:
    """SIGTERM and SIGINT in a launched engine: stop at once while starting or when a second
    one comes; drain for ``drain_timeout`` seconds when the first comes while serving."""

    def __init__(self) -> None:
        self.serving = False
        self.drain_timeout = 0.0
        self.deadline: float | None = None   # set by the first signal while serving

    def install(self) -> "StopSignals":
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)
        return self

    def start_serving(self, drain_timeout: float) -> None:
        self.drain_timeout, self.serving = drain_timeout, True

    @property
    def draining(self) -> bool:
        return self.deadline is not None

    def drained(self, has_unfinished: bool) -> bool:
        """Draining, and nothing is left to finish or the deadline passed: the engine exits."""
        return self.deadline is not None and (not has_unfinished or time.monotonic() >= self.deadline)

    def _on_signal(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if not self.serving or self.draining:
            logger.warning("%s %s: stopping at once", name, "while draining" if self.serving else "while starting")
            stop_at_once(128 + signum)
        self.deadline = time.monotonic() + self.drain_timeout
        logger.warning("%s: draining (the requests here get %.0fs; a second signal stops at once)",
                       name, self.drain_timeout)
