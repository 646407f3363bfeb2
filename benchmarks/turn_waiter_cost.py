"""What a waiting engine costs the engine computing beside it on shared cores: a 1,500-token
prompt (``LLM``, ``max_tokens`` 1, a fresh prompt each time: no prefix hits) with no other
engine, then beside a process that waits for its turn (``CpuTurns.decode_step`` while this
process holds a prefill step) the way engines wait now (asleep on the turns file's bell) and
the way they did (``time.sleep`` polls, every 0.2 ms). Rounds alternate the three; medians in s.

    python benchmarks/turn_waiter_cost.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time

WAITER = """
import sys
from duoserve.config import TurnsConfig
from duoserve.engine.cpu_turns import CpuTurns
turns = CpuTurns(TurnsConfig(sys.argv[1], 1), "decode")
if sys.argv[2] == "poll":
    turns.futex = None
while True:
    with turns.decode_step():   # waits while the measuring process holds a prefill step
        pass
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=1500)
    args = parser.parse_args()

    from duoserve import LLM, SamplingParams
    from duoserve.config import TurnsConfig
    from duoserve.engine.cpu_turns import CpuTurns, create_turns_file

    llm, rng = LLM(), random.Random(0)
    params = SamplingParams(max_tokens=1, temperature=0)
    folder = tempfile.TemporaryDirectory(prefix="duoserve-turns-")
    path = f"{folder.name}/turns"
    create_turns_file(path, 2)
    turns = CpuTurns(TurnsConfig(path, 0), "prefill")

    def prompt_seconds() -> float:
        prompt = [rng.randrange(1000, 40000) for _ in range(args.prompt_len)]
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        return time.perf_counter() - start

    prompt_seconds()   # warm
    times: dict[str, list[float]] = {"alone": [], "waiter asleep (bell)": [], "waiter polling 0.2 ms": []}
    for _ in range(args.rounds):
        for name, mode in (("alone", None), ("waiter asleep (bell)", "bell"), ("waiter polling 0.2 ms", "poll")):
            with turns.prefill_step():   # the waiter waits for this step's end the whole time
                waiter = subprocess.Popen([sys.executable, "-c", WAITER, path, mode]) if mode else None
                time.sleep(0.5)
                times[name] += [prompt_seconds() for _ in range(2)]
                if waiter is not None:
                    waiter.kill()
                    waiter.wait()
    turns.close()
    folder.cleanup()
    print(json.dumps({name: round(statistics.median(t), 3) for name, t in times.items()}))


if __name__ == "__main__":
    main()
