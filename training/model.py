"""The Transformer of "Attention Is All You Need", read top to bottom like the paper.

EncoderDecoder.encode / cross_kv / decode_step is the interface the ONNX export
mirrors: the encoder runs once per source, the cross-attention K/V of every
decoder layer are computed once from its output, and each decoder step takes
one token per row, that row's own position and the self-attention cache, and
returns log-probabilities plus the K/V of the new token (the caller appends
them to its cache). Rows of a batch may be at different steps: the cache has a
validity mask per row (the exported step keeps each row's cache from slot 0 instead and
writes it in place: export/build/graphs.py).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

PRESETS = {
    "tiny": dict(d_model=64, n_heads=4, d_ff=128, n_encoder_layers=2, n_decoder_layers=2),
    "small": dict(d_model=256, n_heads=4, d_ff=1024, n_encoder_layers=3, n_decoder_layers=3),
    "base": dict(d_model=512, n_heads=8, d_ff=2048, n_encoder_layers=6, n_decoder_layers=6),
}


ACTIVATIONS = {"relu": F.relu, "swish": F.silu, "gelu": F.gelu}
POSITIONS = ("interleaved", "halves", "fairseq")


@dataclass
class ModelConfig:
    vocab_size: int = 4000
    d_model: int = 256
    n_heads: int = 4
    d_ff: int = 1024
    n_encoder_layers: int = 3
    n_decoder_layers: int = 3
    dropout: float = 0.1
    pre_norm: bool = False  # the paper is post-LN; pre-LN trains more stably when deep
    max_len: int = 256  # longest source or target, in tokens, that positions cover
    pad_id: int = 0
    # decoding starts from bos_id and ends at eos_id (Marian starts from pad)
    bos_id: int = 2
    eos_id: int = 3
    # what imported models need (training/marian.py); the defaults are the paper's model
    positions: str = "interleaved"  # sin/cos interleaved (the paper), "halves": sin then cos (Marian), or
    # "fairseq": sin then cos at fairseq's frequencies, from row pad_id + 1 on (M2M100, NLLB)
    activation: str = "relu"  # or "swish" (= silu) or "gelu" (exact, with erf)
    scale_embedding: bool = True  # embeddings times sqrt(d_model)
    output_bias: bool = False  # a bias on the output logits (Marian's final_logits_bias)
    suppressed_ids: tuple[int, ...] = ()  # never generated (Marian never generates pad)
    renormalize: bool = True  # suppressed before the softmax; False: after it, the rest not renormalised
    source_vocab_size: int = 0  # 0: source and target share vocab_size and one embedding; else a source table apart
    tied_output: bool = True  # the output projection is the target embedding; False: a matrix of its own

    def __post_init__(self):
        self.suppressed_ids = tuple(self.suppressed_ids)
        if self.positions not in POSITIONS:
            raise ValueError(f"positions {self.positions!r}: choose one of {', '.join(POSITIONS)}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r}: choose one of {', '.join(ACTIVATIONS)}")

    @classmethod
    def preset(cls, name: str, **overrides) -> ModelConfig:
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
        return replace(cls(**PRESETS[name]), **overrides)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class KVCache:
    """Self-attention keys and values of every decoder layer, appended per step.

    k, v: (L, B, H, T, Dh); valid: (B, T) bool — False marks slots a row never
    filled (it joined the batch later), which attention ignores.
    """

    k: torch.Tensor
    v: torch.Tensor
    valid: torch.Tensor

    @classmethod
    def empty(cls, config: ModelConfig, batch: int, device=None, dtype=torch.float32) -> KVCache:
        shape = (config.n_decoder_layers, batch, config.n_heads, 0, config.head_dim)
        return cls(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype),
                   torch.zeros(batch, 0, dtype=torch.bool, device=device))

    def append(self, new_k: torch.Tensor, new_v: torch.Tensor, new_valid: torch.Tensor | None = None) -> None:
        """Add one step: new_k/new_v (L, B, H, 1, Dh); new_valid (B,) defaults to all rows."""
        if new_valid is None:
            new_valid = torch.ones(new_k.shape[1], dtype=torch.bool, device=new_k.device)
        self.k = torch.cat([self.k, new_k], dim=3)
        self.v = torch.cat([self.v, new_v], dim=3)
        self.valid = torch.cat([self.valid, new_valid[:, None]], dim=1)

    def select(self, rows: torch.Tensor) -> KVCache:
        """Keep only `rows` (indices into the batch)."""
        return KVCache(self.k[:, rows], self.v[:, rows], self.valid[rows])


# ---------------------------------------------------------------- embeddings
class ScaledEmbedding(nn.Module):
    """Token embeddings times sqrt(d_model). The target's is the output projection too (or, untied, holds a
    projection of its own); a source vocabulary apart from the target's has a table of its own, lookup only."""

    def __init__(self, config: ModelConfig, vocab_size: int | None = None, output: bool = True):
        super().__init__()
        vocab_size = vocab_size or config.vocab_size
        self.scale = math.sqrt(config.d_model) if config.scale_embedding else 1.0
        self.weight = nn.Parameter(torch.randn(vocab_size, config.d_model) * config.d_model ** -0.5)
        self.projection = None
        if output and not config.tied_output:
            self.projection = nn.Parameter(torch.randn(vocab_size, config.d_model) * config.d_model ** -0.5)
        if output and config.output_bias:
            self.register_buffer("bias", torch.zeros(vocab_size))
        else:
            self.bias = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight) * self.scale  # (B, T, D)

    def logits(self, x: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        """(…, D) -> (…, V): x times the embedding, plus the output bias and `add` (V,), all in one linear:
        a decoder step exports one Gemm (transB) over the embedding its lookup reads too, with the bias as
        its C, not a transposed copy of the embedding and Adds over (B, V) (docs/performance-journal.md, "The output bias inside
        the Gemm": a smaller graph at the same speed)."""
        bias = self.bias if add is None else add if self.bias is None else self.bias + add
        return F.linear(x, self.weight if self.projection is None else self.projection, bias)


class SinusoidalPositions(nn.Module):
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...).

    "halves" lays the same values out as Marian does: every sin first, then every cos,
    computed in float64 as transformers' MarianSinusoidalPositionalEmbedding does. "fairseq" is
    M2M100's table (transformers' M2M100SinusoidalPositionalEmbedding, float32): sin then cos with
    frequencies 10000^(-i / (d/2 - 1)), position p of a sequence at row p + pad_id + 1.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.positions == "fairseq":
            half = config.d_model // 2
            freqs = torch.exp(torch.arange(half, dtype=torch.int64).float() * -(math.log(10000) / (half - 1)))
            rows = torch.arange(config.pad_id + 1, config.pad_id + 1 + config.max_len, dtype=torch.int64).float()
            angles = rows[:, None] * freqs[None, :]
            table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)
        elif config.positions == "halves":
            angles = torch.arange(config.max_len, dtype=torch.float64)[:, None] / torch.pow(
                10000.0, torch.arange(0, config.d_model, 2, dtype=torch.float64) / config.d_model)
            table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1).float()
        else:
            pos = torch.arange(config.max_len, dtype=torch.float32)[:, None]
            div = torch.exp(torch.arange(0, config.d_model, 2, dtype=torch.float32)
                            * (-math.log(10000.0) / config.d_model))
            table = torch.zeros(config.max_len, config.d_model)
            table[:, 0::2] = torch.sin(pos * div)
            table[:, 1::2] = torch.cos(pos * div)
        self.register_buffer("table", table, persistent=False)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return self.table[positions]  # (B, T) -> (B, T, D)


