"""Decoding rules shared by every decoder (PyTorch reference, ONNX Runtime, the server), so that
they batch alike, stop at the same step and give the same tokens: a request's options (`DecodingOptions`, CTranslate2's
names), the hypotheses a search gives, output budgets and batching. Below training and serving alike: imports neither."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np

from nmtserve.errors import ConfigError

LENGTH_RULES = ("nmtserve", "transformers", "ctranslate2")
BEAM_STOPPING = ("ctranslate2", "transformers")


@dataclass(frozen=True)
class DecodingOptions:
    """How one request is decoded; CTranslate2's translate_batch names and defaults."""

    beam_size: int = 1
    num_hypotheses: int = 1  # the n-best list's length, at most beam_size
    length_penalty: float = 0.0  # a finished hypothesis scores (sum of log-probs) / length ** length_penalty
    patience: float = 1.0  # with a length penalty, stop after round(beam_size × patience) finished hypotheses
    sampling_topk: int = 1  # 1: no sampling; 0: sample from the whole vocabulary; k: from the k best tokens
    sampling_topp: float = 1.0  # then keep the smallest set of best tokens whose probability reaches topp
    sampling_temperature: float = 1.0  # log-probabilities are divided by it before sampling
    seed: int = 0  # of the request's own random generator; 0 draws one from the operating system
    max_decoding_length: int = 256
    beam_stopping: str = "ctranslate2"  # or "transformers": when beam search stops (BeamSearch says how)
    length_rule: str = "nmtserve"  # or "transformers": the output budget, and how it ends (decoding.output_budget)
    # CTranslate2's disabled tokens (TokenMasks): eos before this many tokens after a forced prefix (CTranslate2's
    # default is 1, nmtserve's 0: eos may come first, as in transformers), unk, repeated n-grams, token sequences
    min_decoding_length: int = 0
    disable_unk: bool = False
    no_repeat_ngram_size: int = 0
    suppress_sequences: tuple[tuple[int, ...], ...] = ()  # token ids; a single token is never generated
    # CTranslate2's: with a target prefix, the prefix is not forced but favoured (BeamSearch's `bias`)
    prefix_bias_beta: float = 0.0
    # CTranslate2's: the logit of each token already in the row's sequence divided by it (multiplied where
    # negative) before the log-softmax; above 1 discourages repeats (TokenMasks)
    repetition_penalty: float = 1.0
    # nmtserve's: token sequences every hypothesis must contain (a glossary's target terms: ConstrainedBeamSearch)
    constraints: tuple[tuple[int, ...], ...] = ()

    def override(self, **given) -> DecodingOptions:
        """These options (a model's defaults) with what a request gives; a sampled request decodes one
        row unless it gives beam_size."""
        if given.get("sampling_topk", 1) != 1:
            given.setdefault("beam_size", 1)
        return replace(self, **given)

    @property
    def sampling(self) -> bool:
        return self.sampling_topk != 1

    @property
    def masked(self) -> bool:
        """Whether tokens are disabled or repeats penalised (TokenMasks) or a prefix favoured: the rows then rank
        the whole vocabulary in their search."""
        return bool(self.min_decoding_length or self.disable_unk or self.no_repeat_ngram_size or self.suppress_sequences
                    or self.prefix_bias_beta or self.repetition_penalty != 1)

    @property
    def greedy(self) -> bool:
        """Greedy search as the callers run it vectorised; with disabled tokens a beam of one does it instead."""
        return self.beam_size == 1 and not self.sampling and not self.masked and not self.constraints

    @property
    def mode(self) -> str:
        """"greedy", "beam" or "sampling": the decoding mode, as metrics label it."""
        return "sampling" if self.sampling else "greedy" if self.beam_size == 1 else "beam"

    def check(self, vocab_size: int, max_beam_size: int | None = None) -> None:
        """ConfigError naming the field, its value and the limit, for a value out of range."""
        k, n = self.beam_size, self.num_hypotheses
        rules = [  # in order: a rule may assume the ones before it hold
            ("beam_size", k, lambda: k >= 1, "at least 1"),
            ("beam_size", k, lambda: max_beam_size is None or k <= max_beam_size,
             f"at most {max_beam_size} (the server's --max-beam-size)"),
            ("beam_size", k, lambda: 2 * k <= vocab_size, f"at most {vocab_size // 2} (half the vocabulary)"),
            ("num_hypotheses", n, lambda: 1 <= n <= k, f"between 1 and beam_size ({k})"),
            ("length_penalty", self.length_penalty, lambda: np.isfinite(self.length_penalty), "a finite number"),
            ("patience", self.patience, lambda: 0 < self.patience < np.inf, "above 0"),
            ("patience", self.patience, lambda: round(k * self.patience) >= n,
             f"enough for num_hypotheses ({n}) finished hypotheses: beam_size × patience"),
            ("sampling_topk", self.sampling_topk, lambda: 0 <= self.sampling_topk <= vocab_size,
             f"between 0 (the whole vocabulary) and {vocab_size}"),
            ("sampling_topk", self.sampling_topk, lambda: not self.sampling or k == 1,
             "1 (no sampling) with beam_size above 1"),
            ("sampling_topp", self.sampling_topp, lambda: 0 < self.sampling_topp <= 1, "in (0, 1]"),
            ("sampling_temperature", self.sampling_temperature, lambda: 0 < self.sampling_temperature < np.inf,
             "above 0"),
            ("seed", self.seed, lambda: 0 <= self.seed < 2 ** 64, "between 0 and 2^64 - 1"),
            ("max_decoding_length", self.max_decoding_length, lambda: self.max_decoding_length >= 1, "at least 1"),
            ("beam_stopping", self.beam_stopping, lambda: self.beam_stopping in BEAM_STOPPING,
             " or ".join(BEAM_STOPPING)),
            ("length_rule", self.length_rule, lambda: self.length_rule in LENGTH_RULES, " or ".join(LENGTH_RULES)),
            ("min_decoding_length", self.min_decoding_length,
             lambda: 0 <= self.min_decoding_length <= self.max_decoding_length,
             f"between 0 and max_decoding_length ({self.max_decoding_length})"),
            ("no_repeat_ngram_size", self.no_repeat_ngram_size, lambda: self.no_repeat_ngram_size >= 0, "0 or more"),
            ("repetition_penalty", self.repetition_penalty, lambda: 0 < self.repetition_penalty < np.inf,
             "above 0 (1: none)"),
            ("prefix_bias_beta", self.prefix_bias_beta, lambda: 0 <= self.prefix_bias_beta < 1, "in [0, 1)"),
            ("prefix_bias_beta", self.prefix_bias_beta, lambda: not (self.prefix_bias_beta and self.sampling),
             "0 when sampling"),
            ("suppress_sequences", self.suppress_sequences,
             lambda: all(s and all(0 <= t < vocab_size for t in s) for s in self.suppress_sequences),
             f"sequences of at least one token id between 0 and {vocab_size - 1}"),
            ("constraints", self.constraints,
             lambda: all(c and all(0 <= t < vocab_size for t in c) for c in self.constraints),
             f"sequences of at least one token id between 0 and {vocab_size - 1}"),
            ("constraints", self.constraints, lambda: not (self.constraints and self.sampling), "none when sampling"),
            ("beam_size", k, lambda: k > sum(len(c) for c in self.constraints),
             f"above the constraints' {sum(len(c) for c in self.constraints)} tokens (a beam per bank)"),
        ]
        for name, value, ok, limit in rules:
            if not ok():
                raise ConfigError(f"{name} {value}: must be {limit}")


