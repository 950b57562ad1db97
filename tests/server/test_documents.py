"""Whole texts: split into sentences, each translated as its own request, rejoined byte
for byte around the translations; alignment spans, over-long sentences, limits, streaming."""

from __future__ import annotations

import subprocess

import grpc
import pytest

from nmtserve.server.config import ServerConfig
from nmtserve.server.documents import fit, rejoin, sentence_spans
from nmtserve.v1 import translation_pb2 as pb
from nmtserve.v1 import translation_pb2_grpc as pb_grpc
from tests.helpers import NMTSERVE, ServerThread

# paragraphs, blank lines, CRLF, tabs, runs of spaces, leading and trailing whitespace, abbreviations
DOCUMENT = ("  The cat sees the dog.  Dr. Smith reads a book at 3 p.m. today!\r\n\r\n"
            "\tThe girl walks slowly.   Did the boys eat?\n"
            "The lawyer writes.\n\n   ")
GREEDY = pb.DecodingOptions(beam_size=1, max_decoding_length=20)


@pytest.fixture(scope="module")
def server(tiny_bundle):
    running = ServerThread(ServerConfig.from_flags(bundle=str(tiny_bundle), host="127.0.0.1", port=0, metrics_port=0,
                                        max_sentence_chars=120, max_text_chars=400, max_call_chars=600))
    yield running
    running.stop()


def test_spans_cover_the_sentences_and_rejoining_keeps_everything_between_them():
    spans = sentence_spans(DOCUMENT, "en")
    assert [DOCUMENT[a:b] for a, b in spans] == ["The cat sees the dog.", "Dr. Smith reads a book at 3 p.m. today!",
                                                 "The girl walks slowly.", "Did the boys eat?", "The lawyer writes."]
    assert rejoin(DOCUMENT, spans, [DOCUMENT[a:b] for a, b in spans])[0] == DOCUMENT
    joined, alignment = rejoin(DOCUMENT, spans, ["A", "BB", "", "C", "DDDD"])
    assert joined == "  A  BB\r\n\r\n\t   C\nDDDD\n\n   "
    assert [joined[c:d] for *_, c, d in alignment] == ["A", "BB", "", "C", "DDDD"]
    assert [(a, b) for a, b, *_ in alignment] == spans


def test_an_over_long_sentence_is_split_after_a_clause_then_at_whitespace_then_anywhere():
    text = "one two three, four five six; seven eight nine ten"
    pieces = fit(text, (0, len(text)), lambda piece: len(piece) > 14)
    assert [text[a:b] for a, b in pieces] == ["one two three,", "four five six;", "seven eight", "nine ten"]
    word = "abcdefgh"
    assert [word[a:b] for a, b in fit(word, (0, 8), lambda piece: len(piece) > 3)] == ["ab", "cd", "ef", "gh"]


def test_translate_text_translates_each_sentence_as_alone_and_keeps_the_whitespace(server):
    spans = sentence_spans(DOCUMENT, "en")
    with server.channel() as channel:
        stub = pb_grpc.TranslationServiceStub(channel)
        alone = stub.Translate(pb.TranslateRequest(sentences=[DOCUMENT[a:b] for a, b in spans], options=GREEDY),
                               timeout=60).translations
        got = stub.TranslateText(pb.TranslateTextRequest(texts=[DOCUMENT, "", " \n\t", "The dog sleeps."],
                                                         options=GREEDY, return_alignment=True), timeout=60)
    document, empty, blank, single = got.translations
    assert document.text == rejoin(DOCUMENT, spans, [t.text for t in alone])[0]
    assert document.sentences == 5 and document.input_tokens == sum(t.input_tokens for t in alone)
    assert document.output_tokens == sum(t.output_tokens for t in alone)
    for a, t in zip(document.alignment, alone):
        assert document.text[a.target_start:a.target_end] == t.text
    assert [(a.source_start, a.source_end) for a in document.alignment] == spans
    assert (empty.text, empty.sentences, blank.text, blank.sentences) == ("", 0, " \n\t", 0)
    assert single.sentences == len(single.alignment) == 1


def test_a_sentence_over_the_character_limit_is_translated_in_pieces(server):
    long = ", ".join(["the cat sees the dog"] * 8) + "."  # 175 characters, the server's limit is 120
    with server.channel() as channel:
        got = pb_grpc.TranslationServiceStub(channel).TranslateText(
            pb.TranslateTextRequest(texts=[long], options=GREEDY, return_alignment=True), timeout=60).translations[0]
    pieces = [long[a.source_start:a.source_end] for a in got.alignment]
    assert got.sentences == len(pieces) == 2 and all(len(p) <= 120 for p in pieces)
    assert " ".join(pieces) == long


def test_texts_stream_sentence_by_sentence_in_order(server):
    with server.channel() as channel:
        stub = pb_grpc.TranslationServiceStub(channel)
        whole = stub.TranslateText(pb.TranslateTextRequest(texts=[DOCUMENT], options=GREEDY, return_alignment=True),
                                   timeout=60).translations[0]
        messages = list(stub.TranslateTextStream(pb.TranslateTextStreamRequest(text=DOCUMENT, options=GREEDY),
                                                 timeout=60))
    assert "".join(m.delta for m in messages) == whole.text
    assert [m.alignment for m in messages[:-1]] == list(whole.alignment)
    assert not messages[-1].HasField("alignment") and messages[-1].delta == "\n\n   "


@pytest.mark.parametrize("request_, message", [
    (pb.TranslateTextRequest(texts=["<p>Hi.</p>", "<p>Hi <b>there.</p>"], mime_type="text/html"),
     "texts[1]: malformed HTML at line 1, column 20: Opening and ending tag mismatch: p and b"),
    (pb.TranslateTextRequest(texts=["a"], mime_type="application/pdf"),
     "mime_type 'application/pdf': not supported; send text/plain, text/html, application/xml"),
    (pb.TranslateTextRequest(texts=["The cat.", "The dog. " * 50]), "texts[1]: 450 characters, the limit is 400"),
    (pb.TranslateTextRequest(texts=["The dog sleeps. " * 20] * 2), "texts: 640 characters in all, the limit is 600"),
    (pb.TranslateTextRequest(texts=[]), "texts: 0 given, between 1 and 64 accepted"),
])
def test_bad_texts_are_refused_naming_the_field(server, request_, message):
    with server.channel() as channel, pytest.raises(grpc.RpcError) as refused:
        pb_grpc.TranslationServiceStub(channel).TranslateText(request_, timeout=30)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details() == message
    with server.channel() as channel, pytest.raises(grpc.RpcError) as refused:
        list(pb_grpc.TranslationServiceStub(channel).TranslateTextStream(
            pb.TranslateTextStreamRequest(text="x " * 300), timeout=30))
    assert refused.value.details() == "text: 600 characters, the limit is 400"


def test_translate_cli_translates_a_whole_file_over_the_per_text_limit(server, tmp_path):
    path = tmp_path / "document.txt"
    path.write_bytes((DOCUMENT * 3).encode())  # 450 characters: cut at line breaks into two texts of ≤ 400
    with server.channel() as channel:
        whole = pb_grpc.TranslationServiceStub(channel).TranslateText(
            pb.TranslateTextRequest(texts=[DOCUMENT], options=GREEDY), timeout=60).translations[0]
    out = subprocess.run([NMTSERVE, "translate", "--server", server.target, "--file", str(path), "--beam-size", "1",
                          "--max-decoding-length", "20"], capture_output=True, timeout=120)  # bytes: CRLF must stay CRLF
    assert out.returncode == 0, out.stderr
    assert out.stdout == (whole.text * 3).encode()
