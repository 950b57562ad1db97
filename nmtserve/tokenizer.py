"""A joint SentencePiece model over source and target text, with fixed special ids.

Torch-free: training, the bundle reader and the server all use it."""

from __future__ import annotations

import io
from collections.abc import Iterable

import sentencepiece as spm

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3


class Tokenizer:
    """Wraps a SentencePiece processor; the serialized model travels inside checkpoints and bundles."""

    pad_id, unk_id, bos_id, eos_id = PAD_ID, UNK_ID, BOS_ID, EOS_ID

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

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.sp.encode(texts)

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode([i for i in ids if i not in (PAD_ID, BOS_ID, EOS_ID)])

    def special_ids(self) -> dict[str, int]:
        return {"pad": PAD_ID, "unk": UNK_ID, "bos": BOS_ID, "eos": EOS_ID}