@dataclass
class Hypothesis:
    tokens: list[int]  # target ids, eos excluded
    score: float  # beam search: sum of log-probs (eos included) / length ** length_penalty; else the sum
    finish: str  # "eos" or "length"
    mean_log_prob: float = math.nan  # of the tokens decoded, eos included (`mean_log_prob`); nan when not scored
    # asked for (return_attention): (forced prefix + tokens, source tokens) float32, each token's weights over the
    # source (export/runtime/aligner.py); None otherwise
    attention: np.ndarray | None = None

    def shown_attention(self, shown_prefix: int) -> np.ndarray:
        """Its attention at the tokens a translation shows: its forced target_prefix's (`shown_prefix` of them) and
        its own, not a target language's tokens forced before them."""
        return self.attention[len(self.attention) - shown_prefix - len(self.tokens):]

    @property
    def confidence(self) -> float:
        """exp(mean_log_prob): the geometric mean of its decoded tokens' probabilities, from 0 to 1 (nan when not
        scored). A translation scoring higher is more often right: `nmtserve evaluate --calibration` shows how."""
        return math.exp(self.mean_log_prob)


def mean_log_prob(total: float, tokens: int, eos: bool) -> float:
    """The mean log-prob of a hypothesis's decoded tokens: `total`, the sum of the log-probs of its `tokens` decoded
    tokens and of its eos (when `eos`: one decoded), over their count (forced tokens are neither summed nor counted)."""
    return total / max(1, tokens + eos)


