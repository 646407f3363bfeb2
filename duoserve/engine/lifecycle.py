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
import sys
import threading
import time

STOP_GRACE_S = 5.0   # the clean-up's time once an engine stops at once, then a hard exit
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
REDELIVER_S = 0.01   # a dropped stop is raised again this much later, past the callback that dropped it

logger = logging.getLogger(__name__)


def _exit_hard_after(seconds: float) -> None:
    """A clean-up that hangs (a ZeroMQ context waiting on a socket left open) must not keep
    the process: exit without it once ``seconds`` passed."""
    def hard_exit() -> None:
        time.sleep(seconds)
        os._exit(1)

    threading.Thread(target=hard_exit, name="stop-grace", daemon=True).start()


class StopSignals:
    """The signals that end a launched engine. SIGTERM and SIGINT: stop at once while starting
    or when a second one comes; drain for ``drain_timeout`` seconds when the first comes while
    serving. SIGHUP: stop at once (``stop_with_launcher`` sends it when the launcher is gone).

    Stopping raises ``SystemExit`` from the handler, in whatever the main thread runs. When
    that is a weakref callback or a ``__del__`` (torch runs many while it compiles), Python
    prints the exception and drops it: ``sys.unraisablehook`` sees it, and SIGHUP delivers
    it again a moment later, to land in the code that follows."""

    def __init__(self) -> None:
        self.serving = False
        self.drain_timeout = 0.0
        self.deadline: float | None = None   # set by the first signal while serving
        self.exit_code: int | None = None    # set once stopping at once began
        self._dropped = False                # the last SystemExit raised was dropped: raise it again
        self.failed = False                  # the start failed and was told: the engine is on its way out

    def install(self) -> "StopSignals":
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)
        signal.signal(signal.SIGHUP, self._on_hangup)
        sys.unraisablehook = self._on_unraisable
        return self

    def start_serving(self, drain_timeout: float) -> None:
        self.drain_timeout, self.serving = drain_timeout, True

    @property
    def draining(self) -> bool:
        return self.deadline is not None

    def drained(self, has_unfinished: bool) -> bool:
        """Draining, and nothing is left to finish or the deadline passed: the engine exits."""
        return self.deadline is not None and (not has_unfinished or time.monotonic() >= self.deadline)

    def _stop_at_once(self, code: int) -> None:
        """Raise ``SystemExit`` here, the process ending hard after ``STOP_GRACE_S`` if the
        clean-up on the way out does not end it. A signal that comes while the clean-up runs
        does not interrupt it."""
        if self.exit_code is not None and not self._dropped:
            return
        if self.exit_code is None:
            self.exit_code = code
            _exit_hard_after(STOP_GRACE_S)
        self._dropped = False
        raise SystemExit(self.exit_code)

    def _on_signal(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if not self.serving or self.draining:
            if self.exit_code is None and not self.failed:   # after a failed start the launcher prints
                # the failure as its one line: a stop it then sends says nothing more
                logger.warning("%s %s: stopping at once", name, "while draining" if self.serving else "while starting")
            self._stop_at_once(128 + signum)
            return
        self.deadline = time.monotonic() + self.drain_timeout
        logger.warning("%s: draining (the requests here get %.0fs; a second signal stops at once)",
                       name, self.drain_timeout)

    def _on_hangup(self, signum: int, frame) -> None:
        self._stop_at_once(0)

    def _on_unraisable(self, unraisable) -> None:
        if isinstance(unraisable.exc_value, SystemExit) and self.exit_code is not None:
            self._dropped = True
            # from another thread, a moment later: sent from here, the handler would run (and
            # its SystemExit be dropped) still inside this hook
            threading.Timer(REDELIVER_S, os.kill, (os.getpid(), signal.SIGHUP)).start()
            return
        sys.__unraisablehook__(unraisable)


def stop_with_launcher(launcher_pid: int) -> None:
    """A thread waits on a pidfd of the launcher, readable the moment it exits (killed or not):
    then the main thread gets SIGHUP, which stops the engine at once wherever it is
    (``StopSignals``), and the process exits hard if that has not ended it within
    ``STOP_GRACE_S``. (The fork server is no watcher: every process forked from it holds its
    pipe open.)"""
    try:
        pidfd = os.pidfd_open(launcher_pid)
    except ProcessLookupError:   # gone already
        raise SystemExit(0) from None
    except (AttributeError, OSError):   # no pidfd here: the serving loop's check remains
        return

    def watch() -> None:
        select.select([pidfd], [], [])
        logger.warning("the process that launched this engine is gone: stopping")
        os.kill(os.getpid(), signal.SIGHUP)
        time.sleep(STOP_GRACE_S)   # the handler's clean-up did not end the process (or never ran)
        os._exit(1)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()
