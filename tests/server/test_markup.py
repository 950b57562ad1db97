"""HTML and XML through TranslateText (server/markup.py): the document written back with the same tags, attributes,
comments and untranslated parts, block text translated as the plain text of its sentences would be, inline tags placed
by the attention; malformed markup refused naming its line and column."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lxml import etree

from nmtserve.server import markup
from nmtserve.v1 import translation_pb2 as pb
from nmtserve.v1 import translation_pb2_grpc as pb_grpc

HTML = [
    # nested inline tags, an attribute with text
    '<p>The <b>cat <i>sleeps</i></b> on the <a href="/mat?a=1&amp;b=2" title="The mat">mat</a>.</p>',
    # entities
    "<p>Tom &amp; Jerry &lt;3 the&nbsp;cheese, &eacute;t&eacute; &#169;.</p>",
    # comments, between blocks and inside text
    "<div><!-- note --><p>The dog eats.<!-- inline --> The cat sleeps.</p></div>",
    # void elements, inline and between blocks; attributes with text
    '<p><img src="a.png" alt="A red apple">The apple is red.<br>It is good.</p><hr><input placeholder="Your name">',
    # a page: doctype, head, untranslated script, style, code, pre and translate="no", a list, a table
    ('<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>The garden</title>'
     "<style>p { color: red; }</style><script>if (a < b) { go(); }</script></head>"
     "<body><h1>The dog sleeps.</h1><ul><li>The cat eats.</li><li>Run <code>ls -l</code> now.</li></ul>"
     '<p translate="no">The dog sleeps.</p><pre>  keep   this  </pre>'
     "<table><tr><td>The bird sings.</td><td><em>The girl</em> reads.</td></tr></table></body></html>\n"),
]
XML = ('<?xml version="1.0" encoding="UTF-8"?>\n<!-- a comment -->\n<doc xmlns:x="urn:x"><title>The cat</title>'
       '<para>The dog <x:term id="t1">sleeps</x:term> under the table.<br/>It is late.</para>'
       '<note translate="no">The dog sleeps.</note><empty/></doc>\n')


def shape(text: str, mime_type: str):
    """The tag structure of a document: each element's name and attributes, comments, and its children's shapes (their
    order aside: a translation may reorder inline elements), ignoring text."""
    if mime_type == "application/xml":
        root = etree.fromstring(text.encode())
    else:
        page = text.lstrip().lower().startswith(("<!doctype", "<html"))
        root = etree.fromstring(text if page else f"<html><body>\n{text}</body></html>", etree.HTMLParser())

    def walk(el):
        if not isinstance(el.tag, str):
            return ("comment", el.text)
        return (el.tag, tuple(sorted(el.attrib.items())), tuple(sorted((walk(c) for c in el), key=repr)))
    return walk(root)


def test_a_document_written_back_unchanged_is_the_document():
    """Parsing and writing back with no translation gives every fixture byte for byte (entities as the characters they
    stand for, &nbsp; as itself), so whatever a translation changes, it is the text of runs alone."""
    for text, mime_type in [(t, "text/html") for t in HTML] + [(XML, "application/xml")]:
        document = markup.parse(text, mime_type, "texts[0]")
        written = document.render([markup.unchanged(run) for run in document.runs])
        assert shape(written, mime_type) == shape(text, mime_type)
        assert written == text.replace("&eacute;", "é").replace("&#169;", "©"), written
    page = markup.parse(HTML[4], "text/html", "texts[0]")
    assert [r.text for r in page.runs if not r.blank] == ["The garden", "The dog sleeps.", "The cat eats.", "Run  now.",
                                                          "The bird sings.", "The girl reads."]


@pytest.mark.parametrize("text, mime_type, message", [
    ("<p>Hello <b>world</p>", "text/html", "texts[0]: malformed HTML at line 1, column 22: Opening and ending tag "
                                           "mismatch: p and b"),
    ("<p>one</p>\n<p>two</i></p>", "text/html", "texts[0]: malformed HTML at line 2, column"),
    ("<a><b></a>", "application/xml", "texts[0]: malformed XML at line 1, column 11: Opening and ending tag mismatch"),
    ("<a>&nbsp;</a>", "application/xml", "texts[0]: malformed XML at line 1, column 10: Entity 'nbsp' not defined"),
    ("<p>a</p>\n<p>b\x1f</p>", "text/html", "texts[0]: character U+001F at line 2, column 5 is not allowed in HTML"),
])
def test_malformed_markup_is_refused_naming_the_line_and_column(text, mime_type, message):
    with pytest.raises(markup.MarkupError) as refused:
        markup.parse(text, mime_type, "texts[0]")
    assert str(refused.value).startswith(message)


def test_inline_tags_go_to_the_target_words_that_attend_to_their_source_words():
    """A hand-made alignment: "The red big apple now." -> "La grosse pomme rouge maintenant.": <b> (red big) goes
    around "grosse pomme rouge" (the words reorder: the hull of the words that attend most to "red" and to "big"), <i>
    (big) around the whole of "grosse", though only its first piece attends most to "big", inside <b>; the <br> before
    "maintenant" (the word after it)."""
    run = markup.parse("<p>The <b>red <i>big</i></b> apple <br>now.</p>", "text/html", "t").runs[0]
    assert run.text == "The red big apple now."
    translation = "La grosse pomme rouge maintenant."
    source = markup.offsets(run.text, ["▁The", "▁red", "▁big", "▁apple", "▁now", ".", "</s>"])
    target = markup.offsets(translation, ["▁La", "▁gros", "se", "▁pomme", "▁rou", "ge", "▁maintenant", "."])
    assert source[-1] == (source[-2][1], source[-2][1])  # the end token holds no characters
    assert [translation[a:b] for a, b in target] == ["La", "gros", "se", "pomme", "rou", "ge", "maintenant", "."]
    aligned = [0, 2, 1, 3, 1, 1, 4, 5]  # each target token's source token: "se" (an agreement) leans to "red" too
    attention = np.eye(len(source))[aligned] * 0.9 + 0.1 / len(source)
    attention[2, 1:3] = [0.5, 0.4]  # but "rou" and "ge" attend to "red" more strongly than "se" does
    placed = markup.placed(run, translation, [markup.Sentence(0, 0, source, target, attention)])
    assert placed == "La <b><i>grosse</i> pomme rouge</b> <br>maintenant."


def test_documents_come_back_with_their_tags_and_translated_text(served):
    """Every fixture through TranslateText on the tiny model: the same tag structure; untranslated parts as written;
    a block without inline tags translated as TranslateText translates its plain text; TranslateTextStream's deltas,
    run by run, join to the same document; malformed markup and return_alignment with markup are INVALID_ARGUMENT
    naming what is wrong."""
    with served.channel() as channel:
        stub = pb_grpc.TranslationServiceStub(channel)
        got = stub.TranslateText(pb.TranslateTextRequest(texts=HTML, mime_type="text/html"), timeout=60).translations
        xml = stub.TranslateText(pb.TranslateTextRequest(texts=[XML], mime_type="application/xml"),
                                 timeout=60).translations[0]
        plain = stub.TranslateText(pb.TranslateTextRequest(texts=["The dog eats. The cat sleeps.", "The bird sings."]),
                                   timeout=60).translations
        for text, t in zip(HTML, got):
            assert shape(t.text, "text/html") == shape(text, "text/html"), t.text
            markup.parse(t.text, "text/html", "output")  # well-formed
        assert shape(xml.text, "application/xml") == shape(XML, "application/xml")
        assert xml.text.startswith('<?xml version="1.0" encoding="UTF-8"?>\n<!-- a comment -->\n<doc xmlns:x="urn:x">')
        assert '<note translate="no">The dog sleeps.</note><empty/></doc>\n' in xml.text
        page = got[4].text
        for kept in ("<style>p { color: red; }</style>", "<script>if (a < b) { go(); }</script>", "<code>ls -l</code>",
                     '<p translate="no">The dog sleeps.</p>', "<pre>  keep   this  </pre>", '<meta charset="utf-8">'):
            assert kept in page
        assert "<h1>The dog sleeps.</h1>" not in page and got[4].sentences == 6
        assert "<!-- inline -->" in got[2].text
        assert f"<td>{plain[1].text}</td>" in page
        for request_, message in (
                (pb.TranslateTextRequest(texts=["ok", "<p>a <b>b</p>"], mime_type="text/html"),
                 "texts[1]: malformed HTML at line 1, column"),
                (pb.TranslateTextRequest(texts=["<p>a</p>"], mime_type="text/html", return_alignment=True),
                 "return_alignment: text/plain only, not text/html"),
                (pb.TranslateTextRequest(texts=["a"], mime_type="application/pdf"),
                 "mime_type 'application/pdf': not supported; send text/plain, text/html, application/xml")):
            with pytest.raises(grpc.RpcError) as refused:
                stub.TranslateText(request_, timeout=30)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert refused.value.details().startswith(message)
        for text, mime_type, whole in [(HTML[4], "text/html", page), (XML, "application/xml", xml.text)]:
            messages = list(stub.TranslateTextStream(pb.TranslateTextStreamRequest(text=text, mime_type=mime_type),
                                                     timeout=60))
            assert "".join(m.delta for m in messages) == whole  # run by run, joined: the whole document
            assert len(messages) == 1 + sum(not run.blank for run in markup.parse(text, mime_type, "t").runs)
            assert not any(m.HasField("alignment") for m in messages)
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.TranslateTextStream(pb.TranslateTextStreamRequest(text="<p>a <b>b</p>", mime_type="text/html"),
                                          timeout=30))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details().startswith("text: malformed HTML at line 1, column")


WORDS = st.sampled_from(["the", "cat", "sleeps", "a", "&amp;", "&lt;", "é", "&nbsp;", " ", "  ", "\n", "dog."])


@st.composite
def fragments(draw, depth: int = 0) -> str:
    """Random well-formed HTML: text, inline and block elements (nested), void elements, comments, untranslated ones."""
    parts = []
    for _ in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from(["text", "text", "inline", "block", "void", "comment", "code"] if depth < 3
                                    else ["text", "void", "comment"]))
        if kind == "text":
            parts.append("".join(draw(st.lists(WORDS, max_size=4))))
        elif kind == "inline":
            tag = draw(st.sampled_from(["b", "i", "a", "span", "em"]))
            parts.append(f'<{tag} title="t &amp; u">{draw(fragments(depth + 1))}</{tag}>')
        elif kind == "block":
            tag = draw(st.sampled_from(["p", "div", "li", "td", "h2"]))
            inner = draw(fragments(depth + 1)) if tag not in ("p", "h2") else draw(fragments(3))
            parts.append(f"<{tag}>{inner}</{tag}>")
        elif kind == "void":
            parts.append(draw(st.sampled_from(["<br>", '<img src="x.png" alt="a b">', "<hr>"])))
        elif kind == "comment":
            parts.append("<!-- c -->")
        else:
            parts.append('<code>x &lt; y</code><span translate="no">keep</span>')
    return "".join(parts)


@settings(max_examples=150, deadline=None)
@given(text=fragments(), seed=st.integers(0, 2 ** 32 - 1))
def test_any_document_comes_back_whole_with_any_alignment(text, seed):
    """Random HTML: written back unchanged it is the same document (every tag, and the text with its entities as
    their characters); with each run replaced by a random "translation" and a random attention between made-up tokens,
    the output parses with the same tag structure."""
    try:
        document = markup.parse(text, "text/html", "t")
    except markup.MarkupError:  # libxml2 refuses some nestings a browser would mend (a block inside <li> in <td>)
        return
    unchanged = document.render([markup.unchanged(run) for run in document.runs])
    assert shape(unchanged, "text/html") == shape(text, "text/html")
    rng = np.random.default_rng(seed)
    outputs = []
    for run in document.runs:
        words = run.text.split()
        translation = " ".join(rng.permutation(words).tolist() + ["mot"] * int(rng.integers(0, 3)))
        source = markup.offsets(run.text, [f"▁{w}" for w in words])
        target = markup.offsets(translation, [f"▁{w}" for w in translation.split()])
        attention = rng.random((len(target), len(source))) if source and target else np.zeros((len(target), 0))
        outputs.append(markup.placed(run, translation, [markup.Sentence(0, 0, source, target, attention)]))
    written = document.render(outputs)
    assert shape(written, "text/html") == shape(text, "text/html"), (text, written)
    markup.parse(written, "text/html", "output")
