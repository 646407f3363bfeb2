"""The compiled model step (torch.compile, off by default) computes what the eager model computes.

One compiled engine per module (compiling takes seconds even for a tiny model; the rest of
the suite runs eager). Compiled == eager token for token under chunked prefill, prefix
hits, heavy preemption and seeded sampling (steps of decodes in the C++ decode step, the others
in the graph); every batch size and chunk size runs on one graph; without a compiler,
everything still serves on the eager path; the default model's GGUF blocks (fast mode, float32)
give the eager bits. The compiled path is guarded on one model and one dtype of each kind (a
dense llama, the default GGUF model): the other families, exact mode and a compiled draft are the
eager path's to test (tests/model, tests/e2e/test_spec_decode.py), where everything runs by default.
"""

from __future__ import annotations

import os
import random
import shlex
import subprocess
import sys

import pytest

from duoserve import LLM, SamplingParams
from tests.helpers import assert_pool_whole
from tests.e2e.test_engine_equivalence import PARAMS, assert_same_outputs, prompts_with_shared_prefixes
from tests.model.test_gguf import write_gguf

# 40 blocks of 4 tokens: one full-length sequence fits, the batch does not (heavy preemption)
SETTINGS = dict(dtype="float32", kv_cache_memory=40 * 4 * 512 / 2**30, max_model_len=128, block_size=4,
                max_num_batched_tokens=16, num_threads=2)


@pytest.fixture(scope="module")
def compiled_llm(tiny_dir):
    llm = LLM(str(tiny_dir(kind="llama")), compile=True, **SETTINGS)
    assert type(llm.engine.runner.forward).__name__ == "CompiledModel", "the step must be compiled here"
    assert llm.engine.runner.forward._direct is not None, "warm, the step runs without Dynamo's guards"
    return llm


@pytest.fixture(scope="module")
def eager_llm(tiny_dir):
    return LLM(str(tiny_dir(kind="llama")), **SETTINGS)


def test_compiled_equals_eager_greedy_with_chunks_prefix_hits_and_preemption(compiled_llm, eager_llm, monkeypatch):
    monkeypatch.setattr(compiled_llm.engine.runner.forward, "fused", None)   # every step through the graph
    prompts = prompts_with_shared_prefixes()
    want = eager_llm.generate(prompts, PARAMS, use_tqdm=False)
    got = compiled_llm.generate(prompts, PARAMS, use_tqdm=False)
    assert_same_outputs(got, want, "compiled vs eager")
    assert compiled_llm.engine.scheduler.num_preemptions > 0, "the tiny KV budget forces preemption"
    assert compiled_llm.engine.kv.num_hits > 0, "the shared prefixes hit the prefix cache"
    assert_pool_whole(compiled_llm)


def test_compiled_equals_eager_seeded_sampling(compiled_llm, eager_llm, monkeypatch):
    monkeypatch.setattr(compiled_llm.engine.runner.forward, "fused", None)   # every step through the graph
    prompts = prompts_with_shared_prefixes()[:5]
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=7, max_tokens=16, ignore_eos=True, n=2)
    want = eager_llm.generate(prompts, params, use_tqdm=False)
    got = compiled_llm.generate(prompts, params, use_tqdm=False)
    assert [[o.token_ids for o in r.outputs] for r in got] == [[o.token_ids for o in r.outputs] for r in want]
    assert_pool_whole(compiled_llm)


class CountingAttention:
    """A layer's eager attention that counts the Python kernel's calls of it."""

    def __init__(self, layer, calls: list) -> None:
        self.layer, self.calls, self.scale = layer, calls, layer.scale

    def forward(self, *args):
        self.calls.append(1)
        return self.layer.forward(*args)


class FlatAttention:
    """An attention that only counts its calls (and returns q flattened)."""

    def __init__(self, calls: list) -> None:
        self.calls = calls

    def forward(self, q, *args):
        self.calls.append(1)
        return q.flatten(1)


