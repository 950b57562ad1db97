"""The lexicon is large enough and every entry is one pyrealb can inflect as recorded."""

import json
from pathlib import Path

import pyrealb
import pytest

from nmtserve.training import lexicon as lx

LEX_DIR = Path(pyrealb.__file__).parent / "data"


@pytest.fixture(scope="module")
def pyrealb_lexicons():
    return (json.loads((LEX_DIR / "lexicon-en.json").read_text()), json.loads((LEX_DIR / "lexicon-fr.json").read_text()))


def test_at_least_400_lemma_pairs_in_every_category():
    assert lx.lemma_pair_count() >= 400
    for table in (lx.NOUNS, lx.ADJECTIVES, lx.TRANSITIVE_VERBS, lx.INTRANSITIVE_VERBS, lx.ADVERBS, lx.PREPOSITIONS,
                  lx.PRONOUNS, lx.DETERMINERS, lx.POSSESSIVES, lx.NUMBERS):
        assert table, "a category of the lexicon is empty"
    assert {n.gender for n in lx.NOUNS} == {"m", "f"}
    assert {a.position for a in lx.ADJECTIVES} == {"pre", "post"}


def test_every_entry_is_in_pyrealbs_lexicons(pyrealb_lexicons):
    en, fr = pyrealb_lexicons
    problems = []
    for cat, table in (("N", lx.NOUNS), ("A", lx.ADJECTIVES), ("V", lx.TRANSITIVE_VERBS + lx.INTRANSITIVE_VERBS),
                       ("Adv", lx.ADVERBS), ("P", lx.PREPOSITIONS), ("D", lx.DETERMINERS), ("C", lx.COORDINATIONS)):
        for entry in table:
            for lang, lex in (("en", en), ("fr", fr)):
                word = getattr(entry, lang)
                if cat not in lex.get(word, {}):
                    problems.append(f"{lang} {cat} {word!r}")
    assert problems == []


def test_genders_and_adjective_positions_agree_with_pyrealb(pyrealb_lexicons):
    _, fr = pyrealb_lexicons
    wrong = [n.fr for n in lx.NOUNS if fr[n.fr]["N"]["g"] not in (n.gender, "x")]
    wrong += [a.fr for a in lx.ADJECTIVES if (fr[a.fr]["A"].get("pos") == "pre") != (a.position == "pre")]
    assert wrong == []
