"""Random Hugging Face Marian model directories, built offline the way OPUS-MT's are laid out:
config.json + model.safetensors (MarianConfig + MarianMTModel.save_pretrained), generation_config.json,
source.spm and target.spm (SentencePiece trained here on a few hundred sentences) and a vocab.json
that joins both sides' pieces in Marian's layout (</s> 0, <unk> 1, …, <pad> last). Needs the
`marian` extra (transformers). Tiny ones for the tests; an OPUS-MT-shaped one for the benchmark:

    python -m nmtserve.loadtests.marian_model runs/opus-shaped    # 512 dims, 8 heads, 2048 FFN, 6+6, 58,101 pieces
    python -m nmtserve.loadtests.marian_model runs/tc-big-shaped --shape tc-big  # 1024, 16, 4096, 6+6, relu,
                                                                  # separate vocabularies of 57,059 pieces each
"""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

import sentencepiece as spm
import torch

ENGLISH = ("the cat dog girl boy lawyer teacher house garden city river small big old happy sad red green "
           "sees likes eats reads writes finds walks sleeps runs quickly slowly today yesterday often never").split()
FRENCH = ("le la chat chien fille garçon avocat professeur maison jardin ville rivière petit grand vieux heureux "
          "triste rouge vert voit aime mange lit écrit trouve marche dort court vite lentement aujourd'hui hier "
          "souvent jamais").split()
# outside both SentencePiece models' training text: unknown characters, digits, emoji, right-to-left
ODD = ["The cat λ sleeps.", "Über 42 Katzen!", "a 🙂 b", "שלום the dog", "", "   ", "zzz qqq xxx",
       ">>fr<< the cat sees the dog"]


def sentences(words: list[str], n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(2, 9)))
        out.append(text[0].upper() + text[1:] + rng.choice([".", "!", "?", ""]))
    return out


def train_spm(texts: list[str], vocab_size: int, model_type: str = "unigram") -> bytes:
    """A SentencePiece model of the texts (OPUS-MT's are unigram, M2M100's and NLLB's BPE)."""
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_writer=model, vocab_size=vocab_size,
                                   model_type=model_type, character_coverage=1.0, hard_vocab_limit=False,
                                   num_threads=1, minloglevel=2)
    return model.getvalue()


def _pieces(proto: bytes) -> list[str]:
    """The model's pieces, without those with a "y" (which then fall back to <unk>)."""
    sp = spm.SentencePieceProcessor(model_proto=proto)
    return [p for i in range(sp.get_piece_size()) if not sp.is_control(i) and not sp.is_unknown(i)
            and "y" not in (p := sp.id_to_piece(i))]


def _vocab(pieces: list[str], languages: tuple[str, ...], size: int | None) -> tuple[dict[str, int], int]:
    """Marian's layout: </s> 0, <unk> 1, language tokens, pieces, fillers up to `size`, <pad> last -> (it, pad)."""
    vocab = {"</s>": 0, "<unk>": 1}
    for piece in [*(f">>{lang}<<" for lang in languages), *pieces]:
        vocab.setdefault(piece, len(vocab))
    while size and len(vocab) < size - 1:
        vocab[f"▁filler{len(vocab)}"] = len(vocab)
    vocab["<pad>"] = len(vocab)
    return vocab, vocab["<pad>"]


# OPUS-MT's shapes (Helsinki-NLP/opus-mt-en-de and most others)
OPUS_SHAPES = {"d_model": 512, "heads": 8, "ffn": 2048, "encoder_layers": 6, "decoder_layers": 6, "vocab_size": 58101,
               "max_positions": 512, "max_length": 512}
# Helsinki-NLP/opus-mt-tc-big-*'s: transformer-big, relu, a vocabulary and an embedding for each side
TC_BIG_SHAPES = {"d_model": 1024, "heads": 16, "ffn": 4096, "encoder_layers": 6, "decoder_layers": 6,
                 "vocab_size": 57059, "max_positions": 1024, "max_length": 512, "activation": "relu",
                 "separate_vocabs": True}
SHAPES = {"opus": OPUS_SHAPES, "tc-big": TC_BIG_SHAPES}


