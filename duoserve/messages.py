"""Every message that crosses a process boundary, and its encoding (msgpack via msgspec).

Frontend -> engine: ``Hello`` first (it makes the sender one of the engine's frontends), then
``AddRequest``, ``AbortRequest``, ``FinishStopped``, ``ReleaseRequest``, ``Shutdown``.
Engine -> frontend: ``EngineReady`` in answer to ``Hello``, then ``EngineOutputs`` (token
deltas, and engine stats every second), or ``EngineFailed`` if it cannot serve.
Prefill engine <-> decode engine: ``PeerHello`` / ``PeerWelcome`` or ``PeerRefused`` when
they connect, then ``TransferMeta`` (+ the KV frames) and ``TransferAck``.
A request's own fields travel as a ``RequestSpec``, which ``AddRequest`` and ``TransferMeta``
extend (their fields flat on the wire, beside the message's own).
No pickle: a message is plain data, decoded into these types or refused.
"""

from __future__ import annotations

import msgspec

from duoserve.core.outputs import EngineCoreOutput, TokenLogprobs
from duoserve.core.request import Request
from duoserve.sampling_params import SamplingParams


class RequestSpec(msgspec.Struct):
    """What an engine needs to make a request: the fields that cross processes with it."""
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: list[int]
    max_total_tokens: int | None               # the context length: prompt + outputs never exceed it
    arrival_time: float                        # the frontend's monotonic clock (queue time, aging)
    sample_index: int = 0                      # which of an n > 1 prompt's samples
    # a migrated request (its engine went down): the outputs it had already sent, computed
    # again like the prompt and counted as outputs (max_tokens, penalties, a grammar's state)
    output_token_ids: list[int] = []

    @classmethod
    def from_request(cls, request: Request, **fields):
        """This message for ``request``; ``fields`` are the message's own (or override the request's)."""
        return cls(**{"request_id": request.request_id, "prompt_token_ids": request.prompt_token_ids,
                      "params": request.params, "eos_token_ids": list(request.eos_token_ids),
                      "max_total_tokens": request.max_total_tokens, "arrival_time": request.arrival_time,
                      "sample_index": request.sample_index, **fields})

    def to_request(self, request_id: str | None = None) -> Request:
        """A new engine request of these fields (under ``request_id`` when the engine renames it)."""
        request = Request(self.request_id if request_id is None else request_id, self.prompt_token_ids, self.params,
                          tuple(self.eos_token_ids), self.max_total_tokens, self.sample_index, self.arrival_time)
        if self.output_token_ids:
            request.output_token_ids = list(self.output_token_ids)
            request.prompt_logprobs = None   # the frontend has them from the engine that went down
        return request


class Hello(msgspec.Struct, tag=True):
    """A frontend introduces itself; a prefill engine gets the decode engines to hand KV to
    (said again on the same connection: the decode engines changed)."""
    name: str                                  # what the frontend calls this engine (logs, errors)
    peers: dict[str, str] = {}                 # decode engine name -> its address (prefill role)
    frontend_id: str = ""                      # the frontend: its requests are kept apart under this tag
    connection: int = 0                        # counts the frontend's connections to this engine: a hello
                                               # from an earlier one, read late, is ignored


class AddRequest(RequestSpec, tag=True):
    max_total_tokens: int                      # always known here: the frontend fills in the context length
    kv_peer: str | None = None                 # prefill role: the decode engine that gets the KV
    kv_peer_instance: str | None = None        # ... and its incarnation (EngineReady.instance_id)


class AbortRequest(msgspec.Struct, tag=True):
    request_id: str


class FinishStopped(msgspec.Struct, tag=True):
    request_id: str


class ReleaseRequest(msgspec.Struct, tag=True):
    request_id: str


class ChangeAdapter(msgspec.Struct, tag=True):
    """Load a LoRA adapter from ``path`` (None: unload it). The engine answers with one output of
    request id ``op_id``: finish_reason "stop" done, "abort" refused because requests use it,
    "error" refused for the reason in ``error``."""
    op_id: str
    name: str
    path: str | None = None


class Shutdown(msgspec.Struct, tag=True):
    pass


