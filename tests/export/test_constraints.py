"""Glossaries (nmtserve/glossary.py) and the constrained beam search that honours them (search.ConstrainedBeamSearch),
offline on the tiny model: every translation contains its sentence's target terms, alone or in a batch."""

import pytest

from nmtserve.decoding import DecodingOptions
from nmtserve.errors import ConfigError
from nmtserve.export.runtime.translator import OnnxTranslator
from nmtserve.glossary import MAX_ENTRIES, Glossary
from nmtserve.search import constrained_beam
from nmtserve.training.data import read_tsv
from nmtserve.training.lexicon import NOUNS


def _contains(tokens: list[int], part: tuple[int, ...]) -> bool:
    return any(tuple(tokens[i:i + len(part)]) == part for i in range(len(tokens) - len(part) + 1))


def test_a_glossary_matches_whole_words_whatever_their_case_and_refuses_what_is_ambiguous():
    glossary = Glossary([("cat", "félin"), ("ice cream", "glace"), ("New York", "Big Apple")])
    assert glossary.targets_for("The Cat eats ICE  cream in new york.") == ["félin", "glace", "Big Apple"]
    assert glossary.targets_for("The cats eat a catfish and icecream.") == []
    refused = {
        "glossary[1]: source ' ' and target 'x' must both be non-empty": [("a", "b"), (" ", "x")],
        "glossary[1]: source term 'Cat' is also glossary[0]'s": [("cat", "chat"), ("Cat", "félin")],
        "glossary[1]: source term 'York' overlaps glossary[0]'s 'New York', which contains it": [("New York", "NY"),
                                                                                            ("York", "Y")],
        f"glossary: {MAX_ENTRIES + 1} entries; at most {MAX_ENTRIES}": [(f"w{i}", "x") for i in range(MAX_ENTRIES + 1)],
    }
    for message, entries in refused.items():
        with pytest.raises(ConfigError) as e:
            Glossary(entries)
        assert str(e.value) == message


def test_constrained_beam_search_puts_every_term_in_every_translation_alone_or_in_a_batch(tiny_bundle, tiny_corpus):
    """The corpus's nouns as a glossary (each to its French): each test sentence with nouns gets their target terms,
    whose tokens its best hypothesis contains (the tiny model says none of them unconstrained); the same alone as
    in a batch of 40 beside sentences without terms, and beam 4 widened for a sentence of more term tokens."""
    tr = OnnxTranslator(tiny_bundle)
    glossary = Glossary([(n.en, n.fr) for n in NOUNS if "_" not in n.en])
    texts = [s for s, _ in read_tsv(tiny_corpus / "test.tsv").pairs]
    constraints = [glossary.constraints_for(t, tr.tokenizer.encode_target) for t in texts]
    with_terms = [i for i, c in enumerate(constraints) if c]
    assert len(with_terms) >= 20 and any(sum(map(len, c)) >= 4 for c in constraints)
    free = tr.translate_batch(texts, beam_size=4)
    batch = tr.translate_batch(texts, beam_size=4, glossary=glossary)
    alone = [tr.translate_batch([t], beam_size=4, glossary=glossary)[0] for t in texts]
    assert [t.tokens for t in batch] == [t.tokens for t in alone]
    for i in with_terms:
        assert all(_contains(batch[i].tokens, c) for c in constraints[i]), (texts[i], batch[i].text)
        assert not all(_contains(free[i].tokens, c) for c in constraints[i])
    assert [batch[i].tokens for i in range(len(texts)) if i not in with_terms] == \
        [free[i].tokens for i in range(len(texts)) if i not in with_terms]
    wide = constrained_beam(DecodingOptions(beam_size=4), ((5, 6, 7), (8, 9)))
    assert wide.beam_size == 6 and wide.constraints == ((5, 6, 7), (8, 9)) and not wide.greedy
    assert constrained_beam(DecodingOptions(), ()) == DecodingOptions()
