"""Seconds from `duoserve serve` to its first healthy `/health`, with the start's stages.

    python benchmarks/server_start.py                                   # the default model
    python benchmarks/server_start.py --model ~/models/gemma-3-270m-q4_k_m.gguf
    python benchmarks/server_start.py --fresh-home -- --compile          # a cold cache, compiled

Starts the server as a user does (no flags but those after ``--``), reads its log line by line
as it is written, stamping each with the seconds since the start, and polls ``/health`` every
50 ms; prints the stamped log (the stages: kernels, weights, KV pool, compile, ready) and the
seconds to healthy, then stops the server (SIGTERM) and waits for its process group to end.
``--fresh-home`` gives it an empty home directory (no tokenizer, fingerprint or compile cache: a
first start after the README's install, whose ``duoserve build-kernels`` built the kernels beside
the package); ``--unbuilt-kernels`` also points ``DUOSERVE_KERNEL_DIR`` into that home, so the
start builds them too (an install that skipped that step). Otherwise the user's caches are used
(a later start). ``--starts N`` repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(port: int) -> bool:
    try:
        request = urllib.request.Request(f"http://127.0.0.1:{port}/health", headers={"Connection": "close"})
        with urllib.request.urlopen(request, timeout=1) as response:
            return response.status == 200
    except OSError:
        return False


def one_start(flags: list[str], fresh_home: bool, timeout: float, unbuilt_kernels: bool = False) -> dict:
    port = free_port()
    env = dict(os.environ)
    home = tempfile.mkdtemp(prefix="duoserve-home-") if fresh_home or unbuilt_kernels else None
    if home:
        env.update(HOME=home, XDG_CACHE_HOME=os.path.join(home, ".cache"))
    if unbuilt_kernels:
        env.update(DUOSERVE_KERNEL_DIR=os.path.join(home, "kernels"))
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "duoserve", "serve", "--port", str(port), *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    lines: list[tuple[float, str]] = []

    def read() -> None:
        for line in proc.stdout:
            lines.append((time.monotonic() - start, line.rstrip()))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    ready = None
    try:
        while time.monotonic() - start < timeout and proc.poll() is None:
            if healthy(port):
                ready = time.monotonic() - start
                break
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        reader.join(5)
        if home:   # its kernels and caches: tens of MB a start
            shutil.rmtree(home, ignore_errors=True)
    for at, line in lines:
        print(f"{at:7.2f}s  {line}")
    return {"healthy_s": ready, "exit": proc.returncode}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model file (default: the packaged default model)")
    parser.add_argument("--fresh-home", action="store_true", help="an empty home: no tokenizer or compile cache")
    parser.add_argument("--unbuilt-kernels", action="store_true",
                        help="an empty home and no kernels built at install: the start builds them")
    parser.add_argument("--starts", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("flags", nargs="*", help="more serve flags, after --")
    args = parser.parse_args()
    flags = (["--model", args.model] if args.model else []) + args.flags
    results = [one_start(flags, args.fresh_home, args.timeout, args.unbuilt_kernels) for _ in range(args.starts)]
    print(json.dumps({"model": args.model or "default", "flags": args.flags, "fresh_home": args.fresh_home,
                      "unbuilt_kernels": args.unbuilt_kernels,
                      "healthy_s": [r["healthy_s"] for r in results]}))


if __name__ == "__main__":
    main()
