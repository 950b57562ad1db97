"""Import a Hugging Face Marian (OPUS-MT) model directory as an nmtserve checkpoint.

    nmtserve import ~/models/opus-mt-en-de --out runs/opus-en-de.pt --source-lang en --target-lang de

Reads config.json, model.safetensors or pytorch_model.bin (fp16 is widened to fp32), source.spm,
target.spm, vocab.json and generation_config.json when present; nothing is downloaded. The checkpoint
holds the weights under nmtserve's names, a ModelConfig with Marian's options (positions in halves,
its activation, embedding scale, final_logits_bias, pad as the decoder start and never generated),
the Marian tokenizer, where it came from (directory, sha256 of every file read, the config) and the
generation defaults as decoding options. A variant nmtserve cannot represent is refused with one line
naming the config key and its value (ImportRefused, exit 2). Torch is needed, transformers is not.
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

import torch

from nmtserve.errors import NmtserveError
from nmtserve.export.runtime.bundle import sha256_of
from nmtserve.tokenizer import MarianTokenizer
from nmtserve.training.checkpoint import save
from nmtserve.training.model import EncoderDecoder, ModelConfig, SinusoidalPositions

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
GENERATION_KEYS = ("num_beams", "max_length", "length_penalty", "early_stopping", "bad_words_ids", "renormalize_logits")
# config.json activation_function -> ModelConfig.activation (transformers' ACT2FN names)
ACTIVATION_OF = {"relu": "relu", "swish": "swish", "silu": "swish", "gelu": "gelu"}
# keys of BART-family configs whose non-default value would change the architecture, and the value nmtserve needs.
# normalize_before is not among them: transformers' MarianMTModel (and CTranslate2's converter) run every Marian
# checkpoint post-norm whatever it says, and Hugging Face's conversion refuses pre-norm Marian models.
REQUIRED_IF_PRESENT = {"normalize_embedding": False, "add_final_layer_norm": False, "static_position_embeddings": True,
                       "add_bias_logits": False}


class ImportRefused(NmtserveError):
    """A model directory nmtserve cannot import: the message names the file or config key and value."""


def read_json(path: Path, required: bool = True) -> dict:
    if not path.is_file():
        if required:
            raise ImportRefused(f"{path}: missing; a Marian model directory has config.json, weights, "
                              "source.spm, target.spm and vocab.json")
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ImportRefused(f"{path}: not valid JSON ({e})") from None


def model_config(config: dict, generation: dict) -> ModelConfig:
    """nmtserve's ModelConfig for a Marian config.json, or ImportRefused naming what cannot be represented."""

    def refuse(key: str, why: str):
        raise ImportRefused(f"config.json: {key}={json.dumps(config.get(key))}: {why}")

    if config.get("model_type") != "marian":
        refuse("model_type", "not a Marian model (expected \"marian\")")
    shared = config.get("share_encoder_decoder_embeddings", True)
    if shared and config.get("decoder_vocab_size") not in (None, config.get("vocab_size")):
        refuse("decoder_vocab_size", "differs from vocab_size although share_encoder_decoder_embeddings is true")
    for key, needed in REQUIRED_IF_PRESENT.items():
        if key in config and config[key] != needed:
            refuse(key, f"only {json.dumps(needed)} is supported (Marian without embedding layer norm)")
    activation, d_model, heads = layer_shapes(config, refuse, "gelu")
    eos = config.get("eos_token_id", 0)
    if not isinstance(eos, int):
        refuse("eos_token_id", "one end-of-sentence id is supported")
    pad = config.get("pad_token_id", 58100)
    bad_words = generation.get("bad_words_ids") or []
    if any(len(ids) != 1 for ids in bad_words):
        raise ImportRefused(f"generation_config.json: bad_words_ids={json.dumps(bad_words)}: only single-token "
                          "entries are supported")
    target_vocab = config["vocab_size"] if shared else config.get("decoder_vocab_size") or config["vocab_size"]
    return ModelConfig(  # the embeddings (a source table apart, an untied output) are the weights' (state_dict)
        vocab_size=target_vocab, d_model=d_model, n_heads=heads, d_ff=config["encoder_ffn_dim"],
        n_encoder_layers=config["encoder_layers"], n_decoder_layers=config["decoder_layers"], dropout=0.0,
        max_len=config.get("max_position_embeddings", 1024), pad_id=pad,
        bos_id=config.get("decoder_start_token_id", pad), eos_id=eos, positions="halves", activation=activation,
        scale_embedding=bool(config.get("scale_embedding", False)), output_bias=True,
        suppressed_ids=tuple(sorted({ids[0] for ids in bad_words})),
        renormalize=bool(generation.get("renormalize_logits", False)))


