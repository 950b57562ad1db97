"""Property-based fuzzing of request messages against a real server: every answer is OK with one
translation per sentence, or INVALID_ARGUMENT whose message starts with the field it is about;
never INTERNAL, UNKNOWN or a crash. The server's limits (tests/server/conftest.py): 8 sentences of
at most 300 characters, max_decoding_length at most 64."""

import grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nmtserve.v1 import translation_pb2 as pb
from nmtserve.v1 import translation_pb2_grpc as pb_grpc

FIELDS = ("sentences", "sentence", "options.")
SETTINGS = settings(max_examples=120, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

# any Unicode text but surrogates (which a protobuf string cannot hold), with lengths around the
# 300-character limit as well as short ones, and the odd characters traffic brings
ODD = st.sampled_from(["\x00", "\x07", "\x1b[0m", "\t", "\r\n", "\u200b", "\u200d", "\ufeff", "\u202e", "\U0001f408",
                       "\u0645\u0631\u062d\u0628\u0627", "e\u0301", " "])
SENTENCE = st.one_of(st.text(max_size=40), st.lists(ODD | st.text(max_size=5), max_size=20).map("".join),
                     st.text(min_size=290, max_size=310), st.just("The cat sleeps."))
FLOAT = st.floats(width=32)  # NaN and infinities included
OPTIONS = st.builds(pb.DecodingOptions, max_decoding_length=st.one_of(st.integers(0, 70), st.integers(0, 2**32 - 1)),
                    return_scores=st.booleans(), beam_size=st.one_of(st.integers(0, 3), st.integers(0, 2**32 - 1)),
                    num_hypotheses=st.integers(0, 4), length_penalty=FLOAT, seed=st.integers(0, 2**64 - 1),
                    patience=st.none() | FLOAT, sampling_topk=st.none() | st.integers(0, 2**32 - 1),
                    sampling_topp=st.none() | FLOAT, sampling_temperature=st.none() | FLOAT)


def _answered(served, call):
    """call(stub) against the server: its result when OK; None when INVALID_ARGUMENT names the field;
    any other status code fails the test."""
    with served.channel() as channel:
        try:
            return call(pb_grpc.TranslationServiceStub(channel))
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details())
            assert e.details().startswith(FIELDS), e.details()
            return None


@given(sentences=st.lists(SENTENCE, max_size=10), options=OPTIONS)
@SETTINGS
def test_any_translate_request_is_answered_ok_or_invalid_argument_naming_the_field(served, sentences, options):
    request = pb.TranslateRequest(sentences=sentences, options=options)
    response = _answered(served, lambda stub: stub.Translate(request, timeout=60))
    if response is not None:
        assert len(response.translations) == len(sentences)


@given(sentence=SENTENCE, options=OPTIONS)
@SETTINGS
def test_any_stream_request_is_answered_ok_or_invalid_argument_naming_the_field(served, sentence, options):
    request = pb.TranslateStreamRequest(sentence=sentence, options=options)
    messages = _answered(served, lambda stub: list(stub.TranslateStream(request, timeout=60)))
    if messages is not None:
        assert messages[-1].HasField("final") and "".join(m.delta for m in messages[:-1]) == messages[-1].final.text


MARKUP = st.lists(st.sampled_from(["<p>", "</p>", "<b>", "</b>", "<i>", "</i>", "<br>", "<a href='x'>", "</a>",
                                   "<!-- c -->", "&amp;", "&bogus;", "&", "<", ">", "<code>", "</code>", "<?pi x?>",
                                   "<x:y>", "</x:y>", "<![CDATA[ z ]]>", "\n"]) | SENTENCE.map(lambda s: s[:20]),
                  max_size=14).map("".join)


@given(texts=st.lists(MARKUP, min_size=1, max_size=3), xml=st.booleans())
@SETTINGS
def test_any_markup_text_is_answered_ok_or_invalid_argument_naming_the_text(served, texts, xml):
    """Random HTML or XML, well-formed or not, through TranslateText: one translation per text, or INVALID_ARGUMENT
    naming the text (a malformed one: its line and column)."""
    request = pb.TranslateTextRequest(texts=texts, mime_type="application/xml" if xml else "text/html")
    with served.channel() as channel:
        try:
            response = pb_grpc.TranslationServiceStub(channel).TranslateText(request, timeout=60)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details())
            assert e.details().startswith("texts"), e.details()
            return
    assert len(response.translations) == len(texts)
