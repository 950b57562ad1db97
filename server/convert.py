"""Protobuf to the engine's types and back, in one place: a call's DecodingOptions into the search's options,
and a finished engine Request into a Translation. The servicer (service.py) calls these; the engine never sees
protobuf.
"""

from __future__ import annotations

import time
from typing import NamedTuple

from nmtserve.decoding import DecodingOptions, Hypothesis
from nmtserve.errors import ConfigError, NmtserveError
from nmtserve.export.runtime.request import FinishReason, Request
from nmtserve.v1 import translation_pb2 as pb

FINISH_REASONS = {FinishReason.EOS: pb.FINISH_REASON_EOS, FinishReason.LENGTH: pb.FINISH_REASON_LENGTH}


class InvalidRequest(NmtserveError):
    """A request field is out of range; the message names the field, the value and the limit."""


class ModelNotFound(NmtserveError):
    """No served model is the one a request names, or serves the language pair it asks for (NOT_FOUND)."""


class CallOptions(NamedTuple):
    """What a call asks of each of its sentences' engine requests."""
    max_tokens: int  # most output tokens
    search: DecodingOptions
    scored: bool  # return_scores
    attention: bool  # return_attention


def decoding_options(options: pb.DecodingOptions, defaults: DecodingOptions, default_output_tokens: int,
                     max_decoding_length: int, vocab_size: int, max_beam_size: int,
                     encode_target=None) -> tuple[int, DecodingOptions]:
    """(most output tokens, the search's options) of a call; InvalidRequest naming `options.FIELD`, its value and
    the limit. proto3 zeros and absent fields mean "unset": the model's `defaults`, num_hypotheses 1, and
    beam_size 1 for a sampled request. `encode_target`: the model's target text -> ids (suppress_sequences)."""
    if options.max_decoding_length > max_decoding_length:
        raise InvalidRequest(f"options.max_decoding_length {options.max_decoding_length} exceeds the limit {max_decoding_length}")
    given = {name: getattr(options, name) for name in ("length_penalty", "patience", "sampling_topk",
                                                          "sampling_topp", "sampling_temperature", "prefix_bias_beta",
                                                          "repetition_penalty")
             if options.HasField(name)}
    given.update({name: getattr(options, name) for name in ("beam_size", "num_hypotheses", "seed", "min_decoding_length",
                                                            "disable_unk", "no_repeat_ngram_size")
                  if getattr(options, name)})
    if options.suppress_sequences:
        given["suppress_sequences"] = tuple(tuple(encode_target(text)) for text in options.suppress_sequences)
    if options.beam_stopping:
        given["beam_stopping"] = pb.BeamStopping.Name(options.beam_stopping).removeprefix("BEAM_STOPPING_").lower()
    if options.length_rule:
        given["length_rule"] = pb.LengthRule.Name(options.length_rule).removeprefix("LENGTH_RULE_").lower()
    search = defaults.override(**given)
    try:
        search.check(vocab_size, max_beam_size)
    except ConfigError as e:
        raise InvalidRequest(f"options.{e}") from None
    return options.max_decoding_length or default_output_tokens, search


def translation(request: Request, tokenizer, started: float, resumed: float | None, return_scores: bool) -> pb.Translation:
    """A finished request as the Translation message: texts by the model's tokenizer, its n-best list (with their
    attention when the request asked for it), finish reason and timings (`started`: when the call's handler began;
    `resumed`: when it resumed)."""
    decode = tokenizer.decode
    arrived = request.arrived
    timings = pb.Timings(queue_ns=ns((request.admitted or arrived) - arrived),
                         time_to_first_token_ns=ns((request.first_token or arrived) - arrived),
                         total_ns=ns((request.finished or arrived) - arrived),
                         prepare_ns=ns(arrived - started), encoded_ns=ns((request.encoded or arrived) - arrived),
                         resumed_ns=ns((resumed or started) - started))
    shown = request.shown_prefix  # a target_prefix's tokens begin every hypothesis
    alternatives = [pb.Hypothesis(text=decode(shown + h.tokens), output_tokens=len(shown) + len(h.tokens), score=h.score,
                                  mean_log_prob=h.mean_log_prob, confidence=h.confidence)
                    for h in request.hypotheses[1:]]
    message = pb.Translation(text=decode(shown + request.tokens), input_tokens=len(request.src_ids),
                             output_tokens=len(shown) + len(request.tokens), score=request.score if return_scores else 0.0,
                             finish_reason=FINISH_REASONS.get(request.finish, pb.FINISH_REASON_UNSPECIFIED),
                             timings=timings, alternatives=alternatives)
    if return_scores and request.finish in (FinishReason.EOS, FinishReason.LENGTH):
        best = request.results()[0]
        message.mean_log_prob, message.confidence = best.mean_log_prob, best.confidence
    if request.attention and request.hypotheses:
        for target, h in zip([message, *message.alternatives], request.hypotheses):
            target.attention.CopyFrom(attention(h, shown, request.src_ids, tokenizer.piece))
    message.timings.handler_ns = ns(time.monotonic() - started)
    return message


def attention(hypothesis: Hypothesis, shown: list[int], source: list[int], piece) -> pb.Attention:
    """A hypothesis's attention at the tokens its text shows (a target_prefix's `shown` first), with the source's and
    those tokens' pieces (`piece`: the tokenizer's id -> piece)."""
    weights = hypothesis.shown_attention(len(shown))
    return pb.Attention(source_tokens=[piece(i) for i in source], target_tokens=[piece(i) for i in shown + hypothesis.tokens],
                        rows=[pb.AttentionRow(weights=row) for row in weights.tolist()])


def ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))
