"""PyTorch reference decoding: greedy search with the model's KV cache, and without it.

The ONNX Runtime path (export/) and the server must give the tokens these give.
"""

from __future__ import annotations

import torch

from nmtserve.decoding import output_budget, sorted_batches
from nmtserve.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer
from nmtserve.training.data import pad
from nmtserve.training.model import EncoderDecoder, KVCache


def prefill(model: EncoderDecoder, src: torch.Tensor, src_mask: torch.Tensor):
    """Encode the sources once: cross-attention K/V (L, B, H, S, Dh) each."""
    return model.cross_kv(model.encode(src, src_mask))


def decode_one_token(model, tokens, positions, cache: KVCache, cross_k, cross_v, src_mask):
    """One cached step for every row: (B,) next tokens and their log-probs; appends to the cache."""
    log_probs, new_k, new_v = model.decode_step(tokens, positions, cache, cross_k, cross_v, src_mask)
    cache.append(new_k, new_v)
    score, token = log_probs.max(dim=-1)
    return token, score


def budgets(src_mask: torch.Tensor, max_len: int, model_max: int) -> torch.Tensor:
    """(B,) most target tokens per row; the same rule as every other decoder of the project."""
    return torch.tensor([output_budget(int(n), max_len, model_max) for n in src_mask.sum(1)], device=src_mask.device)


@torch.inference_mode()
def greedy_decode(model: EncoderDecoder, src: torch.Tensor, src_mask: torch.Tensor,
                  max_len: int = 256) -> tuple[list[list[int]], list[float]]:
    """Greedy search with the KV cache. Returns token ids (eos excluded) and summed log-probs per row."""
    batch = src.shape[0]
    cross_k, cross_v = prefill(model, src, src_mask)
    cache = KVCache.empty(model.config, batch, device=src.device, dtype=cross_k.dtype)
    tokens = torch.full((batch,), BOS_ID, dtype=torch.long, device=src.device)
    done = torch.zeros(batch, dtype=torch.bool, device=src.device)
    outputs = torch.zeros(batch, 0, dtype=torch.long, device=src.device)
    scores = torch.zeros(batch, device=src.device)
    budget = budgets(src_mask, max_len, model.config.max_len)
    for step in range(int(budget.max())):
        positions = torch.full((batch,), step, dtype=torch.long, device=src.device)
        tokens, score = decode_one_token(model, tokens, positions, cache, cross_k, cross_v, src_mask)
        scores += torch.where(done, torch.zeros_like(score), score)
        tokens = torch.where(done, torch.full_like(tokens, PAD_ID), tokens)
        outputs = torch.cat([outputs, tokens[:, None]], dim=1)
        done |= (tokens == EOS_ID) | (step + 1 >= budget)
        if bool(done.all()):
            break
    return [_strip(row) for row in outputs.tolist()], scores.tolist()


@torch.inference_mode()
def greedy_decode_uncached(model: EncoderDecoder, src: torch.Tensor, src_mask: torch.Tensor,
                           max_len: int = 256) -> list[list[int]]:
    """Greedy search that re-runs the decoder over the whole prefix every step (the reference for the cache)."""
    batch = src.shape[0]
    memory = model.encode(src, src_mask)
    prefix = torch.full((batch, 1), BOS_ID, dtype=torch.long, device=src.device)
    done = torch.zeros(batch, dtype=torch.bool, device=src.device)
    budget = budgets(src_mask, max_len, model.config.max_len)
    for step in range(int(budget.max())):
        log_probs = model.decode(prefix, memory, src_mask, torch.ones_like(prefix, dtype=torch.bool))
        tokens = log_probs[:, -1].argmax(dim=-1)
        tokens = torch.where(done, torch.full_like(tokens, PAD_ID), tokens)
        prefix = torch.cat([prefix, tokens[:, None]], dim=1)
        done |= (tokens == EOS_ID) | (step + 1 >= budget)
        if bool(done.all()):
            break
    return [_strip(row) for row in prefix[:, 1:].tolist()]


def _strip(row: list[int]) -> list[int]:
    """Tokens up to (not including) eos."""
    return row[: row.index(EOS_ID)] if EOS_ID in row else [t for t in row if t != PAD_ID]


def translate(model: EncoderDecoder, tokenizer: Tokenizer, texts: list[str], *, max_batch_size: int = 64,
              max_decoding_length: int = 256, device="cpu") -> list[str]:
    """Translate texts greedily, batching them sorted by length to cut padding."""
    ids = [tokenizer.encode(t)[: model.config.max_len] or [EOS_ID] for t in texts]
    results: list[str] = [""] * len(texts)
    model.eval()
    for rows in sorted_batches([len(i) for i in ids], max_batch_size):
        src, src_mask = pad([ids[i] for i in rows], PAD_ID)
        out, _ = greedy_decode(model, src.to(device), src_mask.to(device), max_decoding_length)
        for i, tokens in zip(rows, out):
            results[i] = tokenizer.decode(tokens)
    return results