class EngineStats(msgspec.Struct):
    num_running: int               # being computed (prefilling or decoding)
    num_waiting: int               # waiting for a step (prompts, and KV that arrived but has no blocks yet)
    kv_cache_usage: float
    num_blocks: int
    prefix_cache_queries: int      # cumulative prompt tokens looked up
    prefix_cache_hits: int         # cumulative prompt tokens found
    num_preemptions: int
    num_generated_tokens: int      # cumulative
    num_prompt_tokens: int         # cumulative prompt tokens computed
    kv_transfer_bytes: int = 0     # cumulative bytes of KV sent (prefill role)
    kv_transfer_seconds: list[float] = []  # durations of the transfers since the last stats message
    num_kv_leased: int = 0         # prefill role: first token sent, KV held until the decode side acks
    # speculative decoding, cumulative: verifications, guessed tokens, accepted ones, and accepted
    # ones by their position among a step's guesses
    spec_num_steps: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_by_position: list[int] = []
    num_swap_preemptions: int = 0   # of num_preemptions, those swapped out (the rest recomputed)
    num_swapped: int = 0            # requests whose KV waits in the swap space
    swap_usage: float = 0.0
    # the shared KV store, cumulative: blocks found and not found, bytes each way, writes dropped
    # (queue full, or the store failing), errors by kind; and whether its circuit breaker is open
    kv_store_hits: int = 0
    kv_store_misses: int = 0
    kv_store_bytes_read: int = 0
    kv_store_bytes_written: int = 0
    kv_store_dropped_writes: int = 0
    kv_store_errors: dict[str, int] = {}
    kv_store_breaker_open: bool = False
    # the KV tier on disk, the same counters; and what it holds now, files evicted past its size
    # and torn writes found at start (a process killed mid-write)
    kv_disk_hits: int = 0
    kv_disk_misses: int = 0
    kv_disk_bytes_read: int = 0
    kv_disk_bytes_written: int = 0
    kv_disk_dropped_writes: int = 0
    kv_disk_errors: dict[str, int] = {}
    kv_disk_breaker_open: bool = False
    kv_disk_files: int = 0
    kv_disk_bytes_stored: int = 0
    kv_disk_evicted: int = 0
    kv_disk_torn: int = 0
    # structured outputs, cumulative: grammars compiled and refused, seconds compiling; steps that
    # computed token masks, the masks (rows) and the seconds they took
    grammars_compiled: int = 0
    grammars_failed: int = 0
    grammar_compile_seconds: float = 0.0
    grammar_mask_steps: int = 0
    grammar_num_masks: int = 0
    grammar_mask_seconds: float = 0.0
    draining: bool = False          # SIGTERM'd: finishing what it holds, taking nothing new
    # measured rates (moving averages; 0 until measured), for placement (frontend/placement.py):
    # prompt tokens a second of steps that compute prompts, by the step's prompt tokens
    # (core/rates.py PROMPT_SIZES); a step of decodes alone, by its decodes (BATCH_SIZES); and
    # (prefill role) seconds per prompt token of reading and sending KV
    prefill_tokens_per_s: list[float] = []
    decode_step_s: list[float] = []
    handoff_s_per_token: float = 0.0
    # the prefix cache's block hashes (their first 8 bytes, little-endian; the newest
    # CACHED_BLOCKS_REPORTED), sent at most once a second and only when the set changed: None
    # means unchanged. The router's prefix map (frontend/prefix_map.py) reads them.
    cached_blocks: list[int] | None = None



class EngineReady(msgspec.Struct, tag=True):
    role: str
    instance_id: str               # new for every engine process: tells a restarted engine from its predecessor
    fingerprint: dict              # the values the model fingerprint covers (compared across engines)
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    num_blocks: int
    block_size: int
    model_path: str
    tokenizer_json: str | None     # the engine's tokenizer, so the frontend needn't load the model
    bos_token_id: int | None
    add_bos_token: bool
    chat_template: str | None
    memory: dict = {}              # where the engine's memory goes (EngineCore.memory)
    pooling: str | None = None     # how the model file says to pool an embedding (model/pooling.py)
    tokenizer_file: str | None = None   # the file tokenizer_json was read from: a frontend on this
                                        # host that parsed it already keeps its parse
    reranker: str | None = None    # "cross-encoder", "yes-no" or None (LoadedModel.reranker)
    score_template: str | None = None   # a yes/no reranker's prompt from its file (LoadedModel's)


class EngineOutputs(msgspec.Struct, tag=True):
    outputs: list[EngineCoreOutput]
    stats: EngineStats | None = None


class EngineFailed(msgspec.Struct, tag=True):
    error: str
    config_error: bool = False     # refused a configuration value (the error names it): not a fault


# ---- engine <-> engine (the KV handoff) -----------------------------------------------------

class PeerHello(msgspec.Struct, tag=True):
    """A prefill engine connects to a decode engine: the values its model fingerprint covers."""
    name: str
    fingerprint: dict


class PeerWelcome(msgspec.Struct, tag=True):
    name: str
    instance_id: str


class PeerRefused(msgspec.Struct, tag=True):
    error: str


class TransferMeta(RequestSpec, tag=True, kw_only=True):
    """A prefilled request on its way to a decode engine: its spec, its first token, and where its
    KV is. Precedes a transfer's wire frames; with ``shm_name`` the frames lie in that shared memory."""
    first_token: int
    instance_id: str = ""          # the decode engine this is for: a restarted one refuses its predecessor's
    first_logprobs: TokenLogprobs | None = None
    # the prompt's log-probabilities when they were asked for: the decode engine restates them
    # with the first token, so the frontend has them whichever engine's output comes first
    prompt_logprobs: list[TokenLogprobs] | None = None
    sent_at: float = 0.0           # the sender's monotonic clock: only comparable on one host
    # the prefill engine's TTFT stages (queue, prefill), restated like the first token
    stages: dict[str, float] = {}
    num_cached_tokens: int = 0     # prompt tokens the prefill engine found cached (its usage figure)
    frame_sizes: list[int] = []    # filled in by the connector that sends the frames
    shm_name: str | None = None


class TransferAck(msgspec.Struct, tag=True):
    request_id: str


ToEngine = Hello | AddRequest | AbortRequest | FinishStopped | ReleaseRequest | ChangeAdapter | Shutdown
FromEngine = EngineReady | EngineOutputs | EngineFailed
AtEngine = ToEngine | PeerHello | TransferMeta            # what an engine's listening socket receives
AtPrefillPeer = PeerWelcome | PeerRefused | TransferAck   # what a prefill engine hears from a decode engine

_encoder = msgspec.msgpack.Encoder()
_at_engine = msgspec.msgpack.Decoder(AtEngine)
_from_engine = msgspec.msgpack.Decoder(FromEngine)
_at_prefill_peer = msgspec.msgpack.Decoder(AtPrefillPeer)


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def decode_at_engine(data: bytes) -> AtEngine:
    return _at_engine.decode(data)


def decode_from_engine(data: bytes) -> FromEngine:
    return _from_engine.decode(data)


def decode_at_prefill_peer(data: bytes) -> AtPrefillPeer:
    return _at_prefill_peer.decode(data)
