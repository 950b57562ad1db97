"""The built-in English→French corpus: sentence structures sampled from the
lexicon and realised in both languages by pyrealb.

Usage (through the CLI):

    nmtserve data --out data/ --pairs 200000 --seed 1

A structure is sampled once, language-neutrally (a `Clause`), then realised
twice: pyrealb does the agreement, conjugation, elision, French adjective
placement, ne…pas and question inversion. Same seed ⇒ byte-identical files,
whatever the number of worker processes: chunk i is generated from its own
seed and chunks are merged in order.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from nmtserve.training import lexicon as lx

CHUNK_PAIRS = 1000  # candidate pairs generated per worker task
NOVEL_PER_MILLE = 30  # share of (subject, verb, object) triples held out for the novel split
SPLITS = ("train", "valid", "test", "novel")


# ---------------------------------------------------------------- structures
@dataclass
class NounPhrase:
    noun: lx.Noun
    plural: bool
    determiner: lx.Determiner | lx.Possessive | lx.Number
    adjective: lx.Adjective | None = None
    relative_verb: lx.Pair | None = None  # subject relative clause: "that sleeps"


@dataclass
class Clause:
    subject: NounPhrase | lx.Pronoun | tuple[NounPhrase, lx.Pair, NounPhrase]
    verb: lx.Pair | None  # None: copula ("is") with `attribute`
    obj: NounPhrase | None = None
    attribute: lx.Adjective | None = None
    pp: tuple[lx.Pair, NounPhrase] | None = None
    adverb: lx.Pair | None = None
    tense: str = "present"  # present, past, future
    negative: bool = False
    question: bool = False

    def triple(self) -> tuple[str, str, str]:
        """(subject, verb, object) lemmas: the unit the novel split holds out."""
        subj = self.subject
        if isinstance(subj, tuple):
            subj = subj[0]
        head = subj.en if isinstance(subj, lx.Pronoun) else subj.noun.en
        verb = self.verb.en if self.verb else "be"
        obj = self.obj.noun.en if self.obj else (self.attribute.en if self.attribute else "-")
        return head, verb, obj


def sample_noun_phrase(rng: random.Random, animate: bool = False, relative: bool = True) -> NounPhrase:
    noun = rng.choice(lx.ANIMATE_NOUNS if animate else lx.NOUNS)
    kind = rng.random()
    if kind < 0.6:
        det = rng.choice(lx.DETERMINERS)
        plural = det.number == "p" or (det.number == "b" and rng.random() < 0.35)
    elif kind < 0.85:
        det, plural = rng.choice(lx.POSSESSIVES), rng.random() < 0.3
    else:
        det, plural = rng.choice(lx.NUMBERS), True
    adjective = rng.choice(lx.ADJECTIVES) if rng.random() < 0.35 else None
    relative_verb = None
    if relative and rng.random() < 0.08:
        relative_verb = rng.choice(lx.INTRANSITIVE_VERBS)
    return NounPhrase(noun, plural, det, adjective, relative_verb)


def sample_clause(rng: random.Random) -> Clause:
    r = rng.random()
    if r < 0.25:
        subject = rng.choice(lx.PRONOUNS)
    elif r < 0.33:
        subject = (sample_noun_phrase(rng, animate=True, relative=False), rng.choice(lx.COORDINATIONS),
                   sample_noun_phrase(rng, animate=True, relative=False))
    else:
        subject = sample_noun_phrase(rng, animate=True)
    clause = Clause(subject=subject, verb=None)
    shape = rng.random()
    if shape < 0.6:
        clause.verb = rng.choice(lx.TRANSITIVE_VERBS)
        clause.obj = sample_noun_phrase(rng)
    elif shape < 0.85:
        clause.verb = rng.choice(lx.INTRANSITIVE_VERBS)
    else:
        clause.attribute = rng.choice(lx.ADJECTIVES)
    if clause.verb and rng.random() < 0.3:
        prep = lx.PREPOSITION[rng.choice(lx.PLACE_PREPOSITIONS + lx.COMPANY_PREPOSITIONS)]
        clause.pp = (prep, sample_noun_phrase(rng, relative=False))
    if clause.verb and rng.random() < 0.2:
        clause.adverb = rng.choice(lx.ADVERBS)
    clause.tense = rng.choice(("present", "past", "future"))
    clause.negative = rng.random() < 0.3
    clause.question = rng.random() < 0.25
    return clause


# ---------------------------------------------------------------- realisation
_TENSE = {"en": {"present": "p", "past": "ps", "future": "f"},
          "fr": {"present": "p", "past": "pc", "future": "f"}}


def _determiner(det, lang: str, pr):
    """pyrealb D/NO for a determiner, possessive or number of the lexicon."""
    if isinstance(det, lx.Number):
        return pr.NO(det.value).nat(True)
    if isinstance(det, lx.Possessive):
        if lang == "en":
            return pr.D("my").pe(det.person).g(det.owner_gender).ow(det.owner_number)
        return pr.D(det.fr).pe(det.person)
    return pr.D(det.en if lang == "en" else det.fr)


def _noun_phrase(np: NounPhrase, lang: str, pr):
    noun = pr.N(getattr(np.noun, lang)).n("p" if np.plural else "s")
    if lang == "fr":
        noun = noun.g(np.noun.gender)
    parts = [_determiner(np.determiner, lang, pr)]
    if np.adjective:
        parts.append(pr.A(getattr(np.adjective, lang)))
    parts.append(noun)
    if np.relative_verb:
        rel = "who" if np.noun.animate else "that"
        pronoun = rel if lang == "en" else "qui"
        parts.append(pr.SP(pr.Pro(pronoun), pr.VP(pr.V(getattr(np.relative_verb, lang)))))
    return pr.NP(*parts)


def _subject(subject, lang: str, pr):
    if isinstance(subject, lx.Pronoun):
        lemma = "I" if lang == "en" else "je"
        return pr.Pro(lemma).pe(subject.person).n(subject.number).g(subject.gender)
    if isinstance(subject, tuple):
        left, conj, right = subject
        return pr.CP(pr.C(getattr(conj, lang)), _noun_phrase(left, lang, pr), _noun_phrase(right, lang, pr))
    return _noun_phrase(subject, lang, pr)


def realise(clause: Clause, lang: str, pr) -> str:
    """One language's sentence for a clause; pyrealb's lexicon must be `lang`'s."""
    verb = pr.V(getattr(clause.verb, lang) if clause.verb else ("be" if lang == "en" else "être"))
    verb = verb.t(_TENSE[lang][clause.tense])
    vp = [verb]
    if clause.obj:
        vp.append(_noun_phrase(clause.obj, lang, pr))
    if clause.attribute:
        vp.append(pr.A(getattr(clause.attribute, lang)))
    if clause.pp:
        prep, np = clause.pp
        vp.append(pr.PP(pr.P(getattr(prep, lang)), _noun_phrase(np, lang, pr)))
    if clause.adverb:
        vp.append(pr.Adv(getattr(clause.adverb, lang)))
    sentence = pr.S(_subject(clause.subject, lang, pr), pr.VP(*vp))
    types = {}
    if clause.negative:
        types["neg"] = True
    if clause.question:
        types["int"] = "yon"
    if types:
        sentence = sentence.typ(types)
    return " ".join(sentence.realize().split())


