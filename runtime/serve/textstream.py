"""Incremental detokenisation with stop strings, for streamed and stop-string-bounded completions."""

from __future__ import annotations

from typing import Any


class TextStream:
    """Incremental detokenisation with stop strings: `push` returns the text to send now.

    Text is decoded from all tokens so far (so multi-token characters come out
    whole), and the tail that could still turn into a stop string is held back."""

    def __init__(self, tokenizer: Any, stop: list[str]) -> None:
        self.tokenizer, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0
        self.stopped = False
        self._hold = max((len(s) for s in stop), default=1) - 1

    def push(self, ids: list[int]) -> str:
        if self.stopped:
            return ""
        self.ids += ids
        if self.tokenizer is None:
            return ""
        # An incomplete UTF-8 sequence at the end decodes as U+FFFD: leave it out until a later
        # token completes it (and out of the final text when generation ends inside it).
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True).rstrip("\ufffd")
        cuts = [i for i in (text.find(s, max(0, self.sent - self._hold)) for s in self.stop) if i >= 0]
        if cuts:
            self.text, self.stopped = text[: min(cuts)], True
            return self.flush()
        self.text = text
        upto = max(self.sent, len(text) - self._hold)
        out, self.sent = text[self.sent:upto], upto
        return out

    def flush(self) -> str:
        out, self.sent = self.text[self.sent:], len(self.text)
        return out