def test_every_step_attends_in_cpp_and_nothing_stays_announced(compiled_llm, eager_llm, monkeypatch):
    """Without the C++ decode step, every compiled step (a prompt chunk, decodes) is announced to
    the C++ paged_attention, which runs every layer over all the step's tokens with no Python
    and gives the eager tokens; after a step nothing stays announced (a direct call of the op
    goes to the Python kernel)."""
    import torch

    from duoserve.core.request import Request
    from duoserve.kernels import ops
    from duoserve.kernels.build import compilers

    if compilers()[1] is None:   # where there is one, csrc/cpu_ops.cpp must build and serve the op
        pytest.skip("no C++ compiler on this machine: the attention op is Python")
    assert ops.native_attention(), "a C++ compiler is here: the C++ paged_attention must be registered"
    forward = compiled_llm.engine.runner.forward
    assert forward.context.native
    monkeypatch.setattr(forward, "fused", None)   # the graph's own decode steps too
    calls = []
    # the Python kernel reaches each layer through the context: count its calls there
    monkeypatch.setattr(forward.context, "layers", [CountingAttention(layer, calls) for layer in forward.context.layers])
    engine = compiled_llm.engine
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2)
    per_step, tokens = [], {}
    for name, prompt in (("first", list(range(5, 11))), ("second", list(range(40, 43)))):
        engine.add_request(Request(name, prompt, params, (), 128))
        while engine.has_unfinished():
            calls.clear()
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            per_step.append(len(calls))
        engine.release(name)
    assert per_step == [0, 0, 0] * 2   # each request: its prompt in one chunk, then two decode steps
    want = eager_llm.generate([list(range(5, 11)), list(range(40, 43))], params, use_tqdm=False)
    assert [tokens["first"], tokens["second"]] == [w.outputs[0].token_ids for w in want]
    monkeypatch.setattr(forward.context, "layers", [FlatAttention(calls)])
    q = torch.zeros(1, 4, 16)
    torch.ops.duoserve.paged_attention(q, q[:, :2], q[:, :2], forward.context.handle, 0)
    assert calls == [1], "a step left its announcement behind"
    assert_pool_whole(compiled_llm)


class CountingStep:
    """A FusedDecodeStep that counts the steps it runs."""

    def __init__(self, step) -> None:
        self.step, self.calls = step, 0

    def serves(self, meta, num_tokens):
        return self.step.serves(meta, num_tokens)

    def __call__(self, *args):
        self.calls += 1
        return self.step(*args)


def require_decode_step(llm) -> None:
    from duoserve.kernels.build import compilers
    from duoserve.worker.fused_decode import why_not

    from duoserve.kernels.dense import packed_linear_supported

    if compilers()[1] is None:   # where there is one, csrc/cpu_ops.cpp must build and take the model
        pytest.skip("no C++ compiler on this machine: decode steps run the compiled graph")
    forward = llm.engine.runner.forward
    dtype = llm.engine.runner.model.dtype
    if not packed_linear_supported(dtype):   # the C++ step runs over packed weights only
        assert forward.fused is None
        pytest.skip(f"this CPU has no vector units for the packed kernel in {dtype} (AVX-512, AVX512-BF16): "
                    "decode steps run the compiled graph")
    assert forward.fused is not None, why_not(forward.model, llm.engine.runner.kv_caches)


def test_steps_of_up_to_64_tokens_run_whole_in_cpp_and_larger_ones_in_the_model(tiny_dir, eager_llm, monkeypatch):
    """A step of at most MAX_ROWS tokens (decodes, a short prompt) runs in the C++ decode step; a
    longer prompt's step runs the model (here eagerly; compiled, the graph: the same test of
    ``serves``); greedy tokens are those of an engine whose prompts came in chunks of 16."""
    from duoserve.core.request import Request
    from duoserve.worker.fused_decode import MAX_ROWS

    llm = LLM(str(tiny_dir(kind="llama")), **{**SETTINGS, "max_num_batched_tokens": 2 * MAX_ROWS})
    require_decode_step(llm)
    engine = llm.engine
    counting = CountingStep(engine.runner.forward.fused)
    monkeypatch.setattr(engine.runner.forward, "fused", counting)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = {"long": list(range(5, 6 + MAX_ROWS)), "short": list(range(40, 43))}
    per_step, tokens = [], {}
    for name, prompt in prompts.items():
        engine.add_request(Request(name, prompt, params, (), 128))
        while engine.has_unfinished():
            before = counting.calls
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            per_step.append(counting.calls - before)
        engine.release(name)
    assert per_step == [0, 1, 1, 1] + [1, 1, 1, 1]   # each prompt in one chunk, then three decode steps
    want = eager_llm.generate(list(prompts.values()), params, use_tqdm=False)
    assert [tokens["long"], tokens["short"]] == [w.outputs[0].token_ids for w in want]
    assert_pool_whole(llm)


@pytest.mark.parametrize("kind, overrides", [("qwen2", {}), ("qwen3", {}), ("llama", {"tie_word_embeddings": True})])
def test_the_decode_step_takes_qkv_bias_qk_norms_and_a_tied_output_projection(tiny_dir, kind, overrides):
    """Qwen2's q/k/v bias, Qwen3's per-head q/k norms, and a tied output projection, in the C++
    decode step: the eager tokens (float32 greedy, a batch of decodes at once)."""
    rng = random.Random(3)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(3, 20))] for _ in range(8)]
    settings = dict(dtype="float32", kv_cache_memory=0.01, num_threads=2)
    path = str(tiny_dir(kind=kind, **overrides))
    want = LLM(path, **settings).generate(prompts, PARAMS, use_tqdm=False)
    llm = LLM(path, compile=True, **settings)
    require_decode_step(llm)
    assert llm.engine.runner.model.arch.tie_word_embeddings == (kind == "llama")
    assert_same_outputs(llm.generate(prompts, PARAMS, use_tqdm=False), want, f"{kind}: decode step vs eager")
    assert_pool_whole(llm)