def layer_shapes(config: dict, refuse, default_activation: str) -> tuple[str, int, int]:
    """(activation, d_model, heads) of a BART-family config.json, or `refuse(key, why)` for what nmtserve's layers
    cannot hold: encoder and decoder with different heads or FFN widths, another activation, an odd d_model."""
    for enc, dec in (("encoder_attention_heads", "decoder_attention_heads"), ("encoder_ffn_dim", "decoder_ffn_dim")):
        if config.get(enc) != config.get(dec):
            refuse(dec, f"differs from {enc}={config.get(enc)}; nmtserve's layers share one value")
    activation = ACTIVATION_OF.get(config.get("activation_function", default_activation))
    if activation is None:
        refuse("activation_function", f"supported: {', '.join(ACTIVATION_OF)}")
    d_model, heads = config.get("d_model"), config.get("encoder_attention_heads")
    if not isinstance(d_model, int) or not isinstance(heads, int) or d_model % heads or d_model % 2 or d_model < 4:
        refuse("d_model", f"must be even, at least 4 and divisible by encoder_attention_heads={heads}")
    return activation, d_model, heads


def decoding_defaults(generation: dict, config: ModelConfig) -> dict:
    """generation_config.json as nmtserve's decoding options (DecodingOptions names).

    transformers' max_length counts the decoder start token; max_decoding_length does not.
    """
    early_stopping = generation.get("early_stopping", False)
    if early_stopping not in (True, False):
        raise ImportRefused(f"generation_config.json: early_stopping={json.dumps(early_stopping)}: true or false")
    defaults = {"beam_size": int(generation.get("num_beams", 1)),
                "length_penalty": float(generation.get("length_penalty", 1.0)),
                # early_stopping=true stops at beam_size finished hypotheses: CTranslate2's rule with patience 1
                "beam_stopping": "ctranslate2" if early_stopping else "transformers"}
    if generation.get("max_length"):
        defaults["max_decoding_length"] = min(int(generation["max_length"]) - 1, config.max_len)
    return defaults


