"""LibreTranslate's API on the servicer, for the tools self-hosters already point at LibreTranslate: POST /translate
(q as a string or a list of them, source, target, format, alternatives, api_key) and GET /languages. Texts go
through TranslateText (split into sentences, whitespace kept); with alternatives, each q is one sentence of
Translate with that many more hypotheses, of a beam that wide. source "auto" (the default) is detected over all of
q together (server/language_id.py) and answered as LibreTranslate does, in detectedLanguage (confidence in percent;
with q a list, one entry per text, each the call's). format "html" is TranslateText's text/html (server/markup.py:
tags kept, inline ones placed on their words); with alternatives, format text only.
Errors are the servicer's, in LibreTranslate's body ({"error": "…"}, server/http.py)."""

from __future__ import annotations

from nmtserve.server.http_status import invalid
from nmtserve.server.models import ServedModel
from nmtserve.server.service import TranslationServicer
from nmtserve.v1 import translation_pb2 as pb

FORMATS = ("text", "html")


def _field(data: dict, name: str, kind: type, default=None):
    """data[name] as `kind` (a form gives every value as a string), or `default` when absent."""
    value = data.get(name, default)
    if value is None:
        raise invalid(f"{name}: required")
    if kind is int and isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise invalid(f"{name} {value!r}: must be {'a string' if kind is str else 'an integer'}")
    return value


async def translate(servicer: TranslationServicer, data: dict, context) -> dict:
    """LibreTranslate's /translate response for a request body (JSON or form fields)."""
    if not isinstance(data, dict):
        raise invalid("body: a JSON object with q and target")
    q = data.get("q")
    if isinstance(q, str):
        texts = [q]
    elif isinstance(q, list) and q and all(isinstance(t, str) for t in q):
        texts = q
    else:
        raise invalid(f"q {q!r}: must be a string or a non-empty list of strings")
    source, target = _field(data, "source", str, "auto"), _field(data, "target", str)
    form, alternatives = _field(data, "format", str, "text"), _field(data, "alternatives", int, 0)
    if form not in FORMATS:
        raise invalid(f"format {form!r}: must be text or html")
    if alternatives < 0:
        raise invalid(f"alternatives {alternatives}: must be 0 or more")
    if alternatives and form == "html":
        raise invalid("alternatives: sentence by sentence, with format text only")
    if not alternatives:
        response = await servicer.TranslateText(pb.TranslateTextRequest(
            texts=texts, source_language=source, target_language=target,
            mime_type="text/html" if form == "html" else ""), context)
        body = {"translatedText": [t.text for t in response.translations]}
    else:
        options = pb.DecodingOptions(num_hypotheses=alternatives + 1, beam_size=alternatives + 1)
        response = await servicer.Translate(pb.TranslateRequest(sentences=texts, options=options,
                                                                source_language=source, target_language=target), context)
        body = {"translatedText": [t.text for t in response.translations],
                "alternatives": [[a.text for a in t.alternatives] for t in response.translations]}
    if response.HasField("detected_language"):
        found = response.detected_language
        body["detectedLanguage"] = [{"confidence": round(found.confidence * 100, 1), "language": found.language}] * len(texts)
    return body if isinstance(q, list) else {key: value[0] for key, value in body.items()}


def languages(models: dict[str, ServedModel]) -> list[dict]:
    """LibreTranslate's /languages: each source language served, with the languages it is translated into (the
    code stands for the name: the bundles name their languages by code only)."""
    targets: dict[str, set[str]] = {}
    for model in models.values():
        for source in model.source_languages:  # a multilingual model (M2M100, NLLB): each of its languages
            targets.setdefault(source, set()).update(t for t in model.target_languages if t != source)
    return [{"code": code, "name": code, "targets": sorted(found)} for code, found in sorted(targets.items()) if code]
