"""The ONNX graphs of a bundle, as torch modules over a trained EncoderDecoder: the encoder and the decoder step that
translate, and the aligner that gives a translation's attention.

encoder:      src_ids (B, S) int64, src_mask (B, S) bool
              -> per decoder layer l: cross_k_l, cross_v_l (B, H, S, Dh), the layer's cross-attention keys
                 and values, computed once per source; then cross_eos_l (B, 2·H·Dh) per layer, the key
                 and value of the row's last source token (its eos), packed; each self-attention one
                 com.microsoft MultiHeadAttention node. Padding is removed: embeddings, projections,
                 feed-forwards and norms run on the T real tokens of the batch as (1, T, D), and only
                 attention and the cross K/V see rows, (B, S, D), gathered back (CTranslate2's Padder
                 does the same); cross K/V at a row's padding are unspecified (nothing reads them).
decoder step: tokens (B,) int64, positions (B,) int64, cross_slot (B,) int32 (each row's last source
              slot), cache_slots (1,) int32 = C and source_slots (1,) int32 = S, then per layer l:
              past_k_l, past_v_l (B, H, C, Dh), then cross_k_l, cross_v_l (B, H, S, Dh), then cross_eos_l
              -> log_probs (B, V) float32, present_k_l, present_v_l (B, H, C, Dh) per layer, then
                 present_cross_k_l, present_cross_v_l (B, H, S, Dh) per layer
aligner:      src_ids (B, S) int64, src_mask (B, S) bool, target_ids (B, T) int64 (the start token, then the tokens
              fed after it) -> attention (B, T, S) float32: EncoderDecoder.attention, the last decoder layer's
              first head, all positions at once in plain ONNX operators (fp32, any device). Apart from the
              step, so that what a request that asks for no attention runs stays as it is.

Every row carries its own position, and its cache is its own from slot 0: row b has filled slots
0..positions[b]-1, so rows may be at different steps and may join or leave between steps. Each
attention of the step is one com.microsoft GroupQueryAttention node (ONNX Runtime's fused kernel,
CPU and CUDA; no attention bias, which the CUDA kernel refuses): it writes the row's new key and
value at slot positions[b], then attends over slots 0..positions[b] — each row over its own length.
Bound to the same buffer as its past (IOBinding), a `present` output is that buffer written in
place: nothing copies the cache, and the step returns no K/V. Cross-attention runs through the same
kernel over slots 0..S_b-1 of the row's source: the key and value it "writes" are the row's own at
slot S_b-1 (its eos, cross_eos_l, which the encoder gathers once), so the cross K/V are rewritten
unchanged (gathering them in every step cost many nodes); the runtime gives each row's last source
slot and the two slot counts, rather than the step computing them from src_mask and the inputs'
shapes in nodes of its own. Cross K/V are inputs of the step, computed once per source (re-emitting
them every step is what made Optimum's CUDA decoders slow, optimum #869). K/V travel as one tensor
per layer: a stacked (L, …) input makes ONNX Runtime split — copy — the whole cache on every step.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.onnx import symbolic_helper

from nmtserve.training.model import EncoderDecoder

OPSET = 17
STEP_SIZES = ("cross_slot", "cache_slots", "source_slots")  # decoder inputs after tokens and positions


def io_names(n_layers: int) -> dict[str, dict[str, list[str]]]:
    """Input and output names of both graphs for a model with n_layers decoder layers."""
    cross = [n for i in range(n_layers) for n in (f"cross_k_{i}", f"cross_v_{i}")]
    eos = [f"cross_eos_{i}" for i in range(n_layers)]
    past = [n for i in range(n_layers) for n in (f"past_k_{i}", f"past_v_{i}")]
    return {"encoder": {"inputs": ["src_ids", "src_mask"], "outputs": [*cross, *eos]},
            "decoder": {"inputs": ["tokens", "positions", *STEP_SIZES, *past, *cross, *eos],
                        "outputs": ["log_probs", *(f"present_{n[5:]}" for n in past), *(f"present_{n}" for n in cross)]},
            "aligner": {"inputs": ["src_ids", "src_mask", "target_ids"], "outputs": ["attention"]}}


def dynamic_axes(n_layers: int) -> dict[str, dict]:
    """Symbolic dimension names (recorded in the manifest): batch, src_len, past_len."""
    names = io_names(n_layers)
    cross = {n: {0: "batch", 2: "src_len"} for n in names["encoder"]["outputs"] if not n.startswith("cross_eos_")}
    eos = {f"cross_eos_{i}": {0: "batch"} for i in range(n_layers)}
    past = {n: {0: "batch", 2: "capacity"} for n in names["decoder"]["inputs"] if n[:7] in ("past_k_", "past_v_")}
    step_cross = {n: {0: "batch", 2: "src_len"} for n in cross}
    presents = {**{f"present_{n[5:]}": axes for n, axes in past.items()}, **{f"present_{n}": axes for n, axes in step_cross.items()}}
    return {"encoder": {"src_ids": {0: "batch", 1: "src_len"}, "src_mask": {0: "batch", 1: "src_len"}, **cross, **eos},
            "decoder": {"tokens": {0: "batch"}, "positions": {0: "batch"}, "cross_slot": {0: "batch"},
                        **past, **step_cross, **eos, "log_probs": {0: "batch"}, **presents},
            "aligner": {"src_ids": {0: "batch", 1: "src_len"}, "src_mask": {0: "batch", 1: "src_len"},
                        "target_ids": {0: "batch", 1: "tgt_len"}, "attention": {0: "batch", 1: "tgt_len", 2: "src_len"}}}


class SourceAttention(torch.autograd.Function):
    """An encoder self-attention over each row's real tokens, exported as one com.microsoft
    MultiHeadAttention node (in place of scaled_dot_product_attention's reshapes, transposes, scale
    and NaN guards). q, k, v (B, S, D) projected, keep (B, S) int32: 1 at real tokens -> (B, S, D)."""

    @staticmethod
    def forward(ctx, q, k, v, keep, heads: int):
        batch, width, dim = q.shape
        q, k, v = (t.reshape(batch, width, heads, dim // heads).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep.bool()[:, None, None, :])
        return out.transpose(1, 2).reshape(batch, width, dim)

    @staticmethod
    def symbolic(g, q, k, v, keep, heads: int):
        none = symbolic_helper._optional_input_placeholder_tensor(g)  # no bias: the projections add theirs
        out = g.op("com.microsoft::MultiHeadAttention", q, k, v, none, keep, num_heads_i=heads)
        out.setType(q.type())  # the exporter cannot infer a contrib op's output: (B, S, D) as q
        return out


class EncoderGraph(nn.Module):
    """Source -> cross-attention K/V of every decoder layer, one tensor each, then each layer's eos key
    and value: EncoderDecoder.encode with each self-attention as SourceAttention."""

    def __init__(self, model: EncoderDecoder):
        super().__init__()
        self.model = model

    def forward(self, src_ids, src_mask):
        m = self.model
        batch, width = src_ids.shape
        flat = src_mask.reshape(-1)
        real = flat.nonzero().squeeze(1)  # (T,): the real tokens among the B·S positions, in order
        # (B·S,): each position's row among the T real tokens (a pad: its row's last real token, ignored)
        spread = (flat.long().cumsum(0) - 1).clamp(min=0)

        def padded(t):  # (1, T, D) -> (B, S, D)
            return t[:, spread].reshape(batch, width, -1)

        x = m._embed_source(src_ids, torch.arange(width)[None, :].expand_as(src_ids)).reshape(1, batch * width, -1)[:, real]
        keep = src_mask.to(torch.int32)
        for layer in m.encoder:  # every token by itself on (1, T, D); only attention sees rows, (B, S, D)
            h, sa = layer.res1.input(x), layer.self_attn
            attended = SourceAttention.apply(padded(sa.q_proj(h)), padded(sa.k_proj(h)), padded(sa.v_proj(h)), keep,
                                             sa.n_heads)
            x = layer.res1.output(x, sa.out_proj(attended.reshape(1, batch * width, -1)[:, real]))
            x = layer.res2.output(x, layer.ffn(layer.res2.input(x)))
        memory = m.encoder_norm(x)
        last = src_mask.sum(1).cumsum(0) - 1  # each row's eos among the T real tokens
        cross, eos = [], []
        for layer in m.decoder:  # CrossAttention.project_kv, keeping each eos key and value (B, D) as well
            ca = layer.cross_attn
            k, v = ca.k_proj(memory), ca.v_proj(memory)
            cross += [ca._split(padded(k)), ca._split(padded(v))]
            eos.append(torch.cat([k[0, last], v[0, last]], dim=-1))
        return *cross, *eos


class StepAttention(torch.autograd.Function):
    """One query per row over a cache into which the same node first writes the row's new key and
    value: exported as com.microsoft GroupQueryAttention (heads of Dh = D / H, scale Dh ** -0.5).

    qkv (B, 1, 3D): query, key and value of each row's new token, packed; cache_k, cache_v (B, H, C, Dh);
    slot (B,) int32: where each row's key and value go, the kernel attending to slots 0..slot;
    capacity: (1,) int32, C. Returns out (B, 1, D) and the caches with the new slot written
    (in place when bound so).
    """

    @staticmethod
    def forward(ctx, qkv, cache_k, cache_v, slot, capacity, heads: int):
        batch, _, slots, head_dim = cache_k.shape
        q, k, v = (t.reshape(batch, heads, head_dim) for t in qkv[:, 0].chunk(3, dim=-1))
        rows, slot = torch.arange(batch), slot.long()
        cache_k, cache_v = cache_k.clone(), cache_v.clone()
        cache_k[rows, :, slot], cache_v[rows, :, slot] = k, v
        later = torch.arange(slots)[None, :] > slot[:, None]
        scores = (q[:, :, None, :] @ cache_k.transpose(-1, -2)) * head_dim ** -0.5
        probs = torch.softmax(scores.masked_fill(later[:, None, None, :], float("-inf")), dim=-1)
        return (probs @ cache_v).reshape(batch, 1, heads * head_dim), cache_k, cache_v

    @staticmethod
    def symbolic(g, qkv, cache_k, cache_v, slot, capacity, heads: int):
        none = symbolic_helper._optional_input_placeholder_tensor(g)  # key, value packed in qkv; no rotary, no bias
        out, k, v = g.op("com.microsoft::GroupQueryAttention", qkv, none, none, cache_k, cache_v, slot, capacity,
                         num_heads_i=heads, kv_num_heads_i=heads, outputs=3)
        out.setType(qkv.type().with_sizes([None, 1, None]))  # (B, 1, D): the exporter cannot infer it
        k.setType(cache_k.type())
        v.setType(cache_v.type())
        return out, k, v


def eos_slot(src_mask: torch.Tensor) -> torch.Tensor:
    """(B,) int32: each row's last source slot (its eos)."""
    return src_mask.sum(1, dtype=torch.int32).clamp(min=1) - 1


