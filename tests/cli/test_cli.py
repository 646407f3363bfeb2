"""The `duoserve` command line."""

from __future__ import annotations

import subprocess
import sys


def duoserve(*args: str) -> subprocess.CompletedProcess:
    # a safety time-out against a hang, not a speed bound: generate runs a few tokens
    return subprocess.run([sys.executable, "-m", "duoserve.cli", *args], capture_output=True, text=True, timeout=600)


def test_generate_prints_the_greedy_completion(smol_llm):
    from duoserve import SamplingParams

    want = smol_llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8),
                             use_tqdm=False)[0].outputs[0].text
    result = duoserve("generate", "--prompt", "The capital of France is", "--max-tokens", "8",
                      "--kv-cache-memory", "0.5", "--dtype", "float32", "--quantization", "none")
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
                 "token budget of one step (default: 512 with chunked prefill (256 under --scheduling-policy "
                 "priority or fair",
                 "reuse the KV of shared prompt prefixes (default: on)",
                 "tokens per KV block, a power of two (default: 16)"]:
        assert text in help_text


def test_placement_flag_errors_name_field_value_and_rule():
    cases = [
        (("serve", "--num-prefill-engines", "2"),
         "num_prefill_engines=2 is not allowed: only with --mode disaggregated (colocated runs one engine)"),
        (("serve", "--mode", "disaggregated", "--num-decode-engines", "0"),
         "num_decode_engines=0 is not allowed: a positive number of engines"),
        (("serve", "--mode", "disaggregated", "--decode-addrs", "tcp://h1:7100,h2:7100"),
         "decode_addrs='h2:7100' is not allowed: an engine address like tcp://HOST:PORT (or ipc://PATH on one host)"),
        (("serve", "--mode", "disaggregated", "--prefill-addrs", "tcp://h1:7100", "--num-prefill-engines", "2"),
         "num_prefill_engines=2 is not allowed: unset when --prefill-addrs names the engines (their count is "
         "the list's)"),
        (("decode", "--listen", "tcp://0.0.0.0"),
         "listen='tcp://0.0.0.0' is not allowed: an engine address like tcp://HOST:PORT (or ipc://PATH on one host)"),
    ]
    for args, message in cases:
        result = duoserve(*args)
        assert result.returncode == 2, (args, result.stderr)
        assert result.stderr.strip() == f"duoserve: error: {message}", args


def test_generate_with_a_gguf_self_draft_prints_the_same_text(smol_llm):
    from duoserve import SamplingParams

    want = smol_llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=12),
                             use_tqdm=False)[0].outputs[0].text
    result = duoserve("generate", "--prompt", "The capital of France is", "--max-tokens", "12",
                      "--kv-cache-memory", "0.8", "--dtype", "float32", "--quantization", "none",
                      "--speculative-method", "draft", "--speculative-quantization", "gguf",
                      "--speculative-disable-batch-size", "8")
    assert result.returncode == 0, result.stderr
    assert result.stdout == want + "\n"


def test_a_draft_model_without_the_draft_method_is_a_config_error():
    result = duoserve("generate", "--prompt", "x", "--speculative-model", "/some/draft.gguf")
    assert result.returncode == 2
    assert result.stderr.strip() == ("duoserve: error: speculative_method=None is not allowed: ngram or draft: "
                                     "--speculative-model needs --speculative-method draft")
