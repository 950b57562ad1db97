"""Source language identification for source_language "auto": which of the languages the candidate models
translate from a call's text is in, and how sure the detector is.

The detector is py3langid (langid.py's naive Bayes over byte n-grams, its model of 140 languages inside the
wheel, numpy only): nothing is downloaded, a call costs well under a millisecond, and it covers more of NLLB's
languages than lingua (75) in a 4.6 MB wheel rather than 96 MB. Its model is read at the first "auto" call,
not at start: a server that never detects never holds it. The detector scores every language it knows; only
the candidates' scores count, renormalised among them, so a guess is always a language some model serves (a
wrong guess translates from the wrong language; it never fails the call).

Models name languages their own way: OPUS-MT and M2M100 by ISO 639-1 ("en"), NLLB by ISO 639-3 and script
("eng_Latn"). `detector_label` maps either to the detector's label; a code it cannot map takes no part."""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterable

from nmtserve.server.convert import InvalidRequest

AUTO = "auto"
# NLLB's ISO 639-3 codes (the part before the script) to the detector's labels, where it knows the language;
# macrolanguages' members (Arabic's, Persian's) share their macrolanguage's label
_ISO639_3 = {
    "ace": "ace", "acm": "ar", "acq": "ar", "aeb": "ar", "afr": "af", "ajp": "ar", "als": "sq", "amh": "am",
    "apc": "ar", "arb": "ar", "ars": "ar", "ary": "ary", "arz": "arz", "asm": "as", "azj": "az", "bak": "ba",
    "bel": "be", "ben": "bn", "bos": "bs", "bul": "bg", "cat": "ca", "ces": "cs", "crh": "crh", "cym": "cy",
    "dan": "da", "deu": "de", "dzo": "dz", "ell": "el", "eng": "en", "epo": "eo", "est": "et", "eus": "eu",
    "fao": "fo", "fin": "fi", "fra": "fr", "fuv": "fuv", "gaz": "om", "gla": "gd", "gle": "ga", "glg": "gl",
    "grn": "gug", "guj": "gu", "hat": "ht", "hau": "ha", "heb": "he", "hin": "hi", "hrv": "hr", "hun": "hu",
    "hye": "hy", "ibo": "ig", "ind": "id", "isl": "is", "ita": "it", "jav": "jv", "jpn": "ja", "kab": "kab",
    "kan": "kn", "kat": "ka", "kaz": "kk", "khk": "mn", "khm": "km", "kik": "kik", "kin": "rw", "kir": "ky",
    "kmr": "ku", "kor": "ko", "lao": "lo", "lij": "lij", "lin": "ln", "lit": "lt", "ltg": "ltg", "ltz": "lb",
    "lug": "lg", "lvs": "lv", "mal": "ml", "mar": "mr", "mkd": "mk", "mlt": "mt", "mya": "my", "nld": "nl",
    "nno": "nn", "nob": "no", "npi": "ne", "nso": "nso", "oci": "oc", "ory": "or", "pan": "pa", "pbt": "ps",
    "pes": "fa", "plt": "mg", "pol": "pl", "por": "pt", "prs": "fa", "quy": "qu", "ron": "ro", "rus": "ru",
    "san": "sa", "sin": "si", "slk": "sk", "slv": "sl", "sna": "sn", "som": "so", "sot": "st", "spa": "es",
    "srp": "sr", "swe": "sv", "swh": "sw", "tam": "ta", "tat": "tt", "tel": "te", "tgk": "tg", "tgl": "tl",
    "tha": "th", "tuk": "tk", "tur": "tr", "uig": "ug", "ukr": "uk", "urd": "ur", "uzn": "uz", "vec": "vec",
    "vie": "vi", "xho": "xh", "yor": "yo", "yue": "yue", "zho": "zh", "zsm": "ms", "zul": "zu",
}
# M2M100's codes that are not the detector's labels
_M2M100 = {"ns": "nso"}
# where several of a model's codes share a label, the one a detection picks: the standard variety
_PREFERRED = ("arb_Arab", "pes_Arab", "zho_Hans")


def detector_label(code: str) -> str | None:
    """The detector's label of a model's language code, or None where it does not know the language."""
    if "_" in code:  # NLLB's xxx_Yyyy
        return _ISO639_3.get(code.split("_")[0])
    return _M2M100.get(code, code if code in _labels() else None)


@functools.cache
def _labels() -> frozenset[str]:
    return frozenset(_identifier().labels)


_lock = threading.Lock()
_loaded: list = []


def _identifier():
    """py3langid's identifier, read once (the first "auto" call pays for it)."""
    with _lock:
        if not _loaded:
            from py3langid.langid import MODEL_FILE, LanguageIdentifier

            _loaded.append(LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True))
        return _loaded[0]


def detect(texts: Iterable[str], candidates: Iterable[str]) -> tuple[str, float]:
    """(code, confidence): which of the candidate codes the texts, read together, are in, and its probability
    among them. InvalidRequest when the detector knows none of the candidates."""
    candidates = list(dict.fromkeys(candidates))
    by_label: dict[str, str] = {}
    for code in sorted(candidates, key=lambda c: c not in _PREFERRED):
        label = detector_label(code)
        if label is not None:
            by_label.setdefault(label, code)
    if not by_label:
        raise InvalidRequest(f"source_language {AUTO!r}: the language identifier knows none of the languages "
                             f"that could be translated here ({', '.join(candidates[:8]) or 'none named'}); "
                             "name source_language")
    scores = dict(_identifier().rank("\n".join(texts)))
    total = sum(scores[label] for label in by_label)
    label = max(by_label, key=lambda lab: scores[lab])
    return by_label[label], (scores[label] / total if total > 0 else 1.0 / len(by_label))