def _layer_step(layer, x, past_k, past_v, positions, capacity, cross_k, cross_v, eos, cross_slot, width):
    """DecoderLayer.step (training/model.py) with both attentions as StepAttention."""
    h = layer.res1.input(x)
    sa, ca = layer.self_attn, layer.cross_attn
    qkv = F.linear(h, torch.cat([sa.q_proj.weight, sa.k_proj.weight, sa.v_proj.weight]),
                   torch.cat([sa.q_proj.bias, sa.k_proj.bias, sa.v_proj.bias]))  # one Gemm
    out, past_k, past_v = StepAttention.apply(qkv[:, None, :], past_k, past_v, positions, capacity, sa.n_heads)
    x = layer.res1.output(x, sa.out_proj(out[:, 0, :]))
    q = ca.q_proj(layer.res2.input(x))  # with the row's eos key and value, which the kernel writes back unchanged
    qkv = torch.cat([q, eos], dim=-1)[:, None, :]
    out, cross_k, cross_v = StepAttention.apply(qkv, cross_k, cross_v, cross_slot, width, ca.n_heads)
    x = layer.res2.output(x, ca.out_proj(out[:, 0, :]))
    return layer.res3.output(x, layer.ffn(layer.res3.input(x))), past_k, past_v, cross_k, cross_v


