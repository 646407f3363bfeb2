"""Cores lent between prefill and decode engines on one host: they take turns on every core.

Split cores (prefill on one, decode on the other) leave each role half the machine: a long
prompt prefills at half the speed it would colocated, and a decode engine's core idles between
requests. Where a frontend launches both roles on the same cores (``--mode disaggregated`` with
no threads or CPUs given), every engine gets every core and they take turns instead:

- a decode engine that has a step to run says so (``WANT``) and runs it as soon as no prefill
  engine is computing; its step is never cut;
- a prefill engine computes at will, and between two layers of a prompt step, once it has held
  the cores for ``quantum`` seconds while a decode engine waits, it pauses until every waiting
  decode engine has run one step, then goes on.

So a decode step waits at most ``quantum`` plus one layer of a prompt (the inter-token latency
is bounded, as chunking bounds it colocated), a prompt gets all the cores between decode steps,
and an idle role takes nothing. Decode steps run back to back while no prompt is prefilled.

The turns live in a small shared file (one 8-byte word per field, written whole: no torn
reads), one slot per engine, and a last word, the bell: an engine rings it after changing its
state, and a waiting engine sleeps on it in the kernel (a Linux futex) until it rings. Waiting
takes no core: a waiter that looked every 0.2 ms instead took the computing engine's threads
off their cores often enough to slow its prompt measurably (BENCHMARKS.md, session 27). The
protocol is advisory: a race costs a moment of two engines on the same cores, never a wrong
token, and every wait is bounded (``MAX_WAIT``) so that an engine that dies mid-turn holds
nobody up for longer.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import sys
import time
from contextlib import contextmanager

from duoserve.config import Role, TurnsConfig

IDLE, WANT, RUNNING, PAUSED = 0, 1, 2, 3
PREFILL, DECODE = 1, 2
FIELDS = 3          # per slot: role, state, steps run
MAX_SLOTS = 64
POLL_S = 0.0002     # without futexes, a waiting engine looks again this often
RECHECK_S = 0.01    # with them, at the latest: a ring lost to two engines ringing at once
MAX_WAIT = 2.0      # seconds: no engine waits longer for a turn, whatever the others do
FUTEX_WAIT, FUTEX_WAKE = 0, 1     # shared between processes: not the _PRIVATE forms
SYS_FUTEX = {"x86_64": 202, "aarch64": 98}


def _futex_syscall():
    """libc's ``syscall`` and futex's number where there are futexes, else None (polling)."""
    number = SYS_FUTEX.get(platform.machine())
    if not sys.platform.startswith("linux") or number is None:
        return None
    call = ctypes.CDLL(None, use_errno=True).syscall
    call.restype = ctypes.c_long
    return call, number


def create_turns_file(path: str, num_slots: int) -> None:
    """The launcher's: a zeroed file with ``num_slots`` slots (every slot idle, no role)."""
    if not 0 < num_slots <= MAX_SLOTS:
        raise ValueError(f"{num_slots} engines share these cores; at most {MAX_SLOTS} can take turns")
    with open(path, "wb") as f:
        f.write(bytes(8 * (FIELDS * num_slots + 1)))   # the slots, then the bell


