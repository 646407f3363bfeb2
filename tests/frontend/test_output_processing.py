"""Output processing (``duoserve.frontend.output_processor``): what a batch of engine outputs
comes to, and what the in-process ``Frontend`` passes on to its engine. No engine, no model:
a tokenizer of whole words stands in for the model's."""

from __future__ import annotations

import pytest

from duoserve import SamplingParams
from duoserve.core.outputs import EngineCoreOutput
from duoserve.errors import InvalidInputError
from duoserve.frontend.frontend import Frontend
from duoserve.frontend.input_processor import InputProcessor
from duoserve.frontend.output_processor import OutputProcessor, ProcessedOutputs

WORDS = ["<eos>", "hello", " world", " STOP", " after", "!", " and", " more"]
EOS = 0


class WordTokenizer:
    """One token per word of ``WORDS``: decoding is concatenation."""

    bos_token_id = None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(WORDS[i] for i in ids if not (skip_special_tokens and i == EOS))

    def encode(self, text: str) -> list[int]:
        return [WORDS.index(w if i == 0 else " " + w) for i, w in enumerate(text.split(" "))]


INPUTS = InputProcessor(WordTokenizer(), len(WORDS), (EOS,))


def track(outputs: OutputProcessor, request_id: str, params: SamplingParams, prompt=(1, 2)) -> None:
    _, state = INPUTS.build(request_id, None, list(prompt), params, max_model_len=64)
    outputs.check_unused(request_id)
    outputs.add_request(state)


def test_a_stop_string_ends_the_sample_and_asks_the_engine_to_stop_it():
    outputs = OutputProcessor()
    track(outputs, "r", SamplingParams(max_tokens=10, stop=["STOP"]))
    result = outputs.process_outputs([EngineCoreOutput("r", [1, 2, 3, 4])])
    (snapshot,) = result.outputs
    (sample,) = snapshot.outputs
    assert result.stop_ids == ["r"], "the engine still runs it: it must be told"
    assert result.release_ids == ["r"], "its only sample is done: the engines forget it"
    assert (sample.finish_reason, sample.stop_reason) == ("stop", "STOP")
    assert sample.token_ids == [1, 2, 3], "the token after the one that completed the stop string is dropped"
    assert sample.text == sample.delta_text == "hello world "
    assert "r" not in outputs and len(outputs) == 0


def test_a_stop_string_in_the_engines_last_output_needs_no_stop_message():
    outputs = OutputProcessor()
    track(outputs, "r", SamplingParams(max_tokens=3, stop=["STOP"]))
    result = outputs.process_outputs([EngineCoreOutput("r", [1, 2, 3], finish_reason="length")])
    assert result.stop_ids == [] and result.release_ids == ["r"]
    assert result.outputs[0].outputs[0].finish_reason == "stop", "the stop string is why it ended"


def test_a_request_runs_until_the_engine_finishes_it_then_is_released():
    outputs = OutputProcessor()
    track(outputs, "r", SamplingParams(max_tokens=3))
    first = outputs.process_outputs([EngineCoreOutput("r", [1, 2])])
    assert first.stop_ids == first.release_ids == [] and "r" in outputs
    assert first.outputs[0].outputs[0].delta_token_ids == [1, 2] and not first.outputs[0].finished
    last = outputs.process_outputs([EngineCoreOutput("r", [5], position=2, finish_reason="length")])
    (sample,) = last.outputs[0].outputs
    assert last.release_ids == ["r"] and last.stop_ids == []
    assert (sample.finish_reason, sample.token_ids, sample.delta_token_ids) == ("length", [1, 2, 5], [5])
    assert (sample.text, sample.delta_text) == ("hello world!", "!")
    late = outputs.process_outputs([EngineCoreOutput("r", [6], position=3)])
    assert late == ProcessedOutputs(), "outputs of a released request are dropped"


def test_an_aborted_request_is_forgotten_and_its_late_outputs_dropped():
    outputs = OutputProcessor()
    track(outputs, "r", SamplingParams(n=2, max_tokens=8))
    state = outputs.states["r"]
    outputs.process_outputs([EngineCoreOutput("r", [1], finish_reason="length"), EngineCoreOutput("r/1", [2])])
    assert outputs.abort("r") is True and "r" not in outputs
    assert [o.finish_reason for o in state.outputs] == ["length", "abort"], "only unfinished samples are aborted"
    assert outputs.abort("r") is False, "a second abort finds nothing"
    assert outputs.process_outputs([EngineCoreOutput("r/1", [3], position=1)]) == ProcessedOutputs()