class DecoderStepGraph(nn.Module):
    """One cached decoder step for rows that may each be at their own position: EncoderDecoder.decode_step
    with the cache written in place (module docstring)."""

    def __init__(self, model: EncoderDecoder):
        super().__init__()
        self.model = model

    def forward(self, tokens, positions, cross_slot, cache_slots, source_slots, *per_layer):
        m, n = self.model, len(self.model.decoder)
        past, cross, eos = per_layer[: 2 * n], per_layer[2 * n: 4 * n], per_layer[4 * n:]
        slots = positions.to(torch.int32)
        x = m._embed(tokens, positions)
        presents, cross_presents = [], []
        for i, layer in enumerate(m.decoder):
            x, pk, pv, ck, cv = _layer_step(layer, x, past[2 * i], past[2 * i + 1], slots, cache_slots, cross[2 * i],
                                            cross[2 * i + 1], eos[i], cross_slot, source_slots)
            presents += [pk, pv]
            cross_presents += [ck, cv]
        return m._log_probs(m.decoder_norm(x)), *presents, *cross_presents


class AlignerGraph(nn.Module):
    """A source and the tokens fed after it -> the last decoder layer's first head's cross-attention weights
    (EncoderDecoder.attention)."""

    def __init__(self, model: EncoderDecoder):
        super().__init__()
        self.model = model

    def forward(self, src_ids, src_mask, target_ids):
        return self.model.attention(src_ids, src_mask, target_ids)


