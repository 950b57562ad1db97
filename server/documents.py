"""Whole texts to sentences and back (an HTML or XML document's runs as texts: server/markup.py): paragraphs split on newlines, sentences found by sentencex
(Wikimedia's segmenter: abbreviation lists for many languages, and it prefers not splitting to a
wrong split), a sentence still over a limit split again at whitespace, and the translations joined
with the source's exact whitespace and line breaks between them. Offsets are in Unicode code points.

    spans = sentence_spans("Dr. Smith came.  He left.\\n\\nBye.", "en")    # [(0, 15), (17, 25), (27, 31)]
    text, alignment = rejoin(source, spans, translations)

Why sentencex (README, "Documents"): of sentencex, pysbd and sentence-splitter on hand-made English,
French and German cases with abbreviations, numbers and ordinals it split as many or more correctly,
is MIT-licensed with no dependencies, and segments megabytes per second where pysbd managed kilobytes.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import sentencex

from nmtserve.server import markup

MIME_TYPES = ("text/plain",)
# split an over-long sentence after one of these first (then at any whitespace), nearest its middle
CLAUSE_END = re.compile(r"[,;:]\s+")
WHITESPACE = re.compile(r"\s+")


def sentence_spans(text: str, language: str) -> list[tuple[int, int]]:
    """(start, end) of each sentence, whitespace excluded, in order; paragraphs are the lines."""
    spans = []
    for line in re.finditer(r"[^\n]+", text):
        for boundary in sentencex.get_sentence_boundaries(language or "en", line.group()):
            segment = boundary["text"]
            core = segment.strip()
            if core:
                start = line.start() + boundary["start_index"] + len(segment) - len(segment.lstrip())
                spans.append((start, start + len(core)))
    return spans


def fit(text: str, span: tuple[int, int], too_long: Callable[[str], bool]) -> list[tuple[int, int]]:
    """The span, or pieces of it that are not too long: split after a clause's punctuation, else at
    whitespace, nearest the middle, else (one long word) at the middle."""
    start, end = span
    if end - start < 2 or not too_long(text[start:end]):
        return [span]
    piece, middle = text[start:end], (start + end) / 2
    cuts = [(start + m.start() + 1, start + m.end()) for m in CLAUSE_END.finditer(piece)]
    cuts = cuts or [(start + m.start(), start + m.end()) for m in WHITESPACE.finditer(piece)]
    left_end, right_start = min(cuts, key=lambda cut: abs(cut[0] - middle)) if cuts else (round(middle),) * 2
    return fit(text, (start, left_end), too_long) + fit(text, (right_start, end), too_long)


def rejoin(text: str, spans: list[tuple[int, int]], translations: list[str]) -> tuple[str, list[tuple[int, ...]]]:
    """The source with each span replaced by its translation, everything between spans kept as it is;
    and per span (source_start, source_end, target_start, target_end)."""
    out, alignment, position, length = [], [], 0, 0
    for (start, end), translation in zip(spans, translations, strict=True):
        out.append(text[position:start])
        length += start - position
        out.append(translation)
        alignment.append((start, end, length, length + len(translation)))
        length += len(translation)
        position = end
    out.append(text[position:])
    return "".join(out), alignment


def piece_text(tokenizer, text: str, span: tuple[int, int], pair) -> str:
    """A span's translation: its engine request's tokens as text, or the span as it is where it had none."""
    return tokenizer.decode(pair[0].tokens) if pair else text[span[0]:span[1]]


@dataclass
class TextJob:
    """One text of a TranslateText call: its HTML or XML document (None: plain text) and its units (the text, or the
    document's runs that hold text), each (the unit's text, its sentences' spans, per span its (engine request,
    future) or None where the span is kept as it is)."""
    document: markup.Document | None
    units: list[tuple[str, list[tuple[int, int]], list]]

    def submitted(self) -> list[tuple]:
        """Every (engine request, future) of the text's units, in order."""
        return [pair for _, _, pairs in self.units for pair in pairs if pair]

    def written(self, tokenizer) -> tuple[str, list[tuple[int, ...]]]:
        """The translated text: its sentences rejoined around the source's whitespace, with their alignment; or the
        document written back with each run translated and its inline tags placed (no alignment)."""
        if self.document is None:
            [(text, spans, pairs)] = self.units
            return rejoin(text, spans, [piece_text(tokenizer, text, span, pair) for span, pair in zip(spans, pairs)])
        units = iter(self.units)
        return self.document.render([markup.unchanged(run) if run.blank else self.run_written(tokenizer, run, next(units))
                                     for run in self.document.runs]), []

    @staticmethod
    def run_written(tokenizer, run: markup.Run, unit: tuple) -> str:
        """A run's translation as markup: its sentences rejoined, its inline tags placed by the attention."""
        source, spans, pairs = unit
        text, alignment = rejoin(source, spans, [piece_text(tokenizer, source, span, pair)
                                                 for span, pair in zip(spans, pairs)])
        if not run.inlines:  # asked for no attention: nothing to place
            return markup.escape(text, run.xml)
        return markup.placed(run, text, [_sentence(tokenizer.piece, run, text, a, pair)
                                         for a, pair in zip(alignment, pairs) if pair])


def _sentence(piece, run: markup.Run, text: str, alignment: tuple[int, ...], pair) -> markup.Sentence:
    """A translated sentence of a run as inline tags' placement reads it (`piece`: the tokenizer's id -> piece)."""
    request = pair[0]
    source_start, _, target_start, _ = alignment
    return markup.Sentence(source_start, target_start,
                           markup.offsets(run.text, [piece(i) for i in request.src_ids], source_start),
                           markup.offsets(text, [piece(i) for i in request.tokens], target_start),
                           request.results()[0].shown_attention(0))