class CpuTurns:
    """One engine's side of the turns: ``decode_step()`` / ``prefill_step()`` around its steps,
    and ``checkpoint()`` between a prompt step's layers (prefill engines)."""

    def __init__(self, config: TurnsConfig, role: Role) -> None:
        fd = os.open(config.path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        self.words = memoryview(self._map).cast("q")
        self.num_slots = (len(self.words) - 1) // FIELDS
        # the bell's low 32 bits (a futex is 32 bits; x86 and arm64 are little-endian)
        self.bell = ctypes.c_int32.from_buffer(self._map, 8 * FIELDS * self.num_slots)
        self.futex = _futex_syscall()
        if not 0 <= config.slot < self.num_slots:
            raise ValueError(f"turn slot {config.slot} is not among the file's {self.num_slots}")
        self.slot, self.quantum = config.slot, config.quantum
        self.role = PREFILL if Role(role) is Role.PREFILL else DECODE
        self.words[self._at(self.slot)] = self.role
        self._set(IDLE)
        self.since = 0.0          # prefill: when it last took the cores
        self.num_pauses = 0       # prefill: turns given to decode steps (stats and tests)

    def close(self) -> None:
        self._set(IDLE)
        self.words[self._at(self.slot)] = 0
        del self.bell
        self.words.release()
        self._map.close()

    # ---- the shared words ---------------------------------------------------------------

    @staticmethod
    def _at(slot: int) -> int:
        return slot * FIELDS

    def _set(self, state: int) -> None:
        self.words[self._at(self.slot) + 1] = state
        self._ring()

    def _ring(self) -> None:
        """Wake every engine sleeping on the bell (after a change they may wait for)."""
        self.bell.value = (self.bell.value + 1) & 0x7FFFFFFF
        if self.futex is not None:
            call, number = self.futex
            call(ctypes.c_long(number), ctypes.byref(self.bell), ctypes.c_long(FUTEX_WAKE),
                 ctypes.c_long(0x7FFFFFFF), None, None, ctypes.c_long(0))

    def _others(self, role: int, state: int) -> list[int]:
        w = self.words
        return [s for s in range(self.num_slots) if w[self._at(s)] == role and w[self._at(s) + 1] == state]

    def _steps(self, slot: int) -> int:
        return self.words[self._at(slot) + 2]

    def _wait(self, done) -> None:
        """Until ``done()`` or ``MAX_WAIT``: asleep on the bell between looks."""
        deadline = time.monotonic() + MAX_WAIT
        while True:
            rung = self.bell.value      # read before looking: a ring after the look wakes us
            left = deadline - time.monotonic()
            if done() or left <= 0:
                return
            if self.futex is None:
                time.sleep(POLL_S)
                continue
            call, number = self.futex
            seconds = min(left, RECHECK_S)
            timeout = (ctypes.c_long * 2)(int(seconds), int(seconds % 1 * 1e9))
            call(ctypes.c_long(number), ctypes.byref(self.bell), ctypes.c_long(FUTEX_WAIT),
                 ctypes.c_long(rung), timeout, None, ctypes.c_long(0))

    def step(self):
        """Around one step of this engine: its role's side of the turns."""
        return self.prefill_step() if self.role == PREFILL else self.decode_step()

    # ---- decode engines -----------------------------------------------------------------

    @contextmanager
    def decode_step(self):
        """Around one decode engine step: it starts once no prefill engine computes."""
        self._set(WANT)
        self._wait(lambda: not self._others(PREFILL, RUNNING))
        self._set(RUNNING)
        try:
            yield
        finally:
            w = self.words
            w[self._at(self.slot) + 2] = w[self._at(self.slot) + 2] + 1
            self._set(IDLE)

    # ---- prefill engines ----------------------------------------------------------------

    @contextmanager
    def prefill_step(self):
        """Around one prefill engine step: it starts once no decode step is running."""
        self._wait(lambda: not self._others(DECODE, RUNNING))
        self._set(RUNNING)
        self.since = time.monotonic()
        try:
            yield
        finally:
            self._set(IDLE)

    def checkpoint(self) -> None:
        """Between two layers of a prompt step: past its quantum, with a decode engine waiting,
        pause until each waiting one has run a step."""
        if time.monotonic() - self.since < self.quantum:
            return
        waiting = self._others(DECODE, WANT)
        if not waiting:
            return
        steps = {s: self._steps(s) for s in waiting}
        self._set(PAUSED)
        self.num_pauses += 1
        self._wait(lambda: all(self._steps(s) != n for s, n in steps.items())
                   and not self._others(DECODE, RUNNING))
        self._set(RUNNING)
        self.since = time.monotonic()
