"""Tokenizers: text <-> the ids a model reads and writes. Torch-free: training, the bundle reader
and the server all use them.

Three schemes, named in checkpoints and in the bundle's manifest ("tokenizer": {"scheme": …}):
- "sentencepiece": one SentencePiece model over source and target text, with fixed special ids
  (the models nmtserve trains);
- "marian": as Hugging Face's MarianTokenizer does it for OPUS-MT models: source text through
  source.spm, pieces mapped to ids by vocab.json (unknown pieces to <unk>, never SentencePiece's own
  ids), eos appended; output ids mapped back to pieces and detokenized by target.spm. Multilingual
  models take a `>>xx<<` target-language token first.
- "m2m100": as transformers' M2M100 and NLLB tokenizers do it: a source-language token around the
  pieces, and the target language as the first token decoding is forced to produce.
"""

from __future__ import annotations

import functools
import io
import json
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import sentencepiece as spm

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
TOKENIZER_FILE = "spm.model"  # the "sentencepiece" scheme's file in a bundle
MARIAN_FILES = ("source.spm", "target.spm", "vocab.json")
MARIAN_TARGET_VOCAB = "target_vocab.json"  # a Marian model with separate vocabularies: the target's


class Tokenizer:
    """Wraps a SentencePiece processor; the serialized model travels inside checkpoints and bundles."""

    scheme = "sentencepiece"
    pad_id, unk_id, bos_id, eos_id = PAD_ID, UNK_ID, BOS_ID, EOS_ID
    target_languages: list[str] = []  # one target language: no language token
    source_languages: list[str] = []  # one source language: no language token

    def __init__(self, model_proto: bytes):
        self.model_proto = model_proto
        self.sp = spm.SentencePieceProcessor(model_proto=model_proto)
        fixed = (self.sp.pad_id(), self.sp.unk_id(), self.sp.bos_id(), self.sp.eos_id())
        if fixed != (PAD_ID, UNK_ID, BOS_ID, EOS_ID):
            raise ValueError(f"SentencePiece model has special ids {fixed}, expected {(PAD_ID, UNK_ID, BOS_ID, EOS_ID)}")

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, seed: int = 1) -> Tokenizer:
        """Train on texts (source and target sentences together); vocab_size is an upper bound."""
        model = io.BytesIO()
        spm.set_random_generator_seed(seed)
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(texts), model_writer=model, vocab_size=vocab_size,
            model_type="unigram", character_coverage=1.0, hard_vocab_limit=False,
            pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID,
            input_sentence_size=2_000_000, shuffle_input_sentence=True,
            num_threads=1,  # more threads make the model depend on scheduling
            minloglevel=2,
        )
        return cls(model.getvalue())

    @classmethod
    def load(cls, path) -> Tokenizer:
        with open(path, "rb") as f:
            return cls(f.read())

    def save(self, path) -> None:
        with open(path, "wb") as f:
            f.write(self.model_proto)

    def payload(self) -> bytes:
        """What a checkpoint stores (`from_payload` reads it back)."""
        return self.model_proto

    def save_files(self, directory: Path) -> dict:
        """Write the bundle's tokenizer files; returns the manifest's "tokenizer" entry."""
        self.save(Path(directory) / TOKENIZER_FILE)
        return {"scheme": self.scheme, "files": [TOKENIZER_FILE]}

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def encode(self, text: str, max_tokens: int | None = None, target_language: str = "",
               source_language: str = "") -> list[int]:
        """The ids the encoder reads, at most max_tokens; [] when nothing is left after normalisation."""
        return self.sp.encode(text)[:max_tokens]

    def target_prefix(self, target_language: str = "") -> list[int]:
        """The target tokens decoding is forced to start with, after the start token: none."""
        return []

    def encode_target(self, text: str) -> list[int]:
        """A target text's ids, no eos: the start of a translation that decoding is forced to (target_prefix)."""
        return self.sp.encode(text)

    def piece(self, token_id: int) -> str:
        return self.sp.id_to_piece(token_id)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.sp.encode(texts)

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode([i for i in ids if i not in (PAD_ID, BOS_ID, EOS_ID)])

    def special_ids(self) -> dict[str, int]:
        return {"pad": PAD_ID, "unk": UNK_ID, "bos": BOS_ID, "eos": EOS_ID}


