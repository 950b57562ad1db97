"""Import a Hugging Face M2M100 or NLLB model directory (facebook/m2m100_418M, facebook/nllb-200-distilled-600M and
their kind) as an nmtserve checkpoint: one model for every pair of its languages.

    nmtserve import ~/models/nllb-200-distilled-600M --out runs/nllb.pt

Reads config.json, model.safetensors or pytorch_model.bin, generation_config.json when present, and the tokenizer's
files: sentencepiece.bpe.model with vocab.json (M2M100: language tokens __xx__ after its pieces, in the order of
tokenizer_config.json's `language_codes`) or with tokenizer.json (NLLB: its vocabulary and its added language tokens;
without it, SentencePiece's ids shifted by fairseq's offset, languages after them). The architecture is pre-norm with
final layer norms, scaled embeddings and fairseq's sinusoidal positions from row pad + 1; decoding starts from
decoder_start_token_id (eos) and is forced to the target language's token next. A variant nmtserve cannot
represent is refused with one line naming the file or config key (ImportRefused, exit 2). Torch is needed,
transformers is not.
"""

from __future__ import annotations

import json
from pathlib import Path

import sentencepiece as spm

from nmtserve.language_codes import M2M100, NLLB, WMT21
from nmtserve.tokenizer import M2M100Tokenizer
from nmtserve.training.marian import (
    ImportRefused,
    decoding_defaults,
    layer_shapes,
    read_configs,
    read_json,
    save_imported,
)
from nmtserve.training.model import ModelConfig

SPM_FILE = "sentencepiece.bpe.model"
LANGUAGE_CODES = {"m2m100": M2M100, "wmt21": WMT21}


def model_config(config: dict) -> ModelConfig:
    """nmtserve's ModelConfig for an M2M100 config.json, or ImportRefused naming what cannot be represented."""

    def refuse(key: str, why: str):
        raise ImportRefused(f"config.json: {key}={json.dumps(config.get(key))}: {why}")

    if config.get("model_type") != "m2m_100":
        refuse("model_type", "not an M2M100 or NLLB model (expected \"m2m_100\")")
    activation, d_model, heads = layer_shapes(config, refuse, "relu")
    for key in ("eos_token_id", "pad_token_id", "decoder_start_token_id"):
        if not isinstance(config.get(key, 0), int):
            refuse(key, "one token id is supported")
    pad, eos = config.get("pad_token_id", 1), config.get("eos_token_id", 2)
    return ModelConfig(
        vocab_size=config["vocab_size"], d_model=d_model, n_heads=heads, d_ff=config["encoder_ffn_dim"],
        n_encoder_layers=config["encoder_layers"], n_decoder_layers=config["decoder_layers"], dropout=0.0,
        pre_norm=True, max_len=config.get("max_position_embeddings", 1024), pad_id=pad,
        bos_id=config.get("decoder_start_token_id", eos), eos_id=eos, positions="fairseq", activation=activation,
        scale_embedding=bool(config.get("scale_embedding", True)), output_bias=False)


def tokenizer_of(directory: Path, config: ModelConfig) -> tuple[M2M100Tokenizer, list[str]]:
    """The directory's tokenizer, without transformers -> (it, the files read)."""
    model_path = directory / SPM_FILE
    if not model_path.is_file():
        raise ImportRefused(f"{model_path}: missing; an M2M100 or NLLB directory has the SentencePiece model")
    model = model_path.read_bytes()
    settings = read_json(directory / "tokenizer_config.json", required=False)
    read = [SPM_FILE, *(["tokenizer_config.json"] if settings else [])]
    if (directory / "vocab.json").is_file():  # M2M100
        vocab = read_json(directory / "vocab.json")
        codes = LANGUAGE_CODES.get(settings.get("language_codes", "m2m100"))
        if codes is None:
            raise ImportRefused(f"{directory / 'tokenizer_config.json'}: language_codes="
                                f"{json.dumps(settings.get('language_codes'))}: one of {', '.join(LANGUAGE_CODES)}")
        languages = {code: len(vocab) + i for i, code in enumerate(codes)}
        vocab.update({f"__{code}__": i for code, i in languages.items()})  # the language tokens' pieces
        read.append("vocab.json")
    elif (directory / "tokenizer.json").is_file():  # NLLB, as transformers saves it
        table = read_json(directory / "tokenizer.json")
        vocab = dict(table.get("model", {}).get("vocab") or {})
        added = {t["content"]: t["id"] for t in table.get("added_tokens", [])}
        vocab.update(added)
        languages = {code: added[code] for code in NLLB if code in added}
        read.append("tokenizer.json")
    else:  # NLLB from its SentencePiece model alone: fairseq's layout
        sp = spm.SentencePieceProcessor(model_proto=model)
        vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
        vocab.update({sp.id_to_piece(i): i + 1 for i in range(sp.get_piece_size())
                      if not (sp.is_control(i) or sp.is_unknown(i))})
        languages = {code: sp.get_piece_size() + 1 + i for i, code in enumerate(NLLB)}
        vocab.update(languages)
        vocab["<mask>"] = sp.get_piece_size() + 1 + len(NLLB)
    try:
        tokenizer = M2M100Tokenizer(model, vocab, languages, language_last=bool(settings.get("legacy_behaviour")),
                                    source_language=settings.get("src_lang") or "",
                                    target_language=settings.get("tgt_lang") or "", decoder_start_id=config.bos_id)
    except ValueError as e:
        raise ImportRefused(f"{directory}: {e}") from None
    if tokenizer.vocab_size > config.vocab_size or (tokenizer.eos_id, tokenizer.pad_id) != (config.eos_id, config.pad_id):
        raise ImportRefused(f"{directory}: the tokenizer has {tokenizer.vocab_size} ids, eos {tokenizer.eos_id}, pad "
                            f"{tokenizer.pad_id}; config.json says vocab_size {config.vocab_size}, eos_token_id "
                            f"{config.eos_id}, pad_token_id {config.pad_id}")
    return tokenizer, read


def import_m2m100(directory: str | Path, out: str | Path, source_lang: str = "", target_lang: str = "") -> dict:
    """Write the checkpoint `out`; returns a summary of what was imported. source_lang and target_lang become the
    model's default languages (a request names its own)."""
    directory = Path(directory)
    raw_config, generation = read_configs(directory)
    config = model_config(raw_config)
    tokenizer, read = tokenizer_of(directory, config)
    for name, code in (("--source-lang", source_lang), ("--target-lang", target_lang)):
        if code and code not in tokenizer.languages:
            raise ImportRefused(f"{name} {code}: not one of this model's {len(tokenizer.languages)} languages")
    tokenizer.source_language = source_lang or tokenizer.source_language
    tokenizer.target_language = target_lang or tokenizer.target_language
    languages = {"source": tokenizer.source_language, "target": tokenizer.target_language}
    read = ["config.json", *read, *(["generation_config.json"] if (directory / "generation_config.json").is_file() else [])]
    return save_imported(out, "m2m100", directory, config, tokenizer, languages, decoding_defaults(generation, config),
                         read, raw_config, generation)