# ---------------------------------------------------------------- attention
class MultiHeadAttention(nn.Module):
    """Multi-head scaled dot-product attention; keys/values are projected separately so they can be cached."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads, self.head_dim = config.n_heads, config.head_dim
        self.q_proj = nn.Linear(config.d_model, config.d_model)
        self.k_proj = nn.Linear(config.d_model, config.d_model)
        self.v_proj = nn.Linear(config.d_model, config.d_model)
        self.out_proj = nn.Linear(config.d_model, config.d_model)
        self.dropout = config.dropout

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, Dh)

    def project_kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of x (B, T, D), each (B, H, T, Dh)."""
        return self._split(self.k_proj(x)), self._split(self.v_proj(x))

    def attend(self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Queries from x (B, Tq, D) over k/v (B, H, Tk, Dh); mask (B, 1, Tq|1, Tk) True = may attend."""
        q = self._split(self.q_proj(x))  # (B, H, Tq, Dh)
        dropout = self.dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
        b, _, t, _ = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(b, t, -1))  # (B, Tq, D)

    def attend_cached(self, x, past_k, past_v, past_valid, new_k, new_v) -> torch.Tensor:
        """One query per row, x (B, D), over its cache (B, H, T, Dh) and its own new key/value.

        Scores over the past and over the new token are normalised together, so this equals
        attending over cat(past, new) without copying the cache every step; slots with
        past_valid (B, T) False are ignored. The row's own key keeps every softmax finite.
        """
        q = self._query(x)
        past = self._scores(q, past_k, past_valid)  # (B, H, 1, T)
        own = (q * new_k).sum(-1, keepdim=True)  # (B, H, 1, 1)
        probs = torch.softmax(torch.cat([past, own], dim=-1), dim=-1)
        return self._output(probs[..., :-1] @ past_v + probs[..., -1:] * new_v)

    def attend_one(self, x, k, v, valid) -> torch.Tensor:
        """One query per row, x (B, D), over k/v (B, H, S, Dh) where valid (B, S) is True: a
        decoder step's cross-attention (every source has a valid slot: its eos)."""
        return self._output(torch.softmax(self._scores(self._query(x), k, valid), dim=-1) @ v)

    def weights(self, x: torch.Tensor, k: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Attention weights of queries from x (B, Tq, D) over keys k (B, H, Tk, Dh) -> (B, H, Tq, Tk); mask
        (B, 1, Tq|1, Tk) True = may attend."""
        q = self._split(self.q_proj(x)) * self.head_dim ** -0.5
        return torch.softmax((q @ k.transpose(-1, -2)).masked_fill(~mask, float("-inf")), dim=-1)

    # A decoder step's attention, one query per row: the PyTorch reference of the exported step, in
    # which each attention is one ONNX Runtime GroupQueryAttention node (export/build/graphs.py).
    def _query(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, D) -> scaled queries (B, H, 1, Dh)."""
        return (self.q_proj(x) * self.head_dim ** -0.5).reshape(-1, self.n_heads, 1, self.head_dim)

    @staticmethod
    def _scores(q: torch.Tensor, k: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """q (B, H, 1, Dh) over k (B, H, T, Dh) -> (B, H, 1, T), -inf where valid (B, T) is False."""
        return (q @ k.transpose(-1, -2)).masked_fill(~valid[:, None, None, :], float("-inf"))

    def _output(self, out: torch.Tensor) -> torch.Tensor:
        """Heads (B, H, 1, Dh) -> (B, D) through the output projection."""
        return self.out_proj(out.reshape(-1, self.n_heads * self.head_dim))


class FeedForward(nn.Module):
    """FFN(x) = max(0, x W1 + b1) W2 + b2 (or swish/gelu in place of max(0, ·))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(config.d_model, config.d_ff)
        self.w2 = nn.Linear(config.d_ff, config.d_model)
        self.dropout = nn.Dropout(config.dropout)
        self.activation = ACTIVATIONS[config.activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.dropout(self.activation(self.w1(x))))


class Residual(nn.Module):
    """LayerNorm(x + Dropout(Sublayer(x))) as in the paper, or x + Dropout(Sublayer(LayerNorm(x))) pre-LN."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.norm = nn.LayerNorm(config.d_model)
        self.dropout = nn.Dropout(config.dropout)
        self.pre_norm = config.pre_norm

    def input(self, x: torch.Tensor) -> torch.Tensor:
        """What the sublayer sees."""
        return self.norm(x) if self.pre_norm else x

    def output(self, x: torch.Tensor, sublayer_out: torch.Tensor) -> torch.Tensor:
        y = x + self.dropout(sublayer_out)
        return y if self.pre_norm else self.norm(y)


# ---------------------------------------------------------------- layers
class EncoderLayer(nn.Module):
    """Self-attention then feed-forward, each in a residual block."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.self_attn, self.ffn = MultiHeadAttention(config), FeedForward(config)
        self.res1, self.res2 = Residual(config), Residual(config)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.res1.input(x)
        k, v = self.self_attn.project_kv(h)
        x = self.res1.output(x, self.self_attn.attend(h, k, v, mask))
        return self.res2.output(x, self.ffn(self.res2.input(x)))


class DecoderLayer(nn.Module):
    """Masked self-attention, cross-attention over the encoder output, feed-forward."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.self_attn, self.cross_attn, self.ffn = MultiHeadAttention(config), MultiHeadAttention(config), FeedForward(config)
        self.res1, self.res2, self.res3 = Residual(config), Residual(config), Residual(config)

    def forward(self, x, self_mask, cross_k, cross_v, cross_mask):
        """All target positions at once: x (B, T, D), self_mask (B, 1, T, T) causal and padding."""
        h = self.res1.input(x)
        k, v = self.self_attn.project_kv(h)
        x = self.res1.output(x, self.self_attn.attend(h, k, v, self_mask))
        return self._cross_and_ffn(x, cross_k, cross_v, cross_mask)

    def step(self, x, past_k, past_v, past_valid, cross_k, cross_v, cross_mask):
        """One new position per row: x (B, D), past_k/v (B, H, T, Dh), past_valid (B, T),
        cross_k/v (B, H, S, Dh), cross_mask (B, S).

        Returns (x, new_k, new_v), x (B, D), new_k/v (B, H, 1, Dh): the new token's keys and values.
        """
        h = self.res1.input(x)
        sa = self.self_attn
        new_k = sa.k_proj(h).reshape(-1, sa.n_heads, 1, sa.head_dim)  # T = 1: no transpose needed
        new_v = sa.v_proj(h).reshape(-1, sa.n_heads, 1, sa.head_dim)
        x = self.res1.output(x, sa.attend_cached(h, past_k, past_v, past_valid, new_k, new_v))
        x = self.res2.output(x, self.cross_attn.attend_one(self.res2.input(x), cross_k, cross_v, cross_mask))
        return self.res3.output(x, self.ffn(self.res3.input(x))), new_k, new_v

    def cross_weights(self, x, self_mask, cross_k, cross_mask):
        """The cross-attention weights (B, H, T, S) of forward's positions: its self-attention, then its
        cross-attention's softmax alone."""
        h = self.res1.input(x)
        k, v = self.self_attn.project_kv(h)
        x = self.res1.output(x, self.self_attn.attend(h, k, v, self_mask))
        return self.cross_attn.weights(self.res2.input(x), cross_k, cross_mask)

    def _cross_and_ffn(self, x, cross_k, cross_v, cross_mask):
        x = self.res2.output(x, self.cross_attn.attend(self.res2.input(x), cross_k, cross_v, cross_mask))
        return self.res3.output(x, self.ffn(self.res3.input(x)))


# ---------------------------------------------------------------- the model
class EncoderDecoder(nn.Module):
    """Encoder and decoder stacks over shared scaled embeddings and sinusoidal positions."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed = ScaledEmbedding(config)
        self.source_embed = ScaledEmbedding(config, config.source_vocab_size, output=False) \
            if config.source_vocab_size else None
        self.positions = SinusoidalPositions(config)
        self.embed_dropout = nn.Dropout(config.dropout)
        self.encoder = nn.ModuleList(EncoderLayer(config) for _ in range(config.n_encoder_layers))
        self.decoder = nn.ModuleList(DecoderLayer(config) for _ in range(config.n_decoder_layers))
        # pre-LN stacks end with a LayerNorm; post-LN outputs are already normalised
        self.encoder_norm = nn.LayerNorm(config.d_model) if config.pre_norm else nn.Identity()
        self.decoder_norm = nn.LayerNorm(config.d_model) if config.pre_norm else nn.Identity()
        if config.suppressed_ids:  # 0, or -inf at each suppressed id
            suppress = torch.zeros(config.vocab_size)
            suppress[list(config.suppressed_ids)] = float("-inf")
            self.register_buffer("suppress", suppress, persistent=False)
        else:
            self.suppress = None
        for name, p in self.named_parameters():
            if p.dim() > 1 and not name.startswith(("embed.", "source_embed.")):
                nn.init.xavier_uniform_(p)

    def _log_probs(self, x: torch.Tensor) -> torch.Tensor:
        """Output log-probabilities (…, V) of decoder states x (…, D); suppressed ids get -inf."""
        if self.suppress is None or self.config.renormalize:  # suppressed in the logits (inside the Gemm)
            return F.log_softmax(self.embed.logits(x, add=self.suppress).float(), dim=-1)
        return F.log_softmax(self.embed.logits(x).float(), dim=-1) + self.suppress

    def _embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Target ids (B, T) at positions (B, T) -> the decoder's input rows."""
        return self.embed_dropout(self.embed(ids) + self.positions(positions))

    def _embed_source(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Source ids -> the encoder's input rows (the target's table unless the source has its own)."""
        table = self.embed if self.source_embed is None else self.source_embed
        return self.embed_dropout(table(ids) + self.positions(positions))

    # -- encoder
    def encode(self, src: torch.Tensor, src_mask: torch.Tensor) -> torch.Tensor:
        """src (B, S) ids, src_mask (B, S) True at real tokens -> memory (B, S, D)."""
        positions = torch.arange(src.shape[1], device=src.device)[None, :].expand_as(src)
        x = self._embed_source(src, positions)
        attn_mask = src_mask[:, None, None, :]  # (B, 1, 1, S)
        for layer in self.encoder:
            x = layer(x, attn_mask)
        return self.encoder_norm(x)

    def cross_kv(self, memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cross-attention keys and values of every decoder layer, each (L, B, H, S, Dh); computed once per source."""
        kv = [layer.cross_attn.project_kv(memory) for layer in self.decoder]
        return torch.stack([k for k, _ in kv]), torch.stack([v for _, v in kv])

    # -- decoder, all target positions at once (training, uncached reference)
    def decode(self, tgt: torch.Tensor, memory: torch.Tensor, src_mask: torch.Tensor,
               tgt_mask: torch.Tensor) -> torch.Tensor:
        """tgt (B, T) ids (bos-first), tgt_mask (B, T) True at real tokens -> log-probs (B, T, V)."""
        cross_k, cross_v = self.cross_kv(memory)
        t = tgt.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=tgt.device).tril()
        self_mask = causal[None, None] & tgt_mask[:, None, None, :]  # (B, 1, T, T)
        positions = torch.arange(t, device=tgt.device)[None, :].expand_as(tgt)
        x = self._embed(tgt, positions)
        cross_mask = src_mask[:, None, None, :]
        for i, layer in enumerate(self.decoder):
            x = layer(x, self_mask, cross_k[i], cross_v[i], cross_mask)
        return self._log_probs(self.decoder_norm(x))

    def forward(self, src, src_mask, tgt, tgt_mask) -> torch.Tensor:
        return self.decode(tgt, self.encode(src, src_mask), src_mask, tgt_mask)

    def attention(self, src: torch.Tensor, src_mask: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        """The last decoder layer's cross-attention weights of its first head, CTranslate2's return_attention (its
        default alignment_layer -1, alignment_heads 1): tgt (B, T) ids, start token first -> (B, T, S), at each
        target position its weights over the source (what the step that decodes the next token attends to).
        A row's padding after its tokens changes none of its positions before it (causal self-attention)."""
        memory = self.encode(src, src_mask)
        t = tgt.shape[1]
        self_mask = torch.ones(t, t, dtype=torch.bool, device=tgt.device).tril()[None, None]
        x = self._embed(tgt, torch.arange(t, device=tgt.device)[None, :].expand_as(tgt))
        cross_mask = src_mask[:, None, None, :]
        *layers, last = self.decoder
        for layer in layers:
            x = layer(x, self_mask, *layer.cross_attn.project_kv(memory), cross_mask)
        return last.cross_weights(x, self_mask, last.cross_attn.project_kv(memory)[0], cross_mask)[:, 0]

    # -- decoder, one step with a KV cache (inference; export/build/graphs.py mirrors it)
    def decode_step(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                    cross_k: torch.Tensor, cross_v: torch.Tensor, src_mask: torch.Tensor):
        """One new token per row.

        tokens (B,), positions (B,) — each row's own step; cache k/v (L, B, H, T, Dh)
        with valid (B, T); cross_k/v (L, B, H, S, Dh); src_mask (B, S).
        Returns log-probs (B, V) and the new token's k/v, each (L, B, H, 1, Dh).
        """
        x = self._embed(tokens, positions)  # (B, D)
        new_k, new_v = [], []
        for layer, pk, pv, ck, cv in zip(self.decoder, cache.k, cache.v, cross_k, cross_v):
            x, k, v = layer.step(x, pk, pv, cache.valid, ck, cv, src_mask)
            new_k.append(k)
            new_v.append(v)
        log_probs = self._log_probs(self.decoder_norm(x))  # (B, V)
        return log_probs, torch.stack(new_k), torch.stack(new_v)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
