"""Random Hugging Face M2M100 and NLLB model directories, built offline the way facebook/m2m100_418M and
facebook/nllb-200-distilled-600M are laid out: config.json + model.safetensors (M2M100Config +
M2M100ForConditionalGeneration.save_pretrained), generation_config.json, a SentencePiece BPE model trained here on
a few hundred sentences of two languages, and the tokenizer's own files as transformers saves them (M2M100:
vocab.json, tokenizer_config.json; NLLB: tokenizer.json, tokenizer_config.json). Needs the `marian` extra
(transformers). Tiny ones for the tests; an NLLB-600M-shaped one for the benchmarks:

    python -m nmtserve.loadtests.m2m100_model runs/nllb-shaped    # 1024 dims, 16 heads, 4096 FFN, 12+12, 256,204 ids
"""

from __future__ import annotations

import json
from pathlib import Path

import sentencepiece as spm
import torch

from nmtserve.language_codes import NLLB
from nmtserve.loadtests.marian_model import ENGLISH, FRENCH, sentences, train_spm

# facebook/nllb-200-distilled-600M's shapes (its SentencePiece model has 256,000 pieces; with the special and
# language tokens transformers adds here, 256,204 ids against the real model's 256,206)
NLLB_600M_SHAPES = {"d_model": 1024, "heads": 16, "ffn": 4096, "encoder_layers": 12, "decoder_layers": 12,
                    "spm_pieces": 256000, "max_positions": 1024}


def build_m2m100_dir(out: Path, *, family: str = "m2m100", d_model: int = 32, heads: int = 4, ffn: int = 64,
                     encoder_layers: int = 2, decoder_layers: int = 2, activation: str = "relu",
                     scale_embedding: bool = True, tied: bool = True, max_positions: int = 64, spm_pieces: int = 120,
                     max_length: int = 40, seed: int = 0, legacy_behaviour: bool = False, fit_steps: int = 120) -> Path:
    """Write a random M2M100 (`family` "m2m100", its 100 language codes) or NLLB ("nllb") directory whose
    SentencePiece model knows English and French (en/fr, eng_Latn/fra_Latn). A larger spm_pieces pads the
    vocabulary with filler pieces (the benchmark's real-size embedding). A random model's greedy output is one token
    over and over (its tied embedding predicts the token it was fed), so it is first fitted for `fit_steps` steps to a
    word-for-word en→fr task: its outputs then vary, and some end early."""
    from transformers import GenerationConfig, M2M100Config, M2M100ForConditionalGeneration

    out.mkdir(parents=True, exist_ok=True)
    texts = sentences(ENGLISH, 400, 1) + sentences(FRENCH, 400, 2)
    model_proto = train_spm(texts, min(spm_pieces, 120), "bpe")
    if spm_pieces > 120:
        model_proto = _padded(model_proto, spm_pieces)
    (out / "sentencepiece.bpe.model").write_bytes(model_proto)
    tokenizer = _save_tokenizer(out, family, legacy_behaviour)
    # M2M100: its pieces, a token per language and 8 made-up words; NLLB: every id its tokenizer has
    vocab_size = len(tokenizer.encoder) + len(tokenizer.lang_code_to_id) + 8 if family == "m2m100" else len(tokenizer)
    config = M2M100Config(
        vocab_size=vocab_size, d_model=d_model, encoder_layers=encoder_layers, decoder_layers=decoder_layers,
        encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=ffn, decoder_ffn_dim=ffn,
        max_position_embeddings=max_positions, activation_function=activation, scale_embedding=scale_embedding,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, dropout=0.0, attention_dropout=0.0,
        tie_word_embeddings=tied)
    torch.manual_seed(seed)
    model = M2M100ForConditionalGeneration(config)
    if fit_steps:
        _fit(model, tokenizer, fit_steps)
    model.eval()
    model.save_pretrained(out)
    GenerationConfig(decoder_start_token_id=2, eos_token_id=2, pad_token_id=1, bos_token_id=0,
                     max_length=max_length).save_pretrained(out)
    return out


def _fit(model, tokenizer, steps: int) -> None:
    """A few Adam steps on English sentences and their word-for-word French."""
    word = dict(zip(ENGLISH, FRENCH))
    source = sentences(ENGLISH, 256, 5)
    target = [" ".join(word.get(w.strip(".!?").lower(), w) for w in s.split()) for s in source]
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for step in range(steps):
        i = step * 32 % len(source)
        batch = tokenizer(source[i:i + 32], text_target=target[i:i + 32], return_tensors="pt", padding=True)
        batch["labels"][batch["labels"] == tokenizer.pad_token_id] = -100
        loss = model(**batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def _save_tokenizer(out: Path, family: str, legacy_behaviour: bool):
    """transformers' tokenizer over the directory's SentencePiece model, saved there as transformers saves it."""
    if family == "m2m100":
        from transformers import M2M100Tokenizer

        sp = spm.SentencePieceProcessor(model_file=str(out / "sentencepiece.bpe.model"))
        vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
        for i in range(sp.get_piece_size()):
            if not (sp.is_control(i) or sp.is_unknown(i)):
                vocab.setdefault(sp.id_to_piece(i), len(vocab))
        (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
        tokenizer = M2M100Tokenizer(str(out / "vocab.json"), str(out / "sentencepiece.bpe.model"),
                                    src_lang="en", tgt_lang="fr")
    elif family == "nllb":
        from transformers import NllbTokenizer

        tokenizer = NllbTokenizer.from_pretrained(str(out), additional_special_tokens=list(NLLB), src_lang="eng_Latn",
                                                  tgt_lang="fra_Latn", legacy_behaviour=legacy_behaviour)
    else:
        raise ValueError(f"family {family!r}: m2m100 or nllb")
    tokenizer.save_pretrained(str(out))
    return tokenizer


def _padded(model_proto: bytes, pieces: int) -> bytes:
    """The SentencePiece model with filler pieces (never produced: the lowest scores) up to `pieces`."""
    from sentencepiece import sentencepiece_model_pb2

    m = sentencepiece_model_pb2.ModelProto.FromString(model_proto)
    lowest = min(p.score for p in m.pieces)
    for i in range(pieces - len(m.pieces)):
        piece = m.pieces.add()
        piece.piece, piece.score = f"▁filler{i}", lowest - 1 - i
    return m.SerializeToString()


if __name__ == "__main__":
    import sys

    build_m2m100_dir(Path(sys.argv[1]), family="nllb", fit_steps=0, **NLLB_600M_SHAPES)
