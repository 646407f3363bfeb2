"""KV handoff time as a fraction of prefill time, on one host.

    python benchmarks/kv_handoff.py --tokens 2000 --transport shm

Prefills one prompt on the default model (fp32), then moves its KV the way a prefill
engine hands it to a decode engine: read it out of the paged cache, encode it (wire
format v1), pass it through the ZeroMQ connector (shared memory or TCP on loopback),
decode and check it, and write it into a cache of another block size. Both ends live
in this process, so the figure counts every copy but no scheduling between processes.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time

import torch
import zmq


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--transport", default="shm", choices=["shm", "tcp"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from duoserve.config import ModelConfig
    from duoserve.kv.connector import KVTransfer
    from duoserve.kv.reblock import extract_kv, insert_kv
    from duoserve import messages as msg
    from duoserve.kv.zmq_connector import DecodeConnector, PrefillConnector
    from duoserve.model.attention import AttentionMetadata
    from duoserve.worker.backends import load_model, use_cpu_kernels
    from duoserve.sampling_params import SamplingParams

    loaded = load_model(ModelConfig(dtype="float32"))
    model, arch = loaded.model, loaded.arch
    use_cpu_kernels(model, torch.float32)   # as the runner does: float32 KV caches below
    rng = random.Random(0)
    prompt = [rng.randrange(1000, 40000) for _ in range(args.tokens)]

    def caches(block_size: int):
        num_blocks = -(-args.tokens // block_size)
        shape = (num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
        return [(torch.zeros(shape), torch.zeros(shape)) for _ in range(arch.num_layers)], list(range(num_blocks))

    src, src_blocks = caches(16)
    dst, dst_blocks = caches(32)
    prefill_times = []
    with torch.inference_mode():
        for _ in range(2):
            start = time.perf_counter()
            for chunk in range(0, args.tokens, 512):  # chunked as the engine would (budget 512)
                end = min(chunk + 512, args.tokens)
                meta = AttentionMetadata.build([end - chunk], [end], [src_blocks], 16)
                hidden = model(torch.tensor(prompt[chunk:end]), torch.arange(chunk, end), src, meta)
            model.compute_logits(hidden[-1:])
            prefill_times.append(time.perf_counter() - start)
    address = ("ipc:///tmp/duoserve-bench-kv" if args.transport == "shm"  # ipc peers get shared memory
               else "tcp://127.0.0.1:5791")
    fingerprint, values = bytes(32), {"model": "bench"}
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.bind(address)
    receiver = DecodeConnector(router, fingerprint, values, "bench")
    sender = PrefillConnector(fingerprint, values)

    def take(block: bool = True):
        while router.poll(1000 if block else 0):
            identity, payload, *frames = router.recv_multipart(copy=False)
            receiver.receive(identity.bytes, msg.decode_at_engine(payload.bytes), frames)
            block = False

    sender_hello = threading.Thread(target=sender.connect, args=("bench-prefill", {"bench-decode": address}, 10))
    sender_hello.start()
    take()
    sender_hello.join()
    handoffs = []
    for i in range(args.repeats):
        start = time.perf_counter()
        keys, values = extract_kv(src, src_blocks, args.tokens)
        meta = msg.TransferMeta(f"r{i}", prompt, SamplingParams(), [2], None, 0.0, first_token=0, instance_id="bench")
        sender.send(KVTransfer(meta, keys, values, peer="bench-decode"))
        transfers = []
        while not transfers:
            take()
            transfers = receiver.poll_transfers()
        insert_kv(dst, dst_blocks, transfers[0].keys, transfers[0].values)
        handoffs.append(time.perf_counter() - start)
    sender.close()
    router.close(linger=0)
    assert torch.equal(dst[3][0].flatten(0, 1)[: args.tokens], src[3][0].flatten(0, 1)[: args.tokens])
    prefill, handoff = min(prefill_times), statistics.median(handoffs)
    print(json.dumps({"tokens": args.tokens, "transport": args.transport, "kv_bytes": transfers[0].num_bytes,
                      "prefill_s": prefill, "handoff_s": handoff, "handoff_fraction": handoff / prefill,
                      "handoff_gbs": transfers[0].num_bytes / handoff / 1e9}, indent=2))


if __name__ == "__main__":
    main()