def test_the_decode_step_refuses_a_slot_position_or_token_out_of_range_and_writes_nothing(compiled_llm):
    import torch

    require_decode_step(compiled_llm)
    runner = compiled_llm.engine.runner
    caches = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    k_cache = runner.kv_caches[0][0]
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    ids, vocab = torch.tensor([3, 4]), runner.model.arch.vocab_size
    tables, lens = torch.zeros(2, 1, dtype=torch.long), torch.tensor([1, 1])
    context = runner.forward.context.handle
    none = torch.empty(0, dtype=torch.long)

    def step(*args, lora=(none, none)):
        return torch.ops.duoserve.decode_step(*args, *lora)

    with pytest.raises(RuntimeError, match=f"decode_step: slot {num_slots} outside the cache's {num_slots}"):
        step(context, ids, torch.tensor([0, 0]), torch.tensor([1, num_slots]), tables, lens)
    positions = runner.model.rotary.cos.shape[0]
    with pytest.raises(RuntimeError, match=f"decode_step: position {positions} outside the rotary table's"):
        step(context, ids, torch.tensor([0, positions]), torch.tensor([1, 2]), tables, lens)
    with pytest.raises(RuntimeError, match=f"decode_step: token {vocab} outside the vocabulary of {vocab}"):
        step(context, torch.tensor([3, vocab]), torch.tensor([0, 0]), torch.tensor([1, 2]), tables, lens)
    with pytest.raises(RuntimeError, match="decode_step: no model 12345"):
        step(12345, ids, torch.tensor([0, 0]), torch.tensor([1, 2]), tables, lens)
    with pytest.raises(RuntimeError, match="decode_step: row 1's adapter 1 has no table"):
        step(context, ids, torch.tensor([0, 0]), torch.tensor([1, 2]), tables, lens,
             lora=(torch.tensor([-1, 1]), torch.tensor([0])))
    for (k, v), (k0, v0) in zip(runner.kv_caches, caches):
        assert torch.equal(k, k0) and torch.equal(v, v0), "a refused step wrote to the caches"


def test_models_the_decode_step_cannot_take_say_why(compiled_llm, monkeypatch):
    import torch

    from duoserve.worker.fused_decode import why_not

    runner = compiled_llm.engine.runner
    monkeypatch.setenv("DUOSERVE_DECODE_STEP", "0")
    assert why_not(runner.model, runner.kv_caches) == "DUOSERVE_DECODE_STEP=0"
    monkeypatch.delenv("DUOSERVE_DECODE_STEP")
    require_decode_step(compiled_llm)
    assert why_not(runner.model, runner.kv_caches) is None
    bf16_caches = [(k.to(torch.bfloat16), v.to(torch.bfloat16)) for k, v in runner.kv_caches[:1]]
    assert why_not(runner.model, bf16_caches) == "a KV cache in torch.bfloat16 (the model runs torch.float32)"
    monkeypatch.setattr(runner.model.layers[1].o_proj, "packed", None)
    assert why_not(runner.model, runner.kv_caches) == ("a linear layer neither packed in the model's dtype nor in "
                                                        "GGUF blocks (at most 4 block types)")


