from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class BeamStopping(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BEAM_STOPPING_UNSPECIFIED: _ClassVar[BeamStopping]
    BEAM_STOPPING_CTRANSLATE2: _ClassVar[BeamStopping]
    BEAM_STOPPING_TRANSFORMERS: _ClassVar[BeamStopping]

class LengthRule(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LENGTH_RULE_UNSPECIFIED: _ClassVar[LengthRule]
    LENGTH_RULE_NMTSERVE: _ClassVar[LengthRule]
    LENGTH_RULE_TRANSFORMERS: _ClassVar[LengthRule]
    LENGTH_RULE_CTRANSLATE2: _ClassVar[LengthRule]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
BEAM_STOPPING_UNSPECIFIED: BeamStopping
BEAM_STOPPING_CTRANSLATE2: BeamStopping
BEAM_STOPPING_TRANSFORMERS: BeamStopping
LENGTH_RULE_UNSPECIFIED: LengthRule
LENGTH_RULE_NMTSERVE: LengthRule
LENGTH_RULE_TRANSFORMERS: LengthRule
LENGTH_RULE_CTRANSLATE2: LengthRule
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_LENGTH: FinishReason

class DecodingOptions(_message.Message):
    __slots__ = ("max_decoding_length", "return_scores", "beam_size", "num_hypotheses", "length_penalty", "patience", "sampling_topk", "sampling_topp", "sampling_temperature", "seed", "beam_stopping", "length_rule", "min_decoding_length", "disable_unk", "no_repeat_ngram_size", "suppress_sequences", "prefix_bias_beta", "repetition_penalty", "return_attention")
    MAX_DECODING_LENGTH_FIELD_NUMBER: _ClassVar[int]
    RETURN_SCORES_FIELD_NUMBER: _ClassVar[int]
    BEAM_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_HYPOTHESES_FIELD_NUMBER: _ClassVar[int]
    LENGTH_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PATIENCE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_TOPK_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_TOPP_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    BEAM_STOPPING_FIELD_NUMBER: _ClassVar[int]
    LENGTH_RULE_FIELD_NUMBER: _ClassVar[int]
    MIN_DECODING_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DISABLE_UNK_FIELD_NUMBER: _ClassVar[int]
    NO_REPEAT_NGRAM_SIZE_FIELD_NUMBER: _ClassVar[int]
    SUPPRESS_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BIAS_BETA_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    RETURN_ATTENTION_FIELD_NUMBER: _ClassVar[int]
    max_decoding_length: int
    return_scores: bool
    beam_size: int
    num_hypotheses: int
    length_penalty: float
    patience: float
    sampling_topk: int
    sampling_topp: float
    sampling_temperature: float
    seed: int
    beam_stopping: BeamStopping
    length_rule: LengthRule
    min_decoding_length: int
    disable_unk: bool
    no_repeat_ngram_size: int
    suppress_sequences: _containers.RepeatedScalarFieldContainer[str]
    prefix_bias_beta: float
    repetition_penalty: float
    return_attention: bool
    def __init__(self, max_decoding_length: _Optional[int] = ..., return_scores: _Optional[bool] = ..., beam_size: _Optional[int] = ..., num_hypotheses: _Optional[int] = ..., length_penalty: _Optional[float] = ..., patience: _Optional[float] = ..., sampling_topk: _Optional[int] = ..., sampling_topp: _Optional[float] = ..., sampling_temperature: _Optional[float] = ..., seed: _Optional[int] = ..., beam_stopping: _Optional[_Union[BeamStopping, str]] = ..., length_rule: _Optional[_Union[LengthRule, str]] = ..., min_decoding_length: _Optional[int] = ..., disable_unk: _Optional[bool] = ..., no_repeat_ngram_size: _Optional[int] = ..., suppress_sequences: _Optional[_Iterable[str]] = ..., prefix_bias_beta: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., return_attention: _Optional[bool] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queue_ns", "time_to_first_token_ns", "total_ns", "prepare_ns", "handler_ns", "encoded_ns", "resumed_ns")
    QUEUE_NS_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_NS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NS_FIELD_NUMBER: _ClassVar[int]
    PREPARE_NS_FIELD_NUMBER: _ClassVar[int]
    HANDLER_NS_FIELD_NUMBER: _ClassVar[int]
    ENCODED_NS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_NS_FIELD_NUMBER: _ClassVar[int]
    queue_ns: int
    time_to_first_token_ns: int
    total_ns: int
    prepare_ns: int
    handler_ns: int
    encoded_ns: int
    resumed_ns: int
    def __init__(self, queue_ns: _Optional[int] = ..., time_to_first_token_ns: _Optional[int] = ..., total_ns: _Optional[int] = ..., prepare_ns: _Optional[int] = ..., handler_ns: _Optional[int] = ..., encoded_ns: _Optional[int] = ..., resumed_ns: _Optional[int] = ...) -> None: ...

class Hypothesis(_message.Message):
    __slots__ = ("text", "output_tokens", "score", "mean_log_prob", "confidence", "attention")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    MEAN_LOG_PROB_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    text: str
    output_tokens: int
    score: float
    mean_log_prob: float
    confidence: float
    attention: Attention
    def __init__(self, text: _Optional[str] = ..., output_tokens: _Optional[int] = ..., score: _Optional[float] = ..., mean_log_prob: _Optional[float] = ..., confidence: _Optional[float] = ..., attention: _Optional[_Union[Attention, _Mapping]] = ...) -> None: ...

class Attention(_message.Message):
    __slots__ = ("source_tokens", "target_tokens", "rows")
    SOURCE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TARGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    source_tokens: _containers.RepeatedScalarFieldContainer[str]
    target_tokens: _containers.RepeatedScalarFieldContainer[str]
    rows: _containers.RepeatedCompositeFieldContainer[AttentionRow]
    def __init__(self, source_tokens: _Optional[_Iterable[str]] = ..., target_tokens: _Optional[_Iterable[str]] = ..., rows: _Optional[_Iterable[_Union[AttentionRow, _Mapping]]] = ...) -> None: ...

class AttentionRow(_message.Message):
    __slots__ = ("weights",)
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    weights: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, weights: _Optional[_Iterable[float]] = ...) -> None: ...

class Translation(_message.Message):
    __slots__ = ("text", "input_tokens", "output_tokens", "score", "finish_reason", "timings", "alternatives", "mean_log_prob", "confidence", "attention")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    ALTERNATIVES_FIELD_NUMBER: _ClassVar[int]
    MEAN_LOG_PROB_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    text: str
    input_tokens: int
    output_tokens: int
    score: float
    finish_reason: FinishReason
    timings: Timings
    alternatives: _containers.RepeatedCompositeFieldContainer[Hypothesis]
    mean_log_prob: float
    confidence: float
    attention: Attention
    def __init__(self, text: _Optional[str] = ..., input_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., score: _Optional[float] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., alternatives: _Optional[_Iterable[_Union[Hypothesis, _Mapping]]] = ..., mean_log_prob: _Optional[float] = ..., confidence: _Optional[float] = ..., attention: _Optional[_Union[Attention, _Mapping]] = ...) -> None: ...

class TranslateRequest(_message.Message):
    __slots__ = ("sentences", "options", "target_language", "model", "source_language", "target_prefix", "glossary")
    SENTENCES_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    TARGET_LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SOURCE_LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    TARGET_PREFIX_FIELD_NUMBER: _ClassVar[int]
    GLOSSARY_FIELD_NUMBER: _ClassVar[int]
    sentences: _containers.RepeatedScalarFieldContainer[str]
    options: DecodingOptions
    target_language: str
    model: str
    source_language: str
    target_prefix: _containers.RepeatedScalarFieldContainer[str]
    glossary: _containers.RepeatedCompositeFieldContainer[GlossaryEntry]
    def __init__(self, sentences: _Optional[_Iterable[str]] = ..., options: _Optional[_Union[DecodingOptions, _Mapping]] = ..., target_language: _Optional[str] = ..., model: _Optional[str] = ..., source_language: _Optional[str] = ..., target_prefix: _Optional[_Iterable[str]] = ..., glossary: _Optional[_Iterable[_Union[GlossaryEntry, _Mapping]]] = ...) -> None: ...

class GlossaryEntry(_message.Message):
    __slots__ = ("source", "target")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    source: str
    target: str
    def __init__(self, source: _Optional[str] = ..., target: _Optional[str] = ...) -> None: ...

class DetectedLanguage(_message.Message):
    __slots__ = ("language", "confidence")
    LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    language: str
    confidence: float
    def __init__(self, language: _Optional[str] = ..., confidence: _Optional[float] = ...) -> None: ...

class TranslateResponse(_message.Message):
    __slots__ = ("translations", "detected_language")
    TRANSLATIONS_FIELD_NUMBER: _ClassVar[int]
    DETECTED_LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    translations: _containers.RepeatedCompositeFieldContainer[Translation]
    detected_language: DetectedLanguage
    def __init__(self, translations: _Optional[_Iterable[_Union[Translation, _Mapping]]] = ..., detected_language: _Optional[_Union[DetectedLanguage, _Mapping]] = ...) -> None: ...

class TranslateStreamRequest(_message.Message):
    __slots__ = ("sentence", "options", "target_language", "model", "source_language", "target_prefix", "glossary")
    SENTENCE_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    TARGET_LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SOURCE_LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    TARGET_PREFIX_FIELD_NUMBER: _ClassVar[int]
    GLOSSARY_FIELD_NUMBER: _ClassVar[int]
    sentence: str
    options: DecodingOptions
    target_language: str
    model: str
    source_language: str
    target_prefix: str
    glossary: _containers.RepeatedCompositeFieldContainer[GlossaryEntry]
    def __init__(self, sentence: _Optional[str] = ..., options: _Optional[_Union[DecodingOptions, _Mapping]] = ..., target_language: _Optional[str] = ..., model: _Optional[str] = ..., source_language: _Optional[str] = ..., target_prefix: _Optional[str] = ..., glossary: _Optional[_Iterable[_Union[GlossaryEntry, _Mapping]]] = ...) -> None: ...

class TranslateStreamResponse(_message.Message):
    __slots__ = ("delta", "final", "detected_language")
    DELTA_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    DETECTED_LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    delta: str
    final: Translation
    detected_language: DetectedLanguage
    def __init__(self, delta: _Optional[str] = ..., final: _Optional[_Union[Translation, _Mapping]] = ..., detected_language: _Optional[_Union[DetectedLanguage, _Mapping]] = ...) -> None: ...

class TranslateTextRequest(_message.Message):
    __slots__ = ("texts", "mime_type", "options", "model", "source_language", "target_language", "return_alignment")
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    MIME_TYPE_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SOURCE_LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    TARGET_LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    RETURN_ALIGNMENT_FIELD_NUMBER: _ClassVar[int]
    texts: _containers.RepeatedScalarFieldContainer[str]
    mime_type: str
    options: DecodingOptions
    model: str
    source_language: str
    target_language: str
    return_alignment: bool
    def __init__(self, texts: _Optional[_Iterable[str]] = ..., mime_type: _Optional[str] = ..., options: _Optional[_Union[DecodingOptions, _Mapping]] = ..., model: _Optional[str] = ..., source_language: _Optional[str] = ..., target_language: _Optional[str] = ..., return_alignment: _Optional[bool] = ...) -> None: ...

class SentenceAlignment(_message.Message):
    __slots__ = ("source_start", "source_end", "target_start", "target_end")
    SOURCE_START_FIELD_NUMBER: _ClassVar[int]
    SOURCE_END_FIELD_NUMBER: _ClassVar[int]
    TARGET_START_FIELD_NUMBER: _ClassVar[int]
    TARGET_END_FIELD_NUMBER: _ClassVar[int]
    source_start: int
    source_end: int
    target_start: int
    target_end: int
    def __init__(self, source_start: _Optional[int] = ..., source_end: _Optional[int] = ..., target_start: _Optional[int] = ..., target_end: _Optional[int] = ...) -> None: ...

class TextTranslation(_message.Message):
    __slots__ = ("text", "sentences", "input_tokens", "output_tokens", "alignment")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    SENTENCES_FIELD_NUMBER: _ClassVar[int]
    INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ALIGNMENT_FIELD_NUMBER: _ClassVar[int]
    text: str
    sentences: int
    input_tokens: int
    output_tokens: int
    alignment: _containers.RepeatedCompositeFieldContainer[SentenceAlignment]
    def __init__(self, text: _Optional[str] = ..., sentences: _Optional[int] = ..., input_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., alignment: _Optional[_Iterable[_Union[SentenceAlignment, _Mapping]]] = ...) -> None: ...

class TranslateTextResponse(_message.Message):
    __slots__ = ("translations", "detected_language")
    TRANSLATIONS_FIELD_NUMBER: _ClassVar[int]
    DETECTED_LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    translations: _containers.RepeatedCompositeFieldContainer[TextTranslation]
    detected_language: DetectedLanguage
    def __init__(self, translations: _Optional[_Iterable[_Union[TextTranslation, _Mapping]]] = ..., detected_language: _Optional[_Union[DetectedLanguage, _Mapping]] = ...) -> None: ...

class TranslateTextStreamRequest(_message.Message):
    __slots__ = ("text", "mime_type", "options", "model", "source_language", "target_language")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    MIME_TYPE_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SOURCE_LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    TARGET_LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    text: str
    mime_type: str
    options: DecodingOptions
    model: str
    source_language: str
    target_language: str
    def __init__(self, text: _Optional[str] = ..., mime_type: _Optional[str] = ..., options: _Optional[_Union[DecodingOptions, _Mapping]] = ..., model: _Optional[str] = ..., source_language: _Optional[str] = ..., target_language: _Optional[str] = ...) -> None: ...

class TranslateTextStreamResponse(_message.Message):
    __slots__ = ("delta", "alignment", "detected_language")
    DELTA_FIELD_NUMBER: _ClassVar[int]
    ALIGNMENT_FIELD_NUMBER: _ClassVar[int]
    DETECTED_LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    delta: str
    alignment: SentenceAlignment
    detected_language: DetectedLanguage
    def __init__(self, delta: _Optional[str] = ..., alignment: _Optional[_Union[SentenceAlignment, _Mapping]] = ..., detected_language: _Optional[_Union[DetectedLanguage, _Mapping]] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class Limits(_message.Message):
    __slots__ = ("max_sentences", "max_sentence_chars", "max_source_tokens", "max_decoding_length", "max_beam_size", "max_text_chars", "max_call_chars")
    MAX_SENTENCES_FIELD_NUMBER: _ClassVar[int]
    MAX_SENTENCE_CHARS_FIELD_NUMBER: _ClassVar[int]
    MAX_SOURCE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_DECODING_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_BEAM_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_TEXT_CHARS_FIELD_NUMBER: _ClassVar[int]
    MAX_CALL_CHARS_FIELD_NUMBER: _ClassVar[int]
    max_sentences: int
    max_sentence_chars: int
    max_source_tokens: int
    max_decoding_length: int
    max_beam_size: int
    max_text_chars: int
    max_call_chars: int
    def __init__(self, max_sentences: _Optional[int] = ..., max_sentence_chars: _Optional[int] = ..., max_source_tokens: _Optional[int] = ..., max_decoding_length: _Optional[int] = ..., max_beam_size: _Optional[int] = ..., max_text_chars: _Optional[int] = ..., max_call_chars: _Optional[int] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("source_language", "target_language", "bundle_id", "variant", "device", "model_json", "limits", "default_options", "target_languages", "model", "graphs", "kernels", "source_languages")
    SOURCE_LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    TARGET_LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    BUNDLE_ID_FIELD_NUMBER: _ClassVar[int]
    VARIANT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MODEL_JSON_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    TARGET_LANGUAGES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    GRAPHS_FIELD_NUMBER: _ClassVar[int]
    KERNELS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_LANGUAGES_FIELD_NUMBER: _ClassVar[int]
    source_language: str
    target_language: str
    bundle_id: str
    variant: str
    device: str
    model_json: str
    limits: Limits
    default_options: DecodingOptions
    target_languages: _containers.RepeatedScalarFieldContainer[str]
    model: str
    graphs: _containers.RepeatedScalarFieldContainer[str]
    kernels: str
    source_languages: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, source_language: _Optional[str] = ..., target_language: _Optional[str] = ..., bundle_id: _Optional[str] = ..., variant: _Optional[str] = ..., device: _Optional[str] = ..., model_json: _Optional[str] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., default_options: _Optional[_Union[DecodingOptions, _Mapping]] = ..., target_languages: _Optional[_Iterable[str]] = ..., model: _Optional[str] = ..., graphs: _Optional[_Iterable[str]] = ..., kernels: _Optional[str] = ..., source_languages: _Optional[_Iterable[str]] = ...) -> None: ...
