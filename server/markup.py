"""HTML and XML for TranslateText: a document's text cut into runs that are translated as units, and the document
written back with each run's translation, its inline tags placed on the words they were on through the model's
cross-attention (return_attention). Knows nothing of gRPC or of the engine.

    document = parse("<p>The <b>red</b> apple.</p>", "text/html", "texts[0]")
    [run] = document.runs                       # Run(text="The red apple.", ...), <b> on characters 4..7
    document.render([placed(run, translated)])  # "<p>La pomme <b>rouge</b>.</p>"

What is translated: the text of block elements (p, li, h1, td, title, …; in XML every element whose parent holds no
text of its own), inline elements (b, a, span, …; in XML elements inside text) and their text joining the run they
are in. Left as written: tags, attributes, comments and processing instructions, script, style, code, pre, and any
element marked translate="no" (inside a run such an element keeps its place by alignment, like a <br>, and its text
is not part of the sentence). Entities come back as the characters they stand for, with &, < and > escaped.

Why lxml: one tree API over HTML (libxml2's parser) and XML, errors with their line and column (so a malformed
document is refused naming the position), and C speed; html5lib is pure Python and reports no positions, and
selectolax parses no XML.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass, field

import numpy as np
from lxml import etree

MIME_TYPES = ("text/html", "application/xml")
# elements whose content joins the run around them (HTML's phrasing content that holds text)
INLINE = frozenset("a abbr b bdi bdo br cite data dfn em font i img ins del kbd mark q rp rt ruby s samp small span "
                   "strong sub sup time u var wbr".split())
OPAQUE = frozenset("script style code pre textarea svg math".split())  # written back as they are
VOID = frozenset("area base br col embed hr img input link meta param source track wbr".split())
FORBIDDEN = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")
PROLOG = re.compile(r"\s*(?:(?:<\?.*?\?>|<!--.*?-->|<!DOCTYPE[^>]*>)\s*)*", re.S | re.I)
# libxml2's HTML parser knows HTML 4 only: its complaints about the names of newer elements are no error
UNKNOWN_TAG = "invalid"


class MarkupError(ValueError):
    """The document is not well-formed; the message names the line and column."""


@dataclass
class Inline:
    """An element inside a run: its tags, the characters of the run's text it holds ([start, end); void elements and
    untranslated ones hold none) and the inline elements inside it."""
    open: str
    close: str
    start: int
    end: int
    children: list[Inline] = field(default_factory=list)


@dataclass
class Run:
    """Text translated as one unit (a block's text between its child blocks), with the inline elements in it."""
    text: str
    inlines: list[Inline]
    xml: bool = False

    @property
    def blank(self) -> bool:
        return not self.text.strip()


class Document:
    """A parsed document as pieces of output: strings written as they are, and runs (`runs`, in order) that
    `render` replaces by their translations."""

    def __init__(self, pieces: list[str | Run], xml: bool):
        self.pieces, self.xml = pieces, xml

    @property
    def runs(self) -> list[Run]:
        return [p for p in self.pieces if isinstance(p, Run)]

    def render(self, translations: list[str]) -> str:
        """The document with each run (in order) replaced by its translation's markup (`placed`)."""
        given = iter(translations)
        out = "".join(p if isinstance(p, str) else next(given) for p in self.pieces)
        if next(given, None) is not None:
            raise ValueError("more translations than runs")
        return out


def parse(text: str, mime_type: str, name: str) -> Document:
    """The document in `text` (an HTML fragment or page, or an XML document) -> its pieces; MarkupError naming
    `name`, the line and the column of the first error."""
    xml = mime_type == "application/xml"
    bad = FORBIDDEN.search(text)  # characters XML 1.0 does not allow (libxml2 refuses them in HTML too)
    if bad:
        line = text.count("\n", 0, bad.start()) + 1
        column = bad.start() - (text.rfind("\n", 0, bad.start()) + 1) + 1
        raise MarkupError(f"{name}: character U+{ord(bad.group()):04X} at line {line}, column {column} is not allowed in "
                          f"{'XML' if xml else 'HTML'}")
    if xml:
        try:
            root = etree.fromstring(text.encode("utf-8"), etree.XMLParser(resolve_entities=False, no_network=True))
        except etree.XMLSyntaxError as e:
            line, column = e.position
            raise MarkupError(f"{name}: malformed XML at line {line}, column {column}: {e.msg}") from None
        writer = _Writer(xml=True)
        writer.pieces.append(PROLOG.match(text).group())  # the declaration, doctype and comments before the root
        writer.element(root)
        writer.pieces.append(_epilogue(text, writer._tags(root)[1]))
        return Document(writer.pieces, True)
    page = text.lstrip().lower().startswith(("<!doctype", "<html>", "<html "))
    # a fragment goes in a body of its own, from a line of its own: libxml2's columns on a document's first line are
    # not where the error is, and every element of the fragment, <title> included, stays in that body
    wrapped = text if page else f"<html><body>\n{text}</body></html>"
    parser = etree.HTMLParser(recover=True, remove_comments=False, remove_pis=False)
    root = etree.fromstring(wrapped, parser)
    errors = [e for e in parser.error_log if e.level >= etree.ErrorLevels.ERROR and UNKNOWN_TAG not in e.message]
    if errors:
        line, column, message = errors[0].line - (not page), errors[0].column, errors[0].message.strip()
        raise MarkupError(f"{name}: malformed HTML at line {line}, column {column}: {message}")
    writer = _Writer(xml=False)
    if page:
        doctype = PROLOG.match(text).group()
        writer.pieces.append(doctype)
        writer.element(root)
        writer.pieces.append(_epilogue(text, "</html>"))
    else:
        body = root.find("body")
        body.text = body.text[1:]  # the wrapper's line break
        writer.content(body)
    return Document(writer.pieces, False)


class _Writer:
    """Walks the tree once, writing tags and untranslated parts as strings and collecting each run."""

    def __init__(self, xml: bool):
        self.xml, self.pieces = xml, []
        self.method = "xml" if xml else "html"

    def element(self, el) -> None:
        if not isinstance(el.tag, str) or self._opaque(el):  # comments, processing instructions, untranslated
            self.pieces.append(self._whole(el))
            return
        if self.xml and not len(el) and el.text is None:  # <empty/> stays as it was written
            self.pieces.append(self._whole(el))
            return
        start, end = self._tags(el)
        self.pieces.append(start)
        self.content(el)
        self.pieces.append(end)

    def content(self, el) -> None:
        """An element's text and children: runs between its block children."""
        run = _RunBuilder(self)
        run.text(el.text)
        for child in el:
            if self._inline(child, el):
                run.inline(child)
            else:
                self._flush(run)
                self.element(child)
                run = _RunBuilder(self)
            run.text(child.tail)
        self._flush(run)

    def _flush(self, run: _RunBuilder) -> None:
        if run.chars or run.inlines:
            self.pieces.append(Run("".join(run.chars), run.inlines, self.xml))

    def _inline(self, el, parent) -> bool:
        if not isinstance(el.tag, str):  # a comment inside text stays where it is in the run
            return _has_text(parent)
        if self.xml:
            return _has_text(parent)
        return el.tag in INLINE or el.tag in OPAQUE and _has_text(parent)

    def _opaque(self, el) -> bool:
        return (not self.xml and el.tag in OPAQUE) or el.get("translate") == "no"

    def _whole(self, el) -> str:
        """An element (or comment) with everything in it, as written; in XML without the namespace declarations of its
        ancestors (lxml's tostring repeats them on a subtree)."""
        if not self.xml or not isinstance(el.tag, str):
            return etree.tostring(el, method=self.method, encoding="unicode", with_tail=False)
        start, end = self._tags(el)
        if not len(el) and el.text is None:
            return start[:-1] + "/>"
        return start + escape(el.text or "", True) + "".join(self._whole(c) + escape(c.tail or "", True) for c in el) + end

    def _tags(self, el) -> tuple[str, str]:
        """An element's start and end tags as written (HTML's void elements: no end tag)."""
        attributes = "".join(f' {_qualified(el, name)}="{html.escape(value)}"' for name, value in el.attrib.items())
        if self.xml:  # with the namespaces it declares (those its parent does not have)
            parent = el.getparent()
            inherited = parent.nsmap if parent is not None else {}
            declared = "".join(f' xmlns{":" + prefix if prefix else ""}="{html.escape(uri)}"'
                               for prefix, uri in el.nsmap.items() if inherited.get(prefix) != uri)
            name = _qualified(el, el.tag)
            return f"<{name}{declared}{attributes}>", f"</{name}>"
        return f"<{el.tag}{attributes}>", "" if el.tag in VOID else f"</{el.tag}>"


class _RunBuilder:
    def __init__(self, writer: _Writer):
        self.writer, self.chars, self.inlines, self.length = writer, [], [], 0

    def text(self, text: str | None) -> None:
        if text:
            self.chars.append(text)
            self.length += len(text)

    def inline(self, el, into: list[Inline] | None = None) -> None:
        into = self.inlines if into is None else into
        w = self.writer
        empty = el.tag in VOID if not w.xml else not len(el) and el.text is None
        if not isinstance(el.tag, str) or w._opaque(el) or empty:  # held in place, holding no text
            into.append(Inline(w._whole(el), "", self.length, self.length))
            return
        start_tag, end_tag = w._tags(el)
        node = Inline(start_tag, end_tag, self.length, self.length)
        self.text(el.text)
        for child in el:
            self.inline(child, node.children)
            self.text(child.tail)
        node.end = self.length
        into.append(node)


def _qualified(el, name: str) -> str:
    """An element's or attribute's name as written: prefix:local for a name in a namespace."""
    q = etree.QName(name)
    if q.namespace is None:
        return q.localname
    if q.namespace == "http://www.w3.org/XML/1998/namespace":
        return "xml:" + q.localname
    if name == el.tag:
        prefix = el.prefix
    else:  # an attribute in a namespace has a prefix
        prefix = next((p for p, uri in el.nsmap.items() if uri == q.namespace and p), None)
    return f"{prefix}:{q.localname}" if prefix else q.localname


def _epilogue(text: str, end_tag: str) -> str:
    """What follows the root's end tag (comments, whitespace), as written."""
    at = text.lower().rfind(end_tag.lower())
    return text[at + len(end_tag):] if at >= 0 else text[len(text.rstrip()):]


def _has_text(el) -> bool:
    return bool((el.text or "").strip()) or any((c.tail or "").strip() for c in el)


def escape(text: str, xml: bool) -> str:
    """Text as markup: &, < and > escaped, and in HTML a no-break space as &nbsp; (which it most often was)."""
    text = html.escape(text, quote=False)
    return text if xml else text.replace("\xa0", "&nbsp;")


@dataclass
class Sentence:
    """One translated sentence of a run, as placement needs it: where it is in the run's text and in the run's
    translation, each token's characters in them, and the attention between the tokens."""
    source_start: int
    target_start: int
    source_offsets: list[tuple[int, int]]  # each source token's characters in the run's text
    target_offsets: list[tuple[int, int]]  # each target token's characters in the run's translation
    attention: np.ndarray  # (target tokens, source tokens)


def offsets(text: str, pieces: list[str], start: int = 0) -> list[tuple[int, int]]:
    """Each SentencePiece piece's characters in `text` (from `start`), whitespace and the word mark ▁ skipped: a piece
    that does not match the text there (an end or language token, a character the tokenizer normalised) holds none."""
    found, position = [], start
    for piece in pieces:
        first = end = None
        at = position
        for char in piece.replace("▁", ""):
            while at < len(text) and text[at].isspace():
                at += 1
            if at >= len(text) or text[at] != char:
                break
            first = at if first is None else first
            at += 1
            end = at
        if end is None:
            found.append((position, position))
        else:
            found.append((first, end))
            position = end
    return found


def placed(run: Run, translation: str, sentences: list[Sentence]) -> str:
    """The run's translation (plain text) as markup: each inline element around the words of the target tokens that
    attend most to each source token it held (each source token's strongest target token: a French article that
    attends to its noun as well stays out of the noun's tag), else of every target token whose strongest source token
    it held; its ends moved out of any word they would cut. A void or untranslated element goes before the target
    token that attends most to the source token after it. Nested as in the source: a child inside its parent's place,
    siblings apart."""
    source, target, strongest = [], [], {}  # every sentence's tokens: (characters); (characters, source token aligned)
    for s in sentences:
        base, first = len(source), len(target)
        source += s.source_offsets
        best = s.attention.argmax(axis=1) if s.attention.size else np.zeros(len(s.target_offsets), int)
        target += [(offset, base + int(j)) for offset, j in zip(s.target_offsets, best)]
        if s.attention.size:
            strongest.update({base + j: first + int(t) for j, t in enumerate(s.attention.argmax(axis=0))})

    def hugging(a: int, b: int, whole: bool) -> tuple[int, int]:  # no word cut, no space inside the tags' ends
        if whole:  # the words the tokens are in, hyphenated compounds whole
            a, b = word(a)[0], word(b)[1]
        else:  # each end to its word's nearer end
            a, b = (min(word(p), key=lambda end: abs(end - p)) for p in (a, b))
        while a < b and translation[a].isspace():
            a += 1
        while b > a and translation[b - 1].isspace():
            b -= 1
        return a, b

    def place(node: Inline, low: int, high: int) -> tuple[int, int]:
        held = {i for i, (a, b) in enumerate(source) if b > a and a < node.end and b > node.start}
        for whole, chosen in ((True, [target[strongest[i]][0] for i in held if i in strongest]),
                              (False, [(a, b) for (a, b), j in target if j in held])):
            chosen = [(a, b) for a, b in chosen if b > a]
            if chosen:
                a, b = hugging(min(a for a, _ in chosen), max(b for _, b in chosen), whole)
                if b > a:
                    return max(low, min(a, high)), max(low, min(b, high))
        # held nothing, or nothing attends to what it held: before the target token of the source token after it,
        # else after that of the source token before it
        after = [i for i, (a, b) in enumerate(source) if b > a and a >= node.end]
        starts = [a for (a, b), j in target if after and j == after[0] and b > a]
        before = [i for i, (a, b) in enumerate(source) if b > a and b <= node.start]
        ends = [b for (a, b), j in target if before and j == before[-1] and b > a]
        point = min(starts) if starts else max(ends) if ends else high if before else low
        point = max(low, min(point, high))
        return point, point

    def inside(p: int) -> bool:  # a letter or digit, or a hyphen between two
        c = translation[p]
        return c.isalnum() or c == "-" and 0 < p < len(translation) - 1 and translation[p - 1].isalnum() \
            and translation[p + 1].isalnum()

    def word(p: int) -> tuple[int, int]:  # the word that position p cuts, or (p, p)
        if not (0 < p < len(translation) and inside(p - 1) and inside(p)):
            return p, p
        start, end = p, p
        while start > 0 and inside(start - 1):
            start -= 1
        while end < len(translation) and inside(end):
            end += 1
        return start, end

    def render(nodes: list[Inline], low: int, high: int) -> str:
        spots = []
        for node in nodes:
            a, b = place(node, low, high)
            spots.append((a, b, node))
        spots.sort(key=lambda s: (s[0], s[1]))
        out, position = [], low
        for a, b, node in spots:
            a, b = max(a, position), max(b, position)
            out.append(escape(translation[position:a], run.xml))
            out.append(node.open + render(node.children, a, b) + node.close)
            position = b
        out.append(escape(translation[position:high], run.xml))
        return "".join(out)

    return render(run.inlines, 0, len(translation))


def unchanged(run: Run) -> str:
    """A run as it was written (nothing to translate in it)."""
    def render(nodes: list[Inline], low: int, high: int) -> str:
        out, position = [], low
        for node in nodes:
            out.append(escape(run.text[position:node.start], run.xml) + node.open + render(node.children, node.start, node.end)
                       + node.close)
            position = node.end
        return "".join(out) + escape(run.text[position:high], run.xml)
    return render(run.inlines, 0, len(run.text))
