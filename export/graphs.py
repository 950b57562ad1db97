"""The two ONNX graphs of a bundle, as torch modules over a trained EncoderDecoder.

encoder:      src_ids (B, S) int64, src_mask (B, S) bool
              -> cross_k, cross_v (L, B, H, S, Dh): every decoder layer's cross-attention
                 keys and values, computed once per source and never again.
decoder step: tokens (B,) int64, positions (B,) int64, past_k, past_v (L, B, H, T, Dh),
              past_valid (B, T) bool, cross_k, cross_v (L, B, H, S, Dh), src_mask (B, S) bool
              -> log_probs (B, V) float32, new_k, new_v (L, B, H, 1, Dh)

Every row carries its own position and cache validity, so rows may be at different steps and
may join or leave between steps. Cross K/V are inputs of the step, never outputs (re-emitting
them every step is what made Optimum's CUDA decoders slow, optimum #869). The step returns only
the new token's K/V; the caller appends them to its cache.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn

from training.model import EncoderDecoder, KVCache

OPSET = 17

ENCODER_INPUTS = ["src_ids", "src_mask"]
ENCODER_OUTPUTS = ["cross_k", "cross_v"]
DECODER_INPUTS = ["tokens", "positions", "past_k", "past_v", "past_valid", "cross_k", "cross_v", "src_mask"]
DECODER_OUTPUTS = ["log_probs", "new_k", "new_v"]

# symbolic dimension names, recorded in the manifest
_KV = {1: "batch", 3: "past_len"}
_CROSS = {1: "batch", 3: "src_len"}
DYNAMIC_AXES = {
    "encoder": {"src_ids": {0: "batch", 1: "src_len"}, "src_mask": {0: "batch", 1: "src_len"},
                "cross_k": _CROSS, "cross_v": _CROSS},
    "decoder": {"tokens": {0: "batch"}, "positions": {0: "batch"}, "past_k": _KV, "past_v": _KV,
                "past_valid": {0: "batch", 1: "past_len"}, "cross_k": _CROSS, "cross_v": _CROSS,
                "src_mask": {0: "batch", 1: "src_len"}, "log_probs": {0: "batch"},
                "new_k": {1: "batch"}, "new_v": {1: "batch"}},
}


class EncoderGraph(nn.Module):
    """Source -> cross-attention K/V of every decoder layer."""

    def __init__(self, model: EncoderDecoder):
        super().__init__()
        self.model = model

    def forward(self, src_ids, src_mask):
        return self.model.cross_kv(self.model.encode(src_ids, src_mask))


class DecoderStepGraph(nn.Module):
    """One cached decoder step for rows that may each be at their own position."""

    def __init__(self, model: EncoderDecoder):
        super().__init__()
        self.model = model

    def forward(self, tokens, positions, past_k, past_v, past_valid, cross_k, cross_v, src_mask):
        return self.model.decode_step(tokens, positions, KVCache(past_k, past_v, past_valid), cross_k, cross_v, src_mask)


def example_inputs(model: EncoderDecoder, batch: int = 3, src_len: int = 7, past_len: int = 5):
    """Inputs of both graphs at sizes > 1, so that tracing specialises no dimension."""
    c = model.config
    g = torch.Generator().manual_seed(0)
    src_ids = torch.randint(4, c.vocab_size, (batch, src_len), generator=g)
    src_mask = torch.ones(batch, src_len, dtype=torch.bool)
    src_mask[0, -2:] = False
    kv_shape = (c.n_decoder_layers, batch, c.n_heads, past_len, c.head_dim)
    with torch.no_grad():
        cross_k, cross_v = model.cross_kv(model.encode(src_ids, src_mask))
    past_valid = torch.ones(batch, past_len, dtype=torch.bool)
    past_valid[1, :2] = False
    decoder = (torch.randint(4, c.vocab_size, (batch,), generator=g), torch.tensor([past_len, past_len - 2, past_len][:batch]),
               torch.randn(kv_shape, generator=g), torch.randn(kv_shape, generator=g), past_valid, cross_k, cross_v, src_mask)
    return (src_ids, src_mask), decoder


def export_graphs(model: EncoderDecoder, out_dir: Path) -> dict[str, Path]:
    """Write encoder.onnx and decoder.onnx (fp32) into out_dir."""
    model = model.eval().float()
    enc_args, dec_args = example_inputs(model)
    paths = {"encoder": out_dir / "encoder.onnx", "decoder": out_dir / "decoder.onnx"}
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation and tracer warnings
        torch.onnx.export(EncoderGraph(model), enc_args, str(paths["encoder"]), input_names=ENCODER_INPUTS,
                          output_names=ENCODER_OUTPUTS, dynamic_axes=DYNAMIC_AXES["encoder"], opset_version=OPSET,
                          dynamo=False, do_constant_folding=True)
        torch.onnx.export(DecoderStepGraph(model), dec_args, str(paths["decoder"]), input_names=DECODER_INPUTS,
                          output_names=DECODER_OUTPUTS, dynamic_axes=DYNAMIC_AXES["decoder"], opset_version=OPSET,
                          dynamo=False, do_constant_folding=True)
    return paths