# ---------------------------------------------------------------- chunks
def _pyrealb():
    import pyrealb
    from pyrealb.Constituent import Constituent

    Constituent.exceptionOnWarning = True  # a warning means the output is not clean
    return pyrealb


def generate_chunk(args: tuple[int, int, int]) -> tuple[list[tuple[str, str, tuple]], int]:
    """Candidate pairs of chunk `index`: ([(en, fr, triple)], dropped)."""
    seed, index, count = args
    pr = _pyrealb()
    rng = random.Random(f"nmtserve-corpus-{seed}-{index}")
    pairs, dropped = [], 0
    for _ in range(count):
        clause = sample_clause(rng)
        pair = realise_pair(clause, pr)
        if pair is None:
            dropped += 1
        else:
            pairs.append((*pair, clause.triple()))
    return pairs, dropped


def realise_pair(clause: Clause, pr=None) -> tuple[str, str] | None:
    """(English, French) for a clause, or None when pyrealb cannot realise it cleanly."""
    pr = pr or _pyrealb()
    try:
        pr.loadEn()
        en = realise(clause, "en", pr)
        pr.loadFr()
        fr = realise(clause, "fr", pr)
    except Exception:  # pyrealb raises on any warning: unknown word, impossible agreement
        return None
    if "[[" in en or "[[" in fr or not en or not fr:  # pyrealb's marker for what it could not inflect
        return None
    return en, fr


