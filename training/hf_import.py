"""Import a local Hugging Face model folder as an nmtserve checkpoint, its family read from config.json's model_type:
Marian (every OPUS-MT variant: training/marian.py) or M2M100 and NLLB (training/m2m100.py).

    nmtserve import ~/models/opus-mt-tc-big-en-de --out runs/en-de.pt
"""

from __future__ import annotations

import json
from pathlib import Path

from nmtserve.training.m2m100 import import_m2m100
from nmtserve.training.marian import ImportRefused, import_marian

IMPORTERS = {"marian": import_marian, "m2m_100": import_m2m100}
SUPPORTED = "marian (OPUS-MT), m2m_100 (M2M100, NLLB)"


def family_of(directory: Path) -> str:
    """config.json's model_type, or ImportRefused saying what was found and what is supported."""
    config = Path(directory) / "config.json"
    if not config.is_file():
        raise ImportRefused(f"{directory}: no config.json, not a Hugging Face model folder; supported model types: "
                            f"{SUPPORTED}")
    try:
        model_type = json.loads(config.read_text(encoding="utf-8")).get("model_type")
    except (ValueError, UnicodeDecodeError, AttributeError) as e:
        raise ImportRefused(f"{config}: not a JSON object ({e})") from None
    if model_type not in IMPORTERS:
        raise ImportRefused(f"{config}: model_type {json.dumps(model_type)}: not supported; supported: {SUPPORTED}")
    return model_type


def import_model(directory: str | Path, out: str | Path, source_lang: str = "", target_lang: str = "") -> dict:
    """Write the checkpoint `out` from the folder; returns a summary of what was imported."""
    return IMPORTERS[family_of(Path(directory))](directory, out, source_lang, target_lang)
