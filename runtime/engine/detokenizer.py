"""Incremental detokenization with stop strings: the one place stop strings are matched.

The engine hands out token ids; clients want text deltas that never split a UTF-8 character and
never show the start of a stop string that later completes. Each update decodes the whole
output (outputs are short next to a step's cost) and releases only text that is final.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from runtime.engine.sampling import SamplingParams, find_stop

REPLACEMENT = "\ufffd"  # what a partial UTF-8 sequence decodes to


@dataclass
class Detokenizer:
    """Turns a growing list of output token ids into text deltas.

    ``stop``: stop strings (the text ends at the first one found, which is included only with
    ``include_stop``). EOS and stop token ids end requests in the engine, not here.
    """

    tokenizer: object
    stop: tuple[str, ...] = ()
    include_stop: bool = False
    text: str = ""  # the final text so far (what was released)
    stopped: bool = False  # a stop string was found; the request should end
    _hold: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self._hold = max((len(s) for s in self.stop), default=1) - 1

    @classmethod
    def for_params(cls, tokenizer: object, params: SamplingParams) -> "Detokenizer":
        return cls(tokenizer, params.stop, params.include_stop_str_in_output)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def update(self, token_ids: Sequence[int], finished: bool) -> str:
        """All output token ids so far -> the newly final text (``""`` if none yet)."""
        if self.stopped:
            return ""
        full = self.decode(token_ids)
        hit = find_stop(full, self.stop, max(0, len(self.text) - self._hold)) if self.stop else None
        if hit is not None:
            full = full[: hit[0] + (len(hit[1]) if self.include_stop else 0)]
            self.stopped = True
            end = len(full)
        elif finished:
            end = len(full)
        else:
            end = len(full) - self._hold
            while end > len(self.text) and full[end - 1] == REPLACEMENT:
                end -= 1
        if end <= len(self.text):
            return ""
        delta = full[len(self.text):end]
        self.text = full[:end]
        return delta

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id])
