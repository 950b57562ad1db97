"""The two ONNX graphs of a bundle, as torch modules over a trained EncoderDecoder.

encoder:      src_ids (B, S) int64, src_mask (B, S) bool
              -> cross_k_0, cross_v_0, …, cross_k_{L-1}, cross_v_{L-1}, each (B, H, S, Dh):
                 every decoder layer's cross-attention keys and values, computed once per source.
decoder step: tokens (B,) int64, positions (B,) int64, past_valid (B, T) bool, src_mask (B, S) bool,
              then per layer l: past_k_l, past_v_l (B, H, T, Dh), cross_k_l, cross_v_l (B, H, S, Dh)
              -> log_probs (B, V) float32, new_k, new_v (L, B, H, 1, Dh)

Every row carries its own position and cache validity, so rows may be at different steps and
may join or leave between steps. Cross K/V are inputs of the step, never outputs (re-emitting
them every step is what made Optimum's CUDA decoders slow, optimum #869). The step returns only
the new token's K/V; the caller writes them into its cache. K/V travel as one tensor per layer:
a stacked (L, …) input makes ONNX Runtime split — copy — the whole cache on every step.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn

from nmtserve.training.model import EncoderDecoder

OPSET = 17


def io_names(n_layers: int) -> dict[str, dict[str, list[str]]]:
    """Input and output names of both graphs for a model with n_layers decoder layers."""
    cross = [n for i in range(n_layers) for n in (f"cross_k_{i}", f"cross_v_{i}")]
    past = [n for i in range(n_layers) for n in (f"past_k_{i}", f"past_v_{i}")]
    return {"encoder": {"inputs": ["src_ids", "src_mask"], "outputs": cross},
            "decoder": {"inputs": ["tokens", "positions", "past_valid", "src_mask", *past, *cross],
                        "outputs": ["log_probs", "new_k", "new_v"]}}


def dynamic_axes(n_layers: int) -> dict[str, dict]:
    """Symbolic dimension names (recorded in the manifest): batch, src_len, past_len."""
    names = io_names(n_layers)
    cross = {n: {0: "batch", 2: "src_len"} for n in names["encoder"]["outputs"]}
    past = {n: {0: "batch", 2: "past_len"} for n in names["decoder"]["inputs"] if n.startswith("past_") and n != "past_valid"}
    return {"encoder": {"src_ids": {0: "batch", 1: "src_len"}, "src_mask": {0: "batch", 1: "src_len"}, **cross},
            "decoder": {"tokens": {0: "batch"}, "positions": {0: "batch"}, "past_valid": {0: "batch", 1: "past_len"},
                        "src_mask": {0: "batch", 1: "src_len"}, **past, **cross, "log_probs": {0: "batch"},
                        "new_k": {1: "batch"}, "new_v": {1: "batch"}}}


class EncoderGraph(nn.Module):
    """Source -> cross-attention K/V of every decoder layer, one tensor each."""

    def __init__(self, model: EncoderDecoder):
        super().__init__()
        self.model = model

    def forward(self, src_ids, src_mask):
        memory = self.model.encode(src_ids, src_mask)
        return tuple(t for layer in self.model.decoder for t in layer.cross_attn.project_kv(memory))


class DecoderStepGraph(nn.Module):
    """One cached decoder step for rows that may each be at their own position."""

    def __init__(self, model: EncoderDecoder):
        super().__init__()
        self.model = model

    def forward(self, tokens, positions, past_valid, src_mask, *per_layer):
        n = len(self.model.decoder)
        past, cross = per_layer[: 2 * n], per_layer[2 * n:]
        return self.model.decode_step_layers(tokens, positions, past[0::2], past[1::2], past_valid,
                                             cross[0::2], cross[1::2], src_mask)


def example_inputs(model: EncoderDecoder, batch: int = 3, src_len: int = 7, past_len: int = 5):
    """Inputs of both graphs at sizes > 1, so that tracing specialises no dimension."""
    c = model.config
    g = torch.Generator().manual_seed(0)
    src_ids = torch.randint(4, c.vocab_size, (batch, src_len), generator=g)
    src_mask = torch.ones(batch, src_len, dtype=torch.bool)
    src_mask[0, -2:] = False
    with torch.no_grad():
        cross = EncoderGraph(model)(src_ids, src_mask)
    past_valid = torch.ones(batch, past_len, dtype=torch.bool)
    past_valid[1, :2] = False
    past = tuple(torch.randn(batch, c.n_heads, past_len, c.head_dim, generator=g) for _ in range(2 * c.n_decoder_layers))
    tokens = torch.randint(4, c.vocab_size, (batch,), generator=g)
    positions = torch.tensor([past_len, past_len - 2, past_len][:batch])
    return (src_ids, src_mask), (tokens, positions, past_valid, src_mask, *past, *cross)


def export_graphs(model: EncoderDecoder, out_dir: Path) -> dict[str, Path]:
    """Write encoder.onnx and decoder.onnx (fp32) into out_dir."""
    model = model.eval().float()
    enc_args, dec_args = example_inputs(model)
    names, axes = io_names(model.config.n_decoder_layers), dynamic_axes(model.config.n_decoder_layers)
    paths = {"encoder": out_dir / "encoder.onnx", "decoder": out_dir / "decoder.onnx"}
    graphs = {"encoder": (EncoderGraph(model), enc_args), "decoder": (DecoderStepGraph(model), dec_args)}
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation and tracer warnings
        for name, (module, args) in graphs.items():
            torch.onnx.export(module, args, str(paths[name]), input_names=names[name]["inputs"],
                              output_names=names[name]["outputs"], dynamic_axes=axes[name], opset_version=OPSET,
                              dynamo=False, do_constant_folding=True)
    return paths
