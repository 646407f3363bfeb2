"""Turns on shared cores (duoserve.engine.cpu_turns): who runs when, read from the shared words."""

import threading
import time

import pytest

from duoserve.config import TurnsConfig
from duoserve.engine.cpu_turns import DECODE, IDLE, PAUSED, PREFILL, RUNNING, WANT, CpuTurns, create_turns_file


@pytest.fixture
def host(tmp_path):
    """A prefill engine's and a decode engine's turns over one file."""
    path = str(tmp_path / "turns")
    create_turns_file(path, 2)
    prefill = CpuTurns(TurnsConfig(path, 0, quantum=0.05), "prefill")
    decode = CpuTurns(TurnsConfig(path, 1), "decode")
    yield prefill, decode
    prefill.close()
    decode.close()


def state(turns: CpuTurns, slot: int) -> tuple[int, int, int]:
    """(role, state, steps) of ``slot`` as every engine reads them."""
    return tuple(turns.words[slot * 3: slot * 3 + 3])


def waiting_decode_step(prefill: CpuTurns, decode: CpuTurns, inside) -> threading.Thread:
    """A decode step on a thread of its own (``inside()`` runs in it), returned once it waits
    for the cores (its slot shows WANT)."""
    def step():
        with decode.decode_step():
            inside()

    waiter = threading.Thread(target=step)
    waiter.start()
    while state(prefill, 1)[1] != WANT:
        time.sleep(0.001)
    return waiter


def test_a_decode_step_runs_at_once_while_no_prompt_is_computed(host):
    prefill, decode = host
    assert state(decode, 0) == (PREFILL, IDLE, 0) and state(decode, 1) == (DECODE, IDLE, 0)
    with decode.decode_step():
        assert state(prefill, 1) == (DECODE, RUNNING, 0)
    with decode.decode_step():
        pass
    assert state(prefill, 1) == (DECODE, IDLE, 2)


def test_a_prompt_lends_the_cores_to_a_waiting_decode_step_after_its_quantum(host):
    prefill, decode = host
    entered = threading.Event()
    with prefill.prefill_step():
        assert state(decode, 0)[1] == RUNNING
        waiter = waiting_decode_step(prefill, decode, entered.set)
        prefill.checkpoint()
        assert not entered.is_set() and prefill.num_pauses == 0, "within its quantum a prompt keeps the cores"
        prefill.since -= prefill.quantum          # its quantum is spent
        prefill.checkpoint()                      # returns once the decode step ran
        assert entered.is_set() and prefill.num_pauses == 1
        assert state(decode, 0)[1] == RUNNING and state(decode, 1) == (DECODE, IDLE, 1)
        waiter.join()
        prefill.since -= prefill.quantum
        prefill.checkpoint()
        assert prefill.num_pauses == 1, "no decode step waits: no pause"
    assert state(decode, 0) == (PREFILL, IDLE, 0)


def test_a_paused_prompt_shows_paused_and_a_running_decode_step_is_never_cut(host):
    prefill, decode = host
    seen = []
    with prefill.prefill_step():   # the waiter notes the prompt's state while its step runs
        waiter = waiting_decode_step(prefill, decode, lambda: seen.append(state(decode, 0)[1]))
        prefill.since -= prefill.quantum
        prefill.checkpoint()
        waiter.join()
    assert seen == [PAUSED]
    started = threading.Event()

    def prompt_step():
        with prefill.prefill_step():
            started.set()

    with decode.decode_step():
        later = threading.Thread(target=prompt_step)
        later.start()
        assert not started.wait(0.02), "a prompt step does not start while a decode step runs"
    later.join()
    assert started.is_set() and state(decode, 0)[1] == IDLE


def test_slots_are_checked(tmp_path):
    path = str(tmp_path / "turns")
    with pytest.raises(ValueError, match="at most 64"):
        create_turns_file(path, 65)
    create_turns_file(path, 1)
    with pytest.raises(ValueError, match="turn slot 1 is not among the file's 1"):
        CpuTurns(TurnsConfig(path, 1), "decode")


def test_a_waiting_engine_sleeps_until_the_bell_rings(host, monkeypatch):
    """On Linux a waiting engine sleeps in the kernel: it looks again when another engine changes
    its state, not on a clock (looks counted while a prompt step holds the cores), and the ring
    is what wakes it (the recheck set far past the test's bound)."""
    prefill, decode = host
    assert decode.futex is not None, "futexes on this platform"
    monkeypatch.setattr("duoserve.engine.cpu_turns.RECHECK_S", 30.0)
    monkeypatch.setattr("duoserve.engine.cpu_turns.MAX_WAIT", 60.0)
    looks, entered = [], threading.Event()
    others = decode._others
    monkeypatch.setattr(decode, "_others", lambda *a: looks.append(1) or others(*a))
    with prefill.prefill_step():
        waiter = waiting_decode_step(prefill, decode, entered.set)
        time.sleep(0.2)      # polling every 0.2 ms would look about a thousand times meanwhile
        assert not entered.is_set() and len(looks) <= 3
    assert entered.wait(10.0), "the prompt step's end rang the bell"
    waiter.join()
    assert len(looks) <= 4