def is_novel_triple(triple: tuple[str, str, str]) -> bool:
    """Whether a (subject, verb, object) triple belongs to the novel split only."""
    return zlib.crc32("|".join(triple).encode()) % 1000 < NOVEL_PER_MILLE


# ---------------------------------------------------------------- the corpus
@dataclass
class CorpusStats:
    written: dict[str, int] = field(default_factory=lambda: {s: 0 for s in SPLITS})
    dropped_unrealisable: int = 0
    dropped_duplicate: int = 0
    dropped_surplus: int = 0
    candidates: int = 0


def _route(triple, wanted: dict[str, int], stats: CorpusStats) -> str | None:
    """The split a new (unseen) pair goes to, or None when its split is full."""
    if is_novel_triple(triple):
        return "novel" if stats.written["novel"] < wanted["novel"] else None
    for split in ("test", "valid", "train"):
        if stats.written[split] < wanted[split]:
            return split
    return None


LANGUAGES = {"source": "en", "target": "fr"}  # BCP 47 codes; the bundle's manifest carries them to clients


def generate_corpus(out: Path, pairs: int, seed: int = 1, valid: int = 1000, test: int = 2000,
                    novel: int = 1000, workers: int | None = None, progress=None) -> CorpusStats:
    """Write train/valid/test/novel TSV files (en<TAB>fr) and corpus.json into `out`; `progress` (console.Progress)
    counts the pairs written."""
    out.mkdir(parents=True, exist_ok=True)
    wanted = {"train": pairs, "valid": valid, "test": test, "novel": novel}
    files = {s: open(out / f"{s}.tsv", "w", encoding="utf-8", newline="\n") for s in SPLITS}
    stats, seen = CorpusStats(), set()
    workers = workers or min(os.cpu_count() or 1, 8)
    # spawn, not fork: forking a process that has other threads (gRPC, ONNX Runtime, a test
    # suite's servers) can copy a held lock into the child and hang it
    ctx = multiprocessing.get_context("spawn")
    chunk = 0
    try:
        with ctx.Pool(workers) as pool:
            while any(stats.written[s] < wanted[s] for s in SPLITS):
                # the novel split fills slowest: plan rounds on what is still missing
                missing = max(sum(wanted.values()) - sum(stats.written.values()),
                              (wanted["novel"] - stats.written["novel"]) * 1000 // NOVEL_PER_MILLE)
                # the round size must not depend on `workers`, or corpus.json's counts would
                n_chunks = max(2, min(64, missing * 12 // 10 // CHUNK_PAIRS + 1))
                tasks = [(seed, chunk + i, CHUNK_PAIRS) for i in range(n_chunks)]
                chunk += n_chunks
                for chunk_pairs, dropped in pool.imap(generate_chunk, tasks):
                    stats.dropped_unrealisable += dropped
                    stats.candidates += len(chunk_pairs) + dropped
                    for en, fr, triple in chunk_pairs:
                        if en in seen:
                            stats.dropped_duplicate += 1
                            continue
                        split = _route(triple, wanted, stats)
                        if split is None:
                            stats.dropped_surplus += 1
                            continue
                        seen.add(en)
                        files[split].write(f"{en}\t{fr}\n")
                        stats.written[split] += 1
                    if progress is not None:
                        progress.reach(sum(stats.written.values()))
    finally:
        for f in files.values():
            f.close()
    summary = {"seed": seed, "lemma_pairs": lx.lemma_pair_count(), "languages": LANGUAGES, **stats.__dict__}
    (out / "corpus.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    return stats