def output_budget(src_len: int, max_decoding_length: int, max_len: int, length_rule: str = "nmtserve") -> int:
    """Most target tokens a row may produce, eos aside. "nmtserve": the caller's limit, 2×source+10 (a
    guard against a decoder that never stops) and the model's position table; the last one is a real
    token (finish "length"). "transformers", the rule of transformers' generate with forced_eos_token_id:
    the caller's limit and the position table only, and the limit's last token is a forced eos with
    log-prob 0, so one real token fewer (BeamSearch finishes every live beam there). "ctranslate2",
    CTranslate2's max_decoding_length: the caller's limit and the position table only, the last one a real
    token (what the offline benchmark gives every engine: the same work for the same sentence)."""
    if length_rule == "transformers":
        return max(1, min(max_decoding_length, max_len) - 1)
    if length_rule == "ctranslate2":
        return max(1, min(max_decoding_length, max_len))
    return max(1, min(max_decoding_length, 2 * src_len + 10, max_len))


@dataclass(frozen=True)
class Limits:
    """Every limit a row can run into, from the bundle's manifest (`limits`), in one place. A source
    longer than max_source_tokens is refused by the server (OnnxTranslator truncates it) before it is
    encoded; a row's budget never takes it past the decoder's position table, so a row that reaches
    max_target_tokens finishes with LENGTH before a step could index past the table (a hole never
    advances: export/runtime/batch.py)."""

    max_source_tokens: int  # the encoder's position table
    max_target_tokens: int  # the decoder's position table: positions 0 .. max_target_tokens - 1

    def output_budget(self, src_len: int, max_decoding_length: int, length_rule: str = "nmtserve") -> int:
        return output_budget(src_len, max_decoding_length, self.max_target_tokens, length_rule)


def by_length(prefixes: list[list[int]]) -> list[list[int]]:
    """The indices of the prefixes of each length, shortest first: rows that start at one position together."""
    lengths = sorted({len(p) for p in prefixes})
    return [[i for i, p in enumerate(prefixes) if len(p) == n] for n in lengths]


def sorted_batches(lengths: list[int], max_batch_size: int, at_once: int = 1) -> Iterator[list[int]]:
    """Indices sorted by length, longest first, cut into as few batches of at most max_batch_size as
    possible, of sizes that differ by one at most (200 sources at 64: four of 50, not 64, 64, 64 and 8):
    little padding per batch, no small batch left at the end. With `at_once` batches decoded at once (each
    thread taking the next), their count is rounded up to a multiple of at_once where there are sources
    enough (200 at 32 on 2 threads: eight of 25, not seven of 28–29, the last of which would run alone), so
    that the threads finish about together."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    count = -(-len(order) // max_batch_size)
    count = min(len(order), -(-count // at_once) * at_once)
    bounds = [i * len(order) // count for i in range(count + 1)]
    for start, stop in zip(bounds, bounds[1:]):
        yield order[start:stop]


def guided_groups(batches: list, most: int, at_once: int = 1) -> list[list]:
    """Consecutive batches cut into groups of at most `most` (encoded in one call, then decoded one after
    another), with `at_once` threads each taking the next group: a group is at most a (2 × at_once)th of the
    batches left (OpenMP's guided schedule), so the groups shrink to single batches at the end and the threads
    finish about together. Batches longest first (sorted_batches), the last ones are also the shortest. 26 batches
    on 2 threads: 6, 5, 3, 3, 2, then single batches (fixed groups left one thread idle at the end:
    docs/performance-journal.md, "The threads' tail, and what two threads cost each other")."""
    groups, start = [], 0
    while start < len(batches):
        size = most if at_once == 1 else max(1, min(most, (len(batches) - start) // (2 * at_once)))
        groups.append(batches[start:start + size])
        start += size
    return groups