def _read_vocab(path: Path) -> dict[str, int]:
    """A JSON object of piece: id, or a ValueError naming the file."""
    try:
        table = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(table, dict) or not all(isinstance(i, int) for i in table.values()):
        raise ValueError(f"{path}: not a vocabulary (an object of piece: id)")
    return table


class MarianTokenizer:
    """MarianTokenizer's encoding and decoding (transformers' models/marian/tokenization_marian.py),
    without transformers: two SentencePiece models and one vocabulary shared by source and target, or
    (separate_vocabs, the tc-big models) vocab.json for the source and target_vocab.json for the target.

    bos_id is where decoding starts: Marian's decoder_start_token_id, which is pad. The special ids are
    the target's: the source's eos is source_eos_id.
    """

    scheme = "marian"
    source_languages: list[str] = []  # the source language is the model's own

    def __init__(self, source_spm: bytes, target_spm: bytes, vocab: dict[str, int], *, eos: str = "</s>",
                 unk: str = "<unk>", pad: str = "<pad>", decoder_start_id: int | None = None,
                 target_vocab: dict[str, int] | None = None):
        for file, table in (("vocab.json", vocab), ("target_vocab.json", target_vocab or vocab)):
            for name, piece in (("eos", eos), ("unk", unk), ("pad", pad)):
                if piece not in table:
                    raise ValueError(f"{file}: no {name} token {piece!r}")
        self.source_spm, self.target_spm, self.vocab, self.target_vocab = source_spm, target_spm, vocab, target_vocab
        self.source = spm.SentencePieceProcessor(model_proto=source_spm)
        self.target = spm.SentencePieceProcessor(model_proto=target_spm)
        target = target_vocab or vocab
        self.pieces = {i: p for p, i in target.items()}
        self.eos_id, self.unk_id, self.pad_id = target[eos], target[unk], target[pad]
        self.source_eos_id, self.source_unk_id = vocab[eos], vocab[unk]
        self.bos_id = self.pad_id if decoder_start_id is None else decoder_start_id
        self.language_ids = {p[2:-2]: i for p, i in vocab.items() if p.startswith(">>") and p.endswith("<<")}
        self.target_languages = sorted(self.language_ids)

    @classmethod
    def from_files(cls, directory: Path, decoder_start_id: int | None = None) -> MarianTokenizer:
        directory = Path(directory)
        source, target, vocab = (directory / name for name in MARIAN_FILES)
        for path in (source, target, vocab):
            if not path.is_file():
                raise FileNotFoundError(f"{path}: missing (a Marian tokenizer needs {', '.join(MARIAN_FILES)})")
        target_vocab = directory / MARIAN_TARGET_VOCAB
        return cls(source.read_bytes(), target.read_bytes(), _read_vocab(vocab), decoder_start_id=decoder_start_id,
                   target_vocab=_read_vocab(target_vocab) if target_vocab.is_file() else None)

    def payload(self) -> dict:
        return {"scheme": self.scheme, "source_spm": self.source_spm, "target_spm": self.target_spm,
                "vocab": self.vocab, "target_vocab": self.target_vocab, "decoder_start_id": self.bos_id}

    def save_files(self, directory: Path) -> dict:
        directory = Path(directory)
        (directory / MARIAN_FILES[0]).write_bytes(self.source_spm)
        (directory / MARIAN_FILES[1]).write_bytes(self.target_spm)
        (directory / MARIAN_FILES[2]).write_text(json.dumps(self.vocab, ensure_ascii=False, indent=1), encoding="utf-8")
        files = list(MARIAN_FILES)
        if self.target_vocab is not None:
            (directory / MARIAN_TARGET_VOCAB).write_text(json.dumps(self.target_vocab, ensure_ascii=False, indent=1),
                                                          encoding="utf-8")
            files.append(MARIAN_TARGET_VOCAB)
        return {"scheme": self.scheme, "files": files, "decoder_start_id": self.bos_id}

    @property
    def vocab_size(self) -> int:
        """The target vocabulary's size (the decoder's output)."""
        return max((self.target_vocab or self.vocab).values()) + 1

    @property
    def source_vocab_size(self) -> int:
        return max(self.vocab.values()) + 1

    def target_prefix(self, target_language: str = "") -> list[int]:
        """None: a Marian model's target language is a source token."""
        return []

    def encode_target(self, text: str) -> list[int]:
        """A target text's ids, no eos (as MarianTokenizer's text_target, eos left out): target.spm's pieces,
        the target vocabulary's ids."""
        table = self.target_vocab or self.vocab
        return [table.get(p, self.unk_id) for p in self.target.encode(text, out_type=str)]

    def encode(self, text: str, max_tokens: int | None = None, target_language: str = "",
               source_language: str = "") -> list[int]:
        """[>>xx<<] pieces eos, at most max_tokens (eos kept last); [] when no piece is left.

        A text that starts with a language token (">>fr<< …") keeps it, as MarianTokenizer does;
        otherwise target_language adds one (a ValueError names an unknown language).
        """
        code: list[int] = []
        if text.startswith(">>") and (end := text.find("<<")) != -1:  # MarianTokenizer.remove_language_code
            code, text = [self.vocab.get(text[: end + 2], self.source_unk_id)], text[end + 2:]
        elif target_language and self.language_ids:
            if target_language not in self.language_ids:
                raise ValueError(f"target language {target_language!r}: this model translates into "
                                 f"{', '.join(self.target_languages)}")
            code = [self.language_ids[target_language]]
        ids = [self.vocab.get(p, self.source_unk_id) for p in self.source.encode(text, out_type=str)]
        if not ids and not code:
            return []
        ids = code + ids
        if max_tokens is not None:
            ids = ids[: max_tokens - 1]
        return ids + [self.source_eos_id]

    def piece(self, token_id: int) -> str:
        return self.pieces[token_id]

    def decode(self, ids: list[int]) -> str:
        """MarianTokenizer.decode(ids, skip_special_tokens=True) with the target SentencePiece model."""
        skip = (self.eos_id, self.pad_id, self.unk_id)
        pieces = [self.pieces.get(i) or self.target.id_to_piece(i) for i in ids if i not in skip]
        return self.target.decode_pieces(pieces).replace("▁", " ").strip()

    def special_ids(self) -> dict[str, int]:
        return {"pad": self.pad_id, "unk": self.unk_id, "bos": self.bos_id, "eos": self.eos_id}


