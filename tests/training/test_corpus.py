"""The built-in corpus: determinism, disjoint splits, the novel split, clean realisations."""

import hashlib
import random

from nmtserve.training import lexicon as lx
from nmtserve.training.corpus import (
    Clause,
    NounPhrase,
    generate_chunk,
    generate_corpus,
    is_novel_triple,
    realise_pair,
    sample_clause,
)
from tests.helpers import run_cli


def _digest(directory):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def _pairs(path):
    return [tuple(line.split("\t")) for line in path.read_text(encoding="utf-8").splitlines()]


def test_same_seed_gives_byte_identical_files_whatever_the_workers(tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    generate_corpus(a, 300, seed=5, valid=30, test=30, novel=10, workers=1)
    generate_corpus(b, 300, seed=5, valid=30, test=30, novel=10, workers=2)
    generate_corpus(c, 300, seed=6, valid=30, test=30, novel=10, workers=2)
    assert _digest(a) == _digest(b)
    assert _digest(a)["train.tsv"] != _digest(c)["train.tsv"]


def test_splits_are_disjoint_and_novel_triples_never_in_train(tiny_corpus):
    splits = {s: _pairs(tiny_corpus / f"{s}.tsv") for s in ("train", "valid", "test", "novel")}
    assert [len(splits[s]) for s in ("train", "valid", "test", "novel")] == [400, 40, 40, 20]
    train_sources = {src for src, _ in splits["train"]}
    for split in ("valid", "test", "novel"):
        assert not train_sources & {src for src, _ in splits[split]}, split
    # regenerate the candidates to recover each sentence's (subject, verb, object) triple
    wanted = {src for pairs in splits.values() for src, _ in pairs}
    triple_of, index = {}, 0
    while not wanted <= triple_of.keys() and index < 8:
        for en, _fr, triple in generate_chunk((7, index, 1000))[0]:
            triple_of.setdefault(en, triple)
        index += 1
    train_triples = {triple_of[src] for src, _ in splits["train"]}
    novel_triples = {triple_of[src] for src, _ in splits["novel"]}
    assert all(is_novel_triple(t) for t in novel_triples)
    assert not train_triples & novel_triples


def test_french_morphology_of_known_structures():
    cat, apple = lx.NOUNS[0], next(n for n in lx.NOUNS if n.en == "apple")
    red = next(a for a in lx.ADJECTIVES if a.en == "red")
    old = next(a for a in lx.ADJECTIVES if a.en == "old")
    eat = next(v for v in lx.TRANSITIVE_VERBS if v.en == "eat")
    the = next(d for d in lx.DETERMINERS if d.en == "the")
    clause = Clause(subject=NounPhrase(cat, True, the), verb=eat, obj=NounPhrase(apple, False, the, red),
                    tense="past", negative=True)
    assert realise_pair(clause) == ("The cats did not eat the red apple.", "Les chats n'ont pas mangé la pomme rouge.")
    clause = Clause(subject=NounPhrase(cat, False, the, old), verb=eat, obj=NounPhrase(apple, True, the),
                    tense="future", question=True)
    assert realise_pair(clause) == ("Will the old cat eat the apples?", "Le vieux chat mangera-t-il les pommes?")


def test_an_unrealisable_pair_is_dropped_not_written():
    unknown = lx.Pair("glorbify", "glorbifier")
    clause = sample_clause(random.Random(0))
    clause.verb, clause.obj, clause.attribute = unknown, None, None
    assert realise_pair(clause) is None


def test_generation_counts_what_it_drops(tmp_path):
    stats = generate_corpus(tmp_path, 200, seed=2, valid=10, test=10, novel=5, workers=1)
    assert stats.candidates == (stats.dropped_unrealisable + stats.dropped_duplicate + stats.dropped_surplus
                                + sum(stats.written.values()))


def test_cli_data_writes_the_splits(tmp_path):
    result = run_cli("data", "--out", str(tmp_path), "--pairs", "50", "--valid", "5", "--test", "5", "--novel", "2", "--json")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.json", "novel.tsv", "test.tsv", "train.tsv", "valid.tsv"]
    bad = run_cli("data", "--out", str(tmp_path), "--pairs", "0")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--pairs 0" in bad.stderr