def build_marian_dir(out: Path, *, activation: str = "swish", scale_embedding: bool = True, encoder_layers: int = 2,
                     decoder_layers: int = 2, d_model: int = 32, heads: int = 4, ffn: int = 64,
                     vocab_size: int | None = None, max_positions: int = 64, languages: tuple[str, ...] = (),
                     fp16: bool = False, max_length: int = 40, never_stop: bool = False, seed: int = 0,
                     source_words: list[str] = ENGLISH, target_words: list[str] = FRENCH,
                     separate_vocabs: bool = False, tied: bool = True, config_overrides: dict | None = None) -> Path:
    """Write a random Marian model directory; `languages` makes it multilingual (>>xx<< tokens),
    `vocab_size` pads the vocabulary with filler pieces, `never_stop` gives eos a logit bias of −100
    so that every engine decodes every sentence to its length limit (fixed lengths for benchmarks);
    source_words and target_words are what the two SentencePiece models learn (FRENCH, ENGLISH: fr→en).
    separate_vocabs: vocab.json for the source and target_vocab.json for the target, each with its own embedding
    (the tc-big models' layout); tied False: an output projection apart from the target embedding."""
    from transformers import GenerationConfig, MarianConfig, MarianMTModel

    out.mkdir(parents=True, exist_ok=True)
    source_spm, target_spm = train_spm(sentences(source_words, 400, 1), 80), train_spm(sentences(target_words, 400, 2), 90)
    (out / "source.spm").write_bytes(source_spm)
    (out / "target.spm").write_bytes(target_spm)
    pieces = {name: _pieces(proto) for name, proto in (("source", source_spm), ("target", target_spm))}
    if separate_vocabs:  # each side its own pieces, at the same special ids; the target's has a few ids past <pad>
        size = max(vocab_size or 0, 3 + len(languages) + max(len(pieces["source"]), len(pieces["target"])))
        vocab, pad = _vocab(pieces["source"], languages, size)
        target_vocab, _ = _vocab(pieces["target"], (), size)
        target_vocab.update({f"▁extra{i}": pad + 1 + i for i in range(5)})
        (out / "target_vocab.json").write_text(json.dumps(target_vocab, ensure_ascii=False), encoding="utf-8")
        (out / "tokenizer_config.json").write_text(json.dumps({"separate_vocabs": True}), encoding="utf-8")
    else:
        vocab, pad = _vocab(pieces["source"] + pieces["target"], languages, vocab_size)
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    sizes = {"vocab_size": len(vocab)}
    if separate_vocabs:
        sizes.update(share_encoder_decoder_embeddings=False, decoder_vocab_size=len(target_vocab))
    config = MarianConfig(
        **sizes, d_model=d_model, encoder_layers=encoder_layers, decoder_layers=decoder_layers,
        encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=ffn, decoder_ffn_dim=ffn,
        max_position_embeddings=max_positions, activation_function=activation, scale_embedding=scale_embedding,
        pad_token_id=pad, decoder_start_token_id=pad, eos_token_id=0, forced_eos_token_id=0, dropout=0.0,
        tie_word_embeddings=tied, **(config_overrides or {}))
    torch.manual_seed(seed)
    model = MarianMTModel(config).eval()
    with torch.no_grad():  # peaked distributions: few near-ties between the best tokens
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 1.5 / p.shape[-1] ** 0.5 * (3 if "embed" in name or "shared" in name else 1))
        model.final_logits_bias.normal_(0.0, 1.0)
        # eos: some hypotheses end early and most run long, or (never_stop) none ends before its limit
        model.final_logits_bias[0, 0] = -100.0 if never_stop else model.final_logits_bias[0, 0] + 7.5
    if fp16:
        model = model.half()
    model.save_pretrained(out)
    GenerationConfig(bad_words_ids=[[pad]], decoder_start_token_id=pad, eos_token_id=0, forced_eos_token_id=0,
                     pad_token_id=pad, max_length=max_length, num_beams=4, renormalize_logits=True).save_pretrained(out)
    return out


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m nmtserve.loadtests.marian_model")
    parser.add_argument("out", type=Path)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="opus")
    args = parser.parse_args()
    directory = build_marian_dir(args.out, **SHAPES[args.shape], never_stop=True)
    # sentences of 12 words or more: nmtserve's budget of 2 × source tokens + 10 is then above the
    # benchmark's 32 output tokens, and every engine decodes exactly that many
    words = sentences(ENGLISH, 1000, 3)
    long = [" ".join(words[i:i + 3]) for i in range(0, len(words), 3)]
    (directory / "sentences.txt").write_text("\n".join(t for t in long if len(t.split()) >= 12) + "\n", encoding="utf-8")
    print(directory)
