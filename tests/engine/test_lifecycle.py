"""A launched engine's stop signals (``duoserve.engine.lifecycle.StopSignals``), in small
processes that import nothing else: stopping at once runs the clean-up, a clean-up that hangs
ends hard, and the first signal while serving drains."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from duoserve.engine.lifecycle import STOP_GRACE_S, StopSignals

PROGRAM = """
import os, signal, sys, time, weakref
from duoserve.engine.lifecycle import StopSignals

signals = StopSignals().install()
if sys.argv[1] == "serving":
    signals.start_serving(60.0)


class Cached:
    pass


def callback(ref):   # the signal's handler runs in here, where Python drops what it raises
    os.kill(os.getpid(), signal.SIGTERM)
    for _ in range(10000):
        pass


try:
    if sys.argv[3] == "in-a-callback":
        cached = Cached()
        ref = weakref.ref(cached, callback)
        del cached
    else:
        os.kill(os.getpid(), signal.SIGTERM)
    for _ in range(3):
        time.sleep(0.2)
        print("draining" if signals.draining else "running", flush=True)
        if signals.draining:
            os.kill(os.getpid(), signal.SIGINT)
    print("not stopped", flush=True)
finally:
    print("clean-up", flush=True)
    if sys.argv[2] == "hang":
        time.sleep(600)
"""


def _run(stage: str, cleanup: str, where: str = "plain") -> tuple[int, list[str], float]:
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", PROGRAM, stage, cleanup, where], capture_output=True, text=True,
                          timeout=60)
    return done.returncode, done.stdout.split(), time.monotonic() - start


def test_a_signal_while_starting_stops_at_once_through_the_clean_up():
    code, lines, _ = _run("starting", "quick")
    assert code == 128 + signal.SIGTERM
    assert lines == ["clean-up"], "stopped where it was, the clean-up run on the way out"


def test_a_stop_python_drops_in_a_weakref_callback_is_raised_again_after_it():
    """torch runs weakref callbacks all through a compile; a SystemExit raised in one is
    printed and dropped by Python: the engine would go on until the hard exit (code 1)."""
    code, lines, _ = _run("starting", "quick", "in-a-callback")
    assert lines == ["clean-up"] and code == 128 + signal.SIGTERM


def test_while_serving_the_first_signal_drains_and_a_second_stops_at_once():
    code, lines, _ = _run("serving", "quick")
    assert lines == ["draining", "clean-up"]
    assert code == 128 + signal.SIGINT


def test_a_clean_up_that_hangs_ends_hard_after_the_grace():
    code, lines, seconds = _run("starting", "hang")
    assert lines == ["clean-up"] and code == 1
    assert seconds < STOP_GRACE_S + 30, "a hang guard: it ended by the grace, not by the 600 s sleep"


def test_draining_ends_when_nothing_is_left_or_at_the_deadline():
    signals = StopSignals()
    signals.start_serving(60.0)
    assert not signals.drained(has_unfinished=False), "no signal came: serving on"
    signals._on_signal(signal.SIGTERM, None)
    assert signals.draining
    assert not signals.drained(has_unfinished=True) and signals.drained(has_unfinished=False)
    signals.deadline = time.monotonic() - 0.001
    assert signals.drained(has_unfinished=True), "the deadline passed"