def _load_weights(directory: Path) -> tuple[dict[str, torch.Tensor], Path]:
    for name in WEIGHT_FILES:
        path = directory / name
        if path.is_file():
            break
    else:
        raise ImportRefused(f"{directory}: no weights ({' or '.join(WEIGHT_FILES)})")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            weights = load_file(path)
        else:
            weights = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a damaged file raises many types
        raise ImportRefused(f"{path}: not readable ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
    return {k: v.float() if v.is_floating_point() else v for k, v in weights.items()}, path


def state_dict(weights: dict[str, torch.Tensor], config: ModelConfig) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    """transformers' MarianMTModel or M2M100ForConditionalGeneration names -> EncoderDecoder names, and the config
    with the embeddings the weights have; an unknown or missing tensor is an error. Each side reads its own
    embed_tokens where stored (transformers ties them to `shared` unless the config unties them, and then saves
    each); sinusoidal position tables, when stored, are checked against nmtserve's own."""
    weights = {k.removeprefix("model."): v for k, v in weights.items()}
    shared = weights.pop("shared.weight", None)
    target, source = (weights.pop(f"{side}.embed_tokens.weight", shared) for side in ("decoder", "encoder"))
    if target is None or source is None:
        raise ImportRefused("weights: no embedding (model.shared.weight or model.decoder.embed_tokens.weight)")
    projection = weights.pop("lm_head.weight", target)
    separate_source = source.shape != target.shape or not torch.equal(source, target)
    untied = projection.shape != target.shape or not torch.equal(projection, target)
    config = replace(config, source_vocab_size=len(source) if separate_source else 0, tied_output=not untied)
    out = {"embed.weight": target}
    if separate_source:
        out["source_embed.weight"] = source
    if untied:
        out["embed.projection"] = projection
    if config.output_bias:
        out["embed.bias"] = weights.pop("final_logits_bias", torch.zeros(1, config.vocab_size)).reshape(-1)
    weights.pop("final_logits_bias", None)  # M2M100 has none; an all-zero one changes nothing
    table = SinusoidalPositions(config).table
    for side in ("encoder", "decoder"):
        stored = weights.pop(f"{side}.embed_positions.weight", None)
        if config.positions == "fairseq" and stored is not None:
            stored = stored[config.pad_id + 1:]
        if stored is not None and (stored.shape[1] != table.shape[1] or
                                   (stored[:len(table)] - table[:len(stored)]).abs().max() > 1e-4):
            raise ImportRefused(f"weights: {side}.embed_positions.weight is not the sinusoidal table "
                              "(learned positions are not supported)")
    for side in ("encoder", "decoder"):
        if config.pre_norm:
            for name in ("weight", "bias"):
                if f"{side}.layer_norm.{name}" not in weights:
                    raise ImportRefused(f"weights: no {side}.layer_norm.{name} (the {side}'s final layer norm)")
                out[f"{side}_norm.{name}"] = weights.pop(f"{side}.layer_norm.{name}")
    sublayers = {"encoder": {"self_attn": "self_attn", "self_attn_layer_norm": "res1.norm", "fc1": "ffn.w1",
                             "fc2": "ffn.w2", "final_layer_norm": "res2.norm"},
                 "decoder": {"self_attn": "self_attn", "self_attn_layer_norm": "res1.norm", "encoder_attn": "cross_attn",
                             "encoder_attn_layer_norm": "res2.norm", "fc1": "ffn.w1", "fc2": "ffn.w2",
                             "final_layer_norm": "res3.norm"}}
    for name in list(weights):
        parts = name.split(".")  # encoder.layers.3.self_attn.q_proj.weight
        if len(parts) >= 5 and parts[0] in sublayers and parts[1] == "layers" and parts[3] in sublayers[parts[0]]:
            out[".".join([parts[0], parts[2], sublayers[parts[0]][parts[3]], *parts[4:]])] = weights.pop(name)
    if weights:
        raise ImportRefused(f"weights: {len(weights)} tensors nmtserve does not know, e.g. {sorted(weights)[0]}")
    return out, config


def import_marian(directory: str | Path, out: str | Path, source_lang: str = "", target_lang: str = "") -> dict:
    """Write the checkpoint `out`; returns a summary of what was imported."""
    directory = Path(directory)
    raw_config, generation = read_configs(directory)
    tokenizer_config = read_json(directory / "tokenizer_config.json", required=False)
    config = model_config(raw_config, generation)
    try:
        tokenizer = MarianTokenizer.from_files(directory, decoder_start_id=config.bos_id)
    except (OSError, ValueError) as e:
        raise ImportRefused(str(e)) from None
    if tokenizer.target_vocab is not None and raw_config.get("share_encoder_decoder_embeddings", True):
        raise ImportRefused(f"{directory / 'target_vocab.json'}: a target vocabulary of its own, but config.json has "
                            "share_encoder_decoder_embeddings=true")
    source_size = raw_config["vocab_size"]
    if tokenizer.vocab_size > config.vocab_size or tokenizer.source_vocab_size > source_size or \
            (tokenizer.eos_id, tokenizer.pad_id) != (config.eos_id, config.pad_id):
        raise ImportRefused(f"{directory / 'vocab.json'}: {tokenizer.source_vocab_size} source and {tokenizer.vocab_size} "
                          f"target pieces, eos {tokenizer.eos_id}, pad {tokenizer.pad_id}; config.json says vocab_size "
                          f"{source_size} and {config.vocab_size}, eos_token_id {config.eos_id}, pad_token_id "
                          f"{config.pad_id}")
    read = ["config.json", "source.spm", "target.spm", "vocab.json",
            *[n for n in ("target_vocab.json", "generation_config.json", "tokenizer_config.json")
              if (directory / n).is_file()]]
    languages = {"source": source_lang or str(tokenizer_config.get("source_lang") or ""),
                 "target": target_lang or str(tokenizer_config.get("target_lang") or "")}
    if tokenizer.target_languages and languages["target"] and languages["target"] not in tokenizer.target_languages:
        raise ImportRefused(f"--target-lang {languages['target']}: this multilingual model translates into "
                          f"{', '.join(tokenizer.target_languages)}")
    return save_imported(out, "marian", directory, config, tokenizer, languages, decoding_defaults(generation, config),
                         read, raw_config, generation)


def read_configs(directory: Path) -> tuple[dict, dict]:
    """config.json and the generation settings of a Hugging Face folder, or ImportRefused naming what is missing."""
    if not directory.is_dir():
        raise ImportRefused(f"{directory}: no such directory")
    config = read_json(directory / "config.json")
    # older directories keep the generation settings in config.json, as transformers then reads them
    generation = read_json(directory / "generation_config.json", required=False) or \
        {k: config[k] for k in GENERATION_KEYS if k in config}
    return config, generation


def save_imported(out: str | Path, family: str, directory: Path, config: ModelConfig, tokenizer, languages: dict,
                  defaults: dict, read: list[str], raw_config: dict, generation: dict) -> dict:
    """Load the directory's weights into an EncoderDecoder of `config` and write the checkpoint `out`, which records
    where it came from (the sha256 of every file read) -> a summary of what was imported."""
    weights, weights_path = _load_weights(directory)
    weights, config = state_dict(weights, config)
    model = EncoderDecoder(config)
    try:
        model.load_state_dict(weights)
    except RuntimeError as e:
        raise ImportRefused(f"{weights_path}: weights do not fit config.json ({str(e).splitlines()[-1].strip()[:200]})") \
            from None
    read = [*read, weights_path.name]
    save(Path(out), {
        "model": model.state_dict(), "model_config": asdict(config), "tokenizer": tokenizer.payload(),
        "special_ids": tokenizer.special_ids(), "languages": languages, "decoding_defaults": defaults,
        "imported_from": {"format": family, "directory": str(directory.resolve()),
                          "files": {n: sha256_of(directory / n) for n in read},
                          "config": raw_config, "generation_config": generation}})
    return {"out": str(out), "parameters": model.num_parameters(), "languages": languages,
            "target_languages": tokenizer.target_languages, "decoding_defaults": defaults,
            "model_config": {k: v for k, v in asdict(config).items() if k != "suppressed_ids"}}
