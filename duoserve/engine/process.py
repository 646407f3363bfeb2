"""An EngineCore in its own process, driven over ZeroMQ.

Lifecycle: the frontend binds two sockets and starts this process, which connects,
loads the model and answers ``EngineReady`` (or ``EngineFailed``). Then it loops:
take every waiting message (add, abort, stop, release, shutdown), run one step if any
request is unfinished, push the outputs. It blocks on its input only while idle, and
pushes stats every ``STATS_INTERVAL`` seconds, which doubles as a heartbeat. It exits
on ``Shutdown`` or when its parent process is gone.
"""

from __future__ import annotations

import logging
import os
import time
import traceback

STATS_INTERVAL = 1.0
IDLE_POLL_MS = 100


def engine_main(config_bytes: bytes, input_addr: str, output_addr: str, log_level: int = logging.INFO,
                handoff: dict | None = None) -> None:
    """Process entry point (kept import-light: heavy modules load after the sockets connect).

    ``handoff`` (prefill and decode roles): ``kv_addr`` where the decode engine receives KV,
    ``ack_addr`` where the prefill engine receives acknowledgements, ``transport`` shm or tcp.
    """
    import zmq

    from duoserve.engine import messages as msg

    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s engine: %(message)s")
    _pin(config_bytes)
    parent = os.getppid()
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(input_addr)
    outbox = ctx.socket(zmq.PUSH)
    outbox.connect(output_addr)
    try:
        core = _start_core(config_bytes)
        fingerprint = _attach_connector(core, handoff)
    except Exception as exc:  # a bad config or model: say why, then stop
        logging.getLogger(__name__).error("engine failed to start: %s", exc)
        outbox.send(msg.encode(msg.EngineFailed(f"{type(exc).__name__}: {exc}")))
        outbox.close(linger=2000)
        return
    outbox.send(msg.encode(_ready(core, fingerprint)))
    try:
        _loop(core, inbox, outbox, parent)
    except Exception:
        outbox.send(msg.encode(msg.EngineFailed(traceback.format_exc(limit=5))))
        raise
    finally:
        outbox.close(linger=1000)
        inbox.close(linger=0)
        ctx.term()


def _pin(config_bytes: bytes) -> None:
    """Apply ``cpus`` before torch starts its threads (they inherit the affinity)."""
    import msgspec

    cpus = msgspec.msgpack.decode(config_bytes).get("cpus")
    if cpus:
        os.sched_setaffinity(0, cpus)


def _start_core(config_bytes: bytes):
    import msgspec

    from duoserve.config import EngineConfig
    from duoserve.engine.core import EngineCore

    config = msgspec.msgpack.decode(config_bytes, type=EngineConfig)
    return EngineCore(config)


def _attach_connector(core, handoff: dict | None) -> dict:
    """Connect a prefill or decode engine to its peer; returns the fingerprint values."""
    role = core.config.role
    if role == "colocated":
        return {}
    from duoserve.kv.zmq_connector import DecodeEnd, PrefillEnd
    from duoserve.model.fingerprint import describe, fingerprint

    values = describe(core.arch, core.tokenizer, core.loaded.path)
    digest = fingerprint(values)
    if handoff is None:
        raise ValueError(f"a {role} engine needs the addresses of its peer (kv_addr, ack_addr)")
    if role == "prefill":
        core.attach_connector(PrefillEnd(handoff["ack_addr"], handoff["kv_addr"], digest,
                                         handoff.get("transport", "shm")))
    else:
        core.attach_connector(DecodeEnd(handoff["kv_addr"], handoff["ack_addr"], digest))
    return values


def _ready(core, fingerprint: dict):
    from duoserve.engine.messages import EngineReady

    tok = core.tokenizer
    return EngineReady(
        role=core.config.role, fingerprint=fingerprint,
        max_model_len=core.max_model_len, vocab_size=core.vocab_size, eos_token_ids=list(core.eos_token_ids),
        num_blocks=core.num_blocks, block_size=core.config.cache.block_size, model_path=str(core.loaded.path),
        tokenizer_json=None if tok is None else tok.backend.to_str(),
        bos_token_id=None if tok is None else tok.bos_token_id,
        add_bos_token=False if tok is None else tok.add_bos_token,
        chat_template=None if tok is None else tok.chat_template,
    )


def _handle(core, message) -> list:
    """Apply one frontend message; returns outputs it produced (aborts) or None for Shutdown."""
    from duoserve.core.request import Request
    from duoserve.engine import messages as msg

    if isinstance(message, msg.AddRequest):
        request = Request(message.request_id, message.prompt_token_ids, message.params,
                          tuple(message.eos_token_ids), message.max_total_tokens,
                          arrival_time=message.arrival_time)
        core.add_request(request)
        return []
    if isinstance(message, msg.AbortRequest):
        return core.abort(message.request_id)
    if isinstance(message, msg.FinishStopped):
        core.finish_stopped(message.request_id)
        return []
    if isinstance(message, msg.ReleaseRequest):
        core.release(message.request_id)
        return []
    return None


def _loop(core, inbox, outbox, parent: int) -> None:
    import zmq

    from duoserve.engine import messages as msg

    log = logging.getLogger(__name__)
    last_stats = 0.0
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    peer_sockets = core.connector.sockets() if core.connector is not None else []
    for sock in peer_sockets:
        poller.register(sock, zmq.POLLIN)
    while True:
        outputs = []
        busy = core.has_work()
        events = dict(poller.poll(0 if busy else IDLE_POLL_MS))
        while inbox in events or inbox.poll(0, zmq.POLLIN):
            events.pop(inbox, None)
            try:
                message = msg.decode_to_engine(inbox.recv())
            except Exception as exc:  # a malformed message is dropped, never fatal
                log.error("dropped a malformed message: %s", exc)
                continue
            try:
                produced = _handle(core, message)
            except Exception as exc:
                log.error("cannot apply %s: %s", type(message).__name__, exc)
                continue
            if produced is None:
                return
            outputs += produced
        # when idle the poll above waited, so leased KV is checked for acks and deadlines
        # once per IDLE_POLL_MS, not in a busy loop
        if core.has_unfinished() or any(s in events for s in peer_sockets):
            outputs += core.step()
        now = time.monotonic()
        stats = None
        if now - last_stats >= STATS_INTERVAL:
            stats, last_stats = core.stats(), now
            if os.getppid() != parent:
                log.warning("the frontend process is gone: stopping")
                return
        if outputs or stats is not None:
            outbox.send(msg.encode(msg.EngineOutputs(outputs, stats)))