def example_inputs(model: EncoderDecoder, batch: int = 3, src_len: int = 7, past_len: int = 5):
    """Inputs of the encoder and the decoder step at sizes > 1, so that tracing specialises no dimension."""
    c = model.config
    g = torch.Generator().manual_seed(0)
    src_ids = torch.randint(4, c.source_vocab_size or c.vocab_size, (batch, src_len), generator=g)
    src_mask = torch.ones(batch, src_len, dtype=torch.bool)
    src_mask[0, -2:] = False
    with torch.no_grad():
        cross = EncoderGraph(model)(src_ids, src_mask)  # K/V of each layer, then each layer's eos
    past = tuple(torch.randn(batch, c.n_heads, past_len + 2, c.head_dim, generator=g) for _ in range(2 * c.n_decoder_layers))
    tokens = torch.randint(4, c.vocab_size, (batch,), generator=g)
    positions = torch.tensor([past_len, past_len - 2, past_len][:batch])
    sizes = eos_slot(src_mask), torch.tensor([past_len + 2], dtype=torch.int32), torch.tensor([src_len], dtype=torch.int32)
    return (src_ids, src_mask), (tokens, positions, *sizes, *past, *cross)


def export_graphs(model: EncoderDecoder, out_dir: Path) -> dict[str, Path]:
    """Write encoder.onnx, decoder.onnx and aligner.onnx (fp32) into out_dir."""
    model = model.eval().float()
    enc_args, dec_args = example_inputs(model)
    targets = torch.randint(4, model.config.vocab_size, (enc_args[0].shape[0], 5), generator=torch.Generator().manual_seed(1))
    names, axes = io_names(model.config.n_decoder_layers), dynamic_axes(model.config.n_decoder_layers)
    paths = {name: out_dir / f"{name}.onnx" for name in ("encoder", "decoder", "aligner")}
    graphs = {"encoder": (EncoderGraph(model), enc_args), "decoder": (DecoderStepGraph(model), dec_args),
              "aligner": (AlignerGraph(model), (*enc_args, targets))}
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation and tracer warnings
        for name, (module, args) in graphs.items():
            torch.onnx.export(module, args, str(paths[name]), input_names=names[name]["inputs"],
                              output_names=names[name]["outputs"], dynamic_axes=axes[name], opset_version=OPSET,
                              dynamo=False, do_constant_folding=True,
                              custom_opsets={} if name == "aligner" else {"com.microsoft": 1})
    return paths