def test_every_batch_and_chunk_size_runs_on_one_graph(tiny_dir, monkeypatch):
    """64 prompts of 1..64 tokens, whole prompts in one step (budget 64): steps carry from 1 to
    64 sequences and prefill chunks of every length, all on the one graph, never a recompile
    (Dynamo's guards checked at every step here, so a recompile would be seen)."""
    monkeypatch.setenv("DUOSERVE_COMPILED_GUARDS", "1")
    llm = LLM(str(tiny_dir(kind="llama")), dtype="float32", kv_cache_memory=0.01, max_num_batched_tokens=64,
              compile=True)
    runner = llm.engine.runner
    runner.forward.fused = None   # every step through the graph (the C++ step takes steps of up to 64 tokens)
    rng = random.Random(2)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in range(1, 65)]
    params = [SamplingParams(temperature=0, max_tokens=1 + i % 40, ignore_eos=True) for i in range(64)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [p.max_tokens for p in params]
    assert runner.forward.num_compiles == 1 and runner.forward._direct is None
    assert_pool_whole(llm)


def test_without_a_compiler_everything_falls_back_and_serves(tmp_path, tiny_dir):
    """No C or C++ compiler on PATH, an empty cache: the C kernels and the compiled step fall back
    to torch, each saying so once, and generation works; a GGUF file is dequantized at load."""
    bin_dir = tmp_path / "bin"   # PATH: python alone, through a script (a symlink to a venv's
    bin_dir.mkdir()              # python, outside the venv, starts the base interpreter)
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
    (bin_dir / "python").chmod(0o755)
    gguf = tmp_path / "tiny-Q4_1.gguf"
    write_gguf(tiny_dir(kind="llama"), gguf, "Q4_1")
    code = ("import logging; logging.basicConfig(level=logging.INFO);"
            "from duoserve import LLM, SamplingParams;"
            f"llm = LLM({str(tiny_dir(kind='llama'))!r}, dtype='float32', kv_cache_memory=0.01, compile=True);"
            "out = llm.generate([[1, 2, 3, 4]] * 2, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False);"
            "print('TOKENS', [len(o.outputs[0].token_ids) for o in out]);"
            f"q = LLM({str(gguf)!r}, dtype='float32', kv_cache_memory=0.01);"
            "print('GGUF', q.engine.loaded.quantization, len(q.generate([[1, 2, 3]], SamplingParams(max_tokens=3),"
            " use_tqdm=False)[0].outputs[0].token_ids))")
    env = {k: v for k, v in os.environ.items() if k not in ("CC", "CXX")}
    env.update(PATH=str(bin_dir), XDG_CACHE_HOME=str(tmp_path / "cache"), DUOSERVE_KERNEL_DIR=str(tmp_path / "kernels"),
               TORCHINDUCTOR_CACHE_DIR="")
    env.pop("TORCHINDUCTOR_CACHE_DIR")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "TOKENS [4, 4]" in result.stdout
    assert "GGUF none 3" in result.stdout
    log = result.stderr
    assert log.count("cannot compile the model step, running it eagerly") == 1, log[-3000:]
    assert "no C compiler found: paged_decode runs on the torch path" in log
    assert "no C compiler found: small_m_linear runs on the torch path" in log
    assert log.count("GGUF blocks need the C kernels (no C compiler, or DUOSERVE_C_KERNELS=0): dequantizing the "
                     "weights at load (--quantization none)") == 1


def test_a_gguf_model_takes_the_decode_step(tiny_dir, tmp_path):
    """The default model's case: GGUF blocks, which the C++ decode step reads, with the ops' own
    glue (csrc/glue.c), so its decode steps run there."""
    from duoserve.config import ModelConfig
    from duoserve.kernels.ops import decode_step_available
    from duoserve.worker.backends import load_model
    from duoserve.worker.fused_decode import why_not

    gguf = tmp_path / "tiny-Q4_1.gguf"
    write_gguf(tiny_dir(kind="llama"), gguf, "Q4_1")
    loaded = load_model(ModelConfig(model=str(gguf), dtype="float32", quantization="gguf"))
    assert loaded.quantization == "gguf-fast"
    assert decode_step_available(), "CI has a C++ compiler: csrc/cpu_ops.cpp builds (else that is the reason given)"
    assert why_not(loaded.model, []) is None


def test_the_default_configuration_compiled_computes_the_eager_bits():
    """The default model computed from its GGUF blocks in fast mode (its first six layers, to
    compile in seconds), greedy under prompt chunks, prefix hits and batched decodes: compiled
    and eager steps give the same logprobs bit for bit. The layer's small ops are op calls in
    both (``kernels/glue.py``, swapped in by the runner); Inductor's own loops for them moved a token of the whole model
    on the equality tests' prompts, a quantized activation being rounded the other way."""
    from duoserve.kernels.glue import OpRMSNorm
    from tests.e2e.test_default_config_equality import PROMPTS

    dtype = "float32"   # one dtype: the compiled path is opt-in (bfloat16 is the eager tests')
    settings = dict(dtype=dtype, kv_cache_memory=0.05, max_model_len=256, max_num_batched_tokens=24, num_threads=2,
                    hf_overrides={"num_hidden_layers": 6})
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True)

    def run(llm):
        outs = llm.generate(PROMPTS + PROMPTS[:2], params, use_tqdm=False)   # the last two from the cache
        assert_pool_whole(llm)
        return [(o.outputs[0].token_ids, [lp.top for lp in o.outputs[0].logprobs]) for o in outs]

    compiled = LLM(compile=True, **settings)
    assert type(compiled.engine.runner.forward).__name__ == "CompiledModel"
    compiled.engine.runner.forward.fused = None   # the graph against the eager engine's C++ steps
    model = compiled.engine.runner.model
    assert compiled.engine.loaded.quantization == "gguf-fast" and len(model.layers) == 6
    assert isinstance(model.layers[0].input_norm, OpRMSNorm) and isinstance(model.norm, OpRMSNorm)
    assert run(compiled) == run(LLM(**settings))
    assert compiled.engine.kv.num_hits > 0
