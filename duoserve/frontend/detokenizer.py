"""Incremental detokenization with stop strings.

Text is decoded over a small sliding window of tokens: the window's text with and
without the newest tokens is compared, and nothing is emitted while the newest
text ends in U+FFFD (a UTF-8 character split across tokens), so a delta never
carries half a character. Stop strings are searched in the text as it grows, so
one split across token boundaries is still found; while streaming, the last
``len(longest stop) - 1`` characters are held back until they cannot start one.
"""

from __future__ import annotations

from duoserve.model.tokenizer import Tokenizer

_CONTEXT_TOKENS = 4  # prompt tokens decoded with the first outputs, for tokenizers that strip a leading space


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], stop: tuple[str, ...] = (),
                 skip_special_tokens: bool = True, include_stop_str_in_output: bool = False) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = stop
        self.skip_special_tokens = skip_special_tokens
        self.include_stop = include_stop_str_in_output
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.num_emitted = 0
        self.stopped_by: str | None = None
        self.num_used = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_tokens(self, token_ids: list[int]) -> str | None:
        """Append new tokens; returns the stop string if one now ends the text, else None.
        After a stop, ``num_used`` says how many of ``token_ids`` it took to complete it (the
        rest, e.g. more of a speculating engine's accepted tokens, are not part of the output)."""
        for used, token in enumerate(token_ids, 1):
            self.num_used = used
            self.ids.append(token)
            prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
            full_text = self._decode(self.ids[self.prefix_offset:])
            if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
                old_len = len(self.text)
                self.text += full_text[len(prefix_text):]
                self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
                if self.stop and self._find_stop(old_len):
                    return self.stopped_by
        return None

    def _find_stop(self, old_len: int) -> bool:
        """Cut the text at the earliest stop string that the new text completes."""
        found = [(index, stop) for stop in self.stop
                 if (index := self.text.find(stop, max(0, old_len - len(stop) + 1))) != -1]
        if not found:
            return False
        index, stop = min(found)
        self.text = self.text[:index + len(stop) if self.include_stop else index]
        self.stopped_by = stop
        return True

    def take_delta(self, finished: bool) -> str:
        """Text not handed out yet; the tail that may still begin a stop string waits unless finished."""
        end = len(self.text) if finished or self.stopped_by else max(self.num_emitted, len(self.text) - self.holdback)
        delta = self.text[self.num_emitted:end]
        self.num_emitted = end
        return delta