class M2M100Tokenizer:
    """transformers' M2M100Tokenizer and NllbTokenizer without transformers, for fairseq's multilingual models:
    one SentencePiece model, a vocabulary of piece: id (M2M100's vocab.json; NLLB's pieces at SentencePiece's ids
    plus fairseq's offset of one) and a token per language. A source is [source language] pieces eos (NLLB's
    legacy behaviour: pieces eos [source language]); decoding starts from the decoder start token (eos) and is
    forced to the target language's token next (`target_prefix`: transformers' forced_bos_token_id). Special
    and language tokens never reach decoded text.
    """

    scheme = "m2m100"
    files = ("sentencepiece.bpe.model", "vocab.json", "languages.json")
    options = ("languages", "language_last", "source_language", "target_language", "decoder_start_id")

    def __init__(self, spm_model: bytes, vocab: dict[str, int], languages: dict[str, int], *, language_last: bool = False,
                 source_language: str = "", target_language: str = "", decoder_start_id: int | None = None,
                 eos: str = "</s>", unk: str = "<unk>", pad: str = "<pad>"):
        for name, piece in (("eos", eos), ("unk", unk), ("pad", pad)):
            if piece not in vocab:
                raise ValueError(f"vocabulary: no {name} token {piece!r}")
        if not languages:
            raise ValueError("no language tokens: a multilingual model needs one per language")
        for name, code in (("source", source_language), ("target", target_language)):
            if code and code not in languages:
                raise ValueError(f"default {name} language {code!r}: not among the model's {len(languages)} languages")
        self.spm_model, self.languages = spm_model, languages
        self.language_last, self.source_language, self.target_language = language_last, source_language, target_language
        self.sp = spm.SentencePieceProcessor(model_proto=spm_model)
        self.eos_id, self.unk_id, self.pad_id = vocab[eos], vocab[unk], vocab[pad]
        self.bos_id = self.eos_id if decoder_start_id is None else decoder_start_id
        self.vocab_size = max(max(vocab.values()), max(languages.values())) + 1
        # the vocabulary as two arrays, SentencePiece's ids to the model's and back: dicts of a multilingual
        # model's every piece would hold many times more; the pieces SentencePiece has not (special tokens) in a
        # dict of their own
        self._model_ids = np.full(self.sp.get_piece_size(), self.unk_id, np.int32)
        self._piece_ids = np.full(self.vocab_size, -1, np.int32)
        self._others: dict[str, int] = {}
        pieces = list(vocab)
        piece_ids = self.sp.piece_to_id(pieces)
        for piece, i, s, back in zip(pieces, vocab.values(), piece_ids, self.sp.id_to_piece(piece_ids)):
            if back == piece and self._piece_ids[i] < 0:
                self._model_ids[s], self._piece_ids[i] = i, s
            else:
                self._others[piece] = i
        self._other_pieces = {i: p for p, i in self._others.items()}
        self.target_languages = self.source_languages = sorted(languages)
        self.skipped = {self.eos_id, self.unk_id, self.pad_id, self.bos_id, *languages.values(),
                        *(vocab[p] for p in ("<s>", "<mask>") if p in vocab)}

    @property
    def vocab(self) -> dict[str, int]:
        """piece: id, made again from the arrays (for saving the vocabulary, never per sentence)."""
        ids = np.flatnonzero(self._piece_ids >= 0)
        return {**dict(zip(self.sp.id_to_piece(self._piece_ids[ids].tolist()), ids.tolist())), **self._others}

    def payload(self) -> dict:
        return {"scheme": self.scheme, "spm": self.spm_model, "vocab": self.vocab, **self._options()}

    def _options(self) -> dict:
        """What the constructor takes besides the SentencePiece model and the vocabulary."""
        return {"languages": self.languages, "language_last": self.language_last, "source_language": self.source_language,
                "target_language": self.target_language, "decoder_start_id": self.bos_id}

    @classmethod
    def from_payload(cls, payload: dict) -> M2M100Tokenizer:
        return cls(payload["spm"], payload["vocab"], **{k: payload[k] for k in cls.options})

    def save_files(self, directory: Path) -> dict:
        directory = Path(directory)
        model, vocab, languages = (directory / name for name in self.files)
        model.write_bytes(self.spm_model)
        vocab.write_text(json.dumps(self.vocab, ensure_ascii=False), encoding="utf-8")
        languages.write_text(json.dumps(self._options(), ensure_ascii=False, indent=1), encoding="utf-8")
        return {"scheme": self.scheme, "files": list(self.files)}

    @classmethod
    def from_files(cls, directory: Path) -> M2M100Tokenizer:
        model, vocab, languages = (Path(directory) / name for name in cls.files)
        options = json.loads(languages.read_text(encoding="utf-8"))
        return cls(model.read_bytes(), _read_vocab(vocab), **{k: options[k] for k in cls.options})

    def _language(self, code: str, side: str) -> int:
        code = code or (self.source_language if side == "source" else self.target_language)
        if not code:
            raise ValueError(f"{side} language: this model translates between {len(self.languages)} languages "
                             f"({', '.join(self.target_languages[:8])}, …); name one")
        if code not in self.languages:
            raise ValueError(f"{side} language {code!r}: not one of this model's {len(self.languages)} languages "
                             f"({', '.join(self.target_languages[:8])}, …)")
        return self.languages[code]

    def encode(self, text: str, max_tokens: int | None = None, target_language: str = "",
               source_language: str = "") -> list[int]:
        """[source language] pieces eos (or pieces eos [source language]), at most max_tokens; [] when no piece is
        left. The target language is not read here: it is `target_prefix`'s."""
        code = self._language(source_language, "source")
        ids = self._model_ids[self.sp.encode(text)].tolist()
        if not ids:
            return []
        if max_tokens is not None:
            ids = ids[: max(0, max_tokens - 2)]
        return ids + [self.eos_id, code] if self.language_last else [code, *ids, self.eos_id]

    def target_prefix(self, target_language: str = "") -> list[int]:
        """The target language's token, which decoding is forced to start with."""
        return [self._language(target_language, "target")]

    def encode_target(self, text: str) -> list[int]:
        """A target text's ids, no eos and no language token (target_prefix's comes before them)."""
        return self._model_ids[self.sp.encode(text)].tolist()

    def piece(self, token_id: int) -> str:
        """The token of an id (a language's too: `__fr__`, `fra_Latn`); "" for an id past the vocabulary."""
        if 0 <= token_id < self.vocab_size and self._piece_ids[token_id] >= 0:
            return self.sp.id_to_piece(int(self._piece_ids[token_id]))
        return self._other_pieces.get(token_id, "")

    def decode(self, ids: list[int]) -> str:
        """decode(ids, skip_special_tokens=True): special and language tokens skipped, the rest SentencePiece's."""
        return self.sp.decode_pieces([p for p in map(self.piece, (i for i in ids if i not in self.skipped)) if p])

    def special_ids(self) -> dict[str, int]:
        return {"pad": self.pad_id, "unk": self.unk_id, "bos": self.bos_id, "eos": self.eos_id}


