"""checkpoint -> CTranslate2 model directory, for benchmarking against CTranslate2 on the same weights.

CTranslate2's TransformerSpec describes the paper's model; we fill it from our state dict:
fused QKV for self-attention, fused KV for cross-attention, post-LN layer norms where our
Residual blocks keep them, our sinusoidal table as explicit position encodings (CTranslate2's
built-in table concatenates sin and cos instead of interleaving them), and the tied embedding
as the output projection.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from nmtserve.training.checkpoint import LoadedModel


def _np(t) -> np.ndarray:
    return t.detach().cpu().float().numpy()


def _linear(spec, linear) -> None:
    spec.weight = _np(linear.weight)
    spec.bias = _np(linear.bias)


def _fused(spec, linears) -> None:
    spec.weight = np.concatenate([_np(l.weight) for l in linears])
    spec.bias = np.concatenate([_np(l.bias) for l in linears])


def _norm(spec, norm) -> None:
    spec.gamma = _np(norm.weight)
    spec.beta = _np(norm.bias)


def _inputs(spec, embeddings_spec, model) -> None:
    embeddings_spec.weight = _np(model.embed.weight)
    spec.scale_embeddings = True
    spec.position_encodings.encodings = _np(model.positions.table)


def build_spec(loaded: LoadedModel):
    import ctranslate2

    model, c = loaded.model, loaded.model.config
    spec = ctranslate2.specs.TransformerSpec.from_config((c.n_encoder_layers, c.n_decoder_layers), c.n_heads,
                                                         pre_norm=c.pre_norm)
    spec.config.layer_norm_epsilon = 1e-5  # torch.nn.LayerNorm's default
    enc, dec = spec.encoder, spec.decoder
    _inputs(enc, enc.embeddings[0], model)  # the encoder has a list: one table per source feature
    for layer_spec, layer in zip(enc.layer, model.encoder):
        a = layer.self_attn
        _fused(layer_spec.self_attention.linear[0], [a.q_proj, a.k_proj, a.v_proj])
        _linear(layer_spec.self_attention.linear[1], a.out_proj)
        _norm(layer_spec.self_attention.layer_norm, layer.res1.norm)
        _linear(layer_spec.ffn.linear_0, layer.ffn.w1)
        _linear(layer_spec.ffn.linear_1, layer.ffn.w2)
        _norm(layer_spec.ffn.layer_norm, layer.res2.norm)
    _inputs(dec, dec.embeddings, model)
    for layer_spec, layer in zip(dec.layer, model.decoder):
        s, x = layer.self_attn, layer.cross_attn
        _fused(layer_spec.self_attention.linear[0], [s.q_proj, s.k_proj, s.v_proj])
        _linear(layer_spec.self_attention.linear[1], s.out_proj)
        _norm(layer_spec.self_attention.layer_norm, layer.res1.norm)
        _linear(layer_spec.attention.linear[0], x.q_proj)
        _fused(layer_spec.attention.linear[1], [x.k_proj, x.v_proj])
        _linear(layer_spec.attention.linear[2], x.out_proj)
        _norm(layer_spec.attention.layer_norm, layer.res2.norm)
        _linear(layer_spec.ffn.linear_0, layer.ffn.w1)
        _linear(layer_spec.ffn.linear_1, layer.ffn.w2)
        _norm(layer_spec.ffn.layer_norm, layer.res3.norm)
    if c.pre_norm:
        _norm(enc.layer_norm, model.encoder_norm)
        _norm(dec.layer_norm, model.decoder_norm)
    dec.projection.weight = _np(model.embed.weight)
    dec.projection.bias = np.zeros(c.vocab_size, dtype=np.float32)
    pieces = [loaded.tokenizer.sp.id_to_piece(i) for i in range(loaded.tokenizer.vocab_size)]
    spec.register_source_vocabulary(pieces)
    spec.register_target_vocabulary(pieces)
    spec.config.decoder_start_token = pieces[loaded.tokenizer.bos_id]
    spec.config.bos_token = pieces[loaded.tokenizer.bos_id]
    spec.config.eos_token = pieces[loaded.tokenizer.eos_id]
    spec.config.unk_token = pieces[loaded.tokenizer.unk_id]
    return spec


def convert(loaded: LoadedModel, out_dir: Path) -> Path:
    """Write a float32 CTranslate2 model; int8 is chosen at load time (compute_type='int8')."""
    spec = build_spec(loaded)
    spec.validate()
    spec.optimize(quantization=None)
    out_dir.mkdir(parents=True, exist_ok=True)
    spec.save(str(out_dir))
    return out_dir
