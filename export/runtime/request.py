"""One sentence's request to the engine and how it finished: what the servicer hands the engine and reads
back. Imports neither the engine nor protobuf, so every layer may use it."""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from nmtserve.decoding import DecodingOptions, Hypothesis, Limits, mean_log_prob
from nmtserve.sampling import Sampling
from nmtserve.search import BeamSearch


class FinishReason(enum.Enum):
    EOS = "eos"
    LENGTH = "length"
    CANCELLED = "cancelled"
    DEADLINE = "deadline"
    ERROR = "error"


@dataclass(eq=False)  # compared by identity: the waiting queue removes requests by it
class Request:
    """One sentence to translate; the engine fills tokens, score, hypotheses and finish, then sets `done`.
    While a beam search runs, `tokens` holds the prefix every hypothesis shares (it never changes), and
    on_token is called for each token added to it; when done, `tokens` and `score` are the best
    hypothesis's and `hypotheses` the n-best list."""

    src_ids: list[int]
    max_decoding_length: int = 256  # the output budget, counting the forced prefix's tokens
    options: DecodingOptions = field(default_factory=DecodingOptions)  # its max_decoding_length is not read
    deadline: float | None = None  # time.monotonic() after which the request is dropped
    on_token: Callable[[Request, int], None] | None = None  # called from the engine thread
    on_finish: Callable[[Request], None] | None = None  # called from the engine thread, once
    scored: bool = True  # whether its score is read; greedy without: steps of such rows alone skip the log-softmax
    attention: bool = False  # whether its hypotheses get their attention (Hypothesis.attention) when it finishes
    id: str = ""
    prefix: list[int] = field(default_factory=list)  # target tokens decoding is forced to start with (not in tokens)
    shown_prefix: list[int] = field(default_factory=list)  # the end of `prefix` its output begins with (target_prefix)
    favoured: list[int] = field(default_factory=list)  # a target_prefix that prefix_bias_beta favours, not forced
    tokens: list[int] = field(default_factory=list)
    score: float = 0.0
    hypotheses: list[Hypothesis] = field(default_factory=list)
    search: BeamSearch | Sampling | None = None  # set at admission unless greedy
    finish: FinishReason | None = None
    error: str | None = None
    arrived: float = field(default_factory=time.monotonic)
    arrived_step: int = 0  # the engine's step count when it was queued
    admitted: float | None = None
    encoded: float | None = None  # when the encoder call that took it in returned
    first_token: float | None = None
    finished: float | None = None
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: bool = False
    _budget: int | None = field(default=None, repr=False)  # budget(), once known

    def cancel(self) -> None:
        """Ask the engine to drop this request at its next iteration."""
        self.cancelled = True

    def budget(self, limits: Limits) -> int:
        """Most target tokens this request may produce after its prefix (worked out once: the engine asks at every
        step); the prefix counts in the output budget, as transformers counts a forced first token."""
        if self._budget is None:
            self._budget = limits.output_budget(len(self.src_ids), self.max_decoding_length, self.options.length_rule) \
                - len(self.prefix)
        return self._budget

    def results(self) -> list[Hypothesis]:
        """(Finished with EOS or LENGTH) its n-best list, best first: a search's, or a greedy request's one
        hypothesis (its tokens and score; nan scores when it was not scored)."""
        if self.hypotheses:
            return self.hypotheses
        eos = self.finish is FinishReason.EOS
        return [Hypothesis(self.tokens, self.score, self.finish.value, mean_log_prob(self.score, len(self.tokens), eos))]

    @property
    def width(self) -> int:
        """Rows of the running batch this request takes."""
        return self.options.beam_size

    def cost(self, limits: Limits) -> int:
        return (len(self.src_ids) + self.budget(limits)) * self.width