class StreamDecoder:
    """The text of a growing sequence of target ids, one delta at a time, as text-generation-inference and
    vLLM detokenize a stream: each `add` decodes only the ids since the previous delta's start (that delta's
    ids are the context: a first piece loses its leading space, pieces may join) and never the whole prefix
    again, so a stream of n tokens costs O(n), not O(n²). A delta is held back while the text could still
    change (it ends in an incomplete character, or the window's text does not extend what it emitted); what
    is held back comes with a later delta, or with the final text (the caller compares)."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.ids: list[int] = []
        self.start = self.read = 0  # ids[start:read]: the last delta's ids, decoded again as context
        self.context = ""  # their text, decoded once per delta (not again while a delta is held back)

    def add(self, ids: list[int]) -> str:
        """The new text that `ids` (appended to those so far) make final; "" while it is held back."""
        self.ids.extend(ids)
        text, context = self.decode(self.ids[self.start:]), self.context
        if len(text) <= len(context) or not text.startswith(context) or text.endswith("\ufffd"):
            return ""
        self.start, self.read = self.read, len(self.ids)
        self.context = self.decode(self.ids[self.start:self.read])
        return text[len(context):]


@functools.cache
def word_continuations(tokenizer, vocab_size: int) -> np.ndarray:
    """(vocab_size,) bool: the target tokens that continue the word before them (a SentencePiece piece without the
    word-start mark that begins with a letter or digit; special and language tokens do not). A glossary's term
    followed by one ran on into a longer word (search.ConstrainedBeamSearch). Once per tokenizer: the engines of a
    model share it (a pass over the whole vocabulary)."""
    pieces = [tokenizer.piece(i) for i in range(vocab_size)]
    return np.array([p[:1].isalnum() for p in pieces], bool)


def from_payload(payload: bytes | dict) -> Tokenizer | MarianTokenizer | M2M100Tokenizer:
    """The tokenizer a checkpoint stores: SentencePiece bytes, or a dict naming its scheme."""
    if isinstance(payload, bytes):
        return Tokenizer(payload)
    if payload.get("scheme") == M2M100Tokenizer.scheme:
        return M2M100Tokenizer.from_payload(payload)
    if payload.get("scheme") == MarianTokenizer.scheme:
        return MarianTokenizer(payload["source_spm"], payload["target_spm"], payload["vocab"],
                               decoder_start_id=payload["decoder_start_id"], target_vocab=payload.get("target_vocab"))
    raise ValueError(f"unknown tokenizer scheme {payload.get('scheme')!r}")


def from_bundle(directory: Path, entry: dict | None) -> Tokenizer | MarianTokenizer | M2M100Tokenizer:
    """The tokenizer of a bundle, from its manifest's "tokenizer" entry (absent: "sentencepiece")."""
    scheme = (entry or {}).get("scheme", Tokenizer.scheme)
    if scheme == Tokenizer.scheme:
        return Tokenizer.load(Path(directory) / TOKENIZER_FILE)
    if scheme == MarianTokenizer.scheme:
        return MarianTokenizer.from_files(directory, entry.get("decoder_start_id"))
    if scheme == M2M100Tokenizer.scheme:
        return M2M100Tokenizer.from_files(directory)
    raise ValueError(f"{directory}: unknown tokenizer scheme {scheme!r}")