def test_an_abort_the_engine_reports_finishes_the_request():
    outputs = OutputProcessor()
    track(outputs, "r", SamplingParams(max_tokens=8))
    result = outputs.process_outputs([EngineCoreOutput("r", [], finish_reason="abort")])
    assert result.release_ids == ["r"] and result.stop_ids == []
    assert result.outputs[0].outputs[0].finish_reason == "abort" and result.outputs[0].finished


def test_the_samples_of_n_gather_under_their_prompt_and_release_once_all_finish():
    outputs = OutputProcessor()
    track(outputs, "p", SamplingParams(n=3, max_tokens=4, stop=["STOP"]))
    track(outputs, "q", SamplingParams(max_tokens=4))
    result = outputs.process_outputs([EngineCoreOutput("q", [1]), EngineCoreOutput("p/1", [1]),
                                      EngineCoreOutput("p", [2]), EngineCoreOutput("p/1", [6], position=1)])
    assert [s.request_id for s in result.outputs] == ["q", "p"], "one snapshot per request, in first-seen order"
    assert [o.token_ids for o in result.outputs[1].outputs] == [[2], [1, 6], []]
    stopped = outputs.process_outputs([EngineCoreOutput("p/1", [3], position=2)])
    assert stopped.stop_ids == ["p/1"], "a sample's stop names the sample"
    assert stopped.release_ids == [], "two samples still run"
    done = outputs.process_outputs([EngineCoreOutput("p", [], position=1, finish_reason="length"),
                                    EngineCoreOutput("p/2", [7], finish_reason="length")])
    assert done.release_ids == ["p"] and done.stop_ids == []
    assert [o.finish_reason for o in done.outputs[0].outputs] == ["length", "stop", "length"]
    assert "q" in outputs and "p" not in outputs


def test_a_request_id_in_use_is_refused():
    outputs = OutputProcessor()
    track(outputs, "r", SamplingParams())
    with pytest.raises(InvalidInputError, match="request id 'r' is already in use"):
        outputs.check_unused("r")


class RecordingEngine:
    """An in-process engine that records what the frontend tells it."""

    tokenizer = WordTokenizer()
    max_model_len = 64
    vocab_size = len(WORDS)
    eos_token_ids = (EOS,)
    reranker = None

    def __init__(self, outputs: list[EngineCoreOutput]) -> None:
        self.calls: list[tuple[str, str]] = []
        self.outputs = outputs

    def add_request(self, request) -> None:
        self.calls.append(("add_request", request.request_id))

    def abort(self, request_id: str) -> None:
        self.calls.append(("abort", request_id))

    def finish_stopped(self, request_id: str) -> None:
        self.calls.append(("finish_stopped", request_id))

    def release(self, request_id: str) -> None:
        self.calls.append(("release", request_id))

    def step(self) -> list[EngineCoreOutput]:
        outputs, self.outputs = self.outputs, []
        return outputs


def test_the_frontend_tells_its_engine_what_the_outputs_ended():
    engine = RecordingEngine([EngineCoreOutput("a", [1, 2, 3]), EngineCoreOutput("b", [1])])
    frontend = Frontend(engine)
    assert frontend.add_request("hello world", SamplingParams(stop=["STOP"]), request_id="a") == "a"
    assert frontend.add_request([1], SamplingParams()) == "req-0"
    frontend.add_request([2], SamplingParams(), request_id="b")
    (a, b) = frontend.step()
    assert a.outputs[0].text == "hello world " and not b.finished
    frontend.abort("req-0")
    frontend.abort("gone")
    assert engine.calls == [("add_request", "a"), ("add_request", "req-0"), ("add_request", "b"),
                            ("finish_stopped", "a"), ("release", "a"), ("abort", "req-0"), ("release", "req-0")]
    assert sorted(frontend.states) == ["b"]


def test_a_prompt_the_frontend_refuses_reaches_no_engine():
    engine = RecordingEngine([])
    frontend = Frontend(engine)
    with pytest.raises(InvalidInputError, match="token id 99 is out of range"):
        frontend.add_request([1, 99], SamplingParams())
    with pytest.raises(InvalidInputError, match="at most 63 prompt tokens fit"):
        frontend.add_request([1] * 64, SamplingParams())
    frontend.add_request([1], SamplingParams(), request_id="x")
    with pytest.raises(InvalidInputError, match="already in use"):
        frontend.add_request([1], SamplingParams(), request_id="x")
    assert engine.calls == [("add_request", "x")] and frontend.add_request([1], SamplingParams()) == "req-0"
