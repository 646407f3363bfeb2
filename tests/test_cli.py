"""The `duoserve` command line."""

from __future__ import annotations

import subprocess
import sys



def duoserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "duoserve.cli", *args], capture_output=True, text=True, timeout=300)


def test_generate_prints_the_greedy_completion(smol_llm):
    from duoserve import SamplingParams

    want = smol_llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8),
                             use_tqdm=False)[0].outputs[0].text
    result = duoserve("generate", "--prompt", "The capital of France is", "--max-tokens", "8",
                      "--kv-cache-memory", "0.5")
    assert result.returncode == 0, result.stderr
    assert result.stdout == want + "\n"


def test_config_errors_exit_2_with_the_message():
    result = duoserve("generate", "--prompt", "x", "--block-size", "24")
    assert result.returncode == 2
    assert result.stderr.strip() == "duoserve: error: block_size=24 is not allowed: a power of two from 1 to 256"


def test_help_documents_defaults():
    result = duoserve("generate", "--help")
    help_text = " ".join(result.stdout.split())
    for text in ["split long prompts across steps under the token budget (default: on)",
                 "token budget of one step (default: 512 with chunked prefill, else max_model_len)",
                 "reuse the KV of shared prompt prefixes (default: on)",
                 "tokens per KV block, a power of two (default: 16)"]:
        assert text in help_text
