"""PyTorch reference decoding over the model's KV cache: greedy search (and greedy without the cache),
beam search with n-best lists, and random sampling.

The ONNX Runtime path (export/) and the server must give the tokens these give. Beam search and
sampling follow the rules nmtserve/search.py states (CTranslate2's); beam search is written here on
its own, batched over flattened beams as CTranslate2 does, so that the two implementations check each
other; sampling draws with the same rule (`sample_index`), so that a seed gives the same tokens.
"""

from __future__ import annotations

import numpy as np
import torch

from nmtserve.decoding import output_budget, sorted_batches
from nmtserve.sampling import sample_index
from nmtserve.tokenizer import MarianTokenizer, Tokenizer
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


def budgets(src_mask: torch.Tensor, max_len: int, model_max: int, length_rule: str = "nmtserve") -> torch.Tensor:
    """(B,) most target tokens per row; the same rule as every other decoder of the project."""
    return torch.tensor([output_budget(int(n), max_len, model_max, length_rule) for n in src_mask.sum(1)],
                        device=src_mask.device)


@torch.inference_mode()
def greedy_decode(model: EncoderDecoder, src: torch.Tensor, src_mask: torch.Tensor, max_len: int = 256,
                  length_rule: str = "nmtserve") -> tuple[list[list[int]], list[float]]:
    """Greedy search with the KV cache. Returns token ids (eos excluded) and summed log-probs per row."""
    batch = src.shape[0]
    cross_k, cross_v = prefill(model, src, src_mask)
    cache = KVCache.empty(model.config, batch, device=src.device, dtype=cross_k.dtype)
    tokens = torch.full((batch,), model.config.bos_id, dtype=torch.long, device=src.device)
    done = torch.zeros(batch, dtype=torch.bool, device=src.device)
    outputs = torch.zeros(batch, 0, dtype=torch.long, device=src.device)
    scores = torch.zeros(batch, device=src.device)
    budget = budgets(src_mask, max_len, model.config.max_len, length_rule)
    for step in range(int(budget.max())):
        positions = torch.full((batch,), step, dtype=torch.long, device=src.device)
        tokens, score = decode_one_token(model, tokens, positions, cache, cross_k, cross_v, src_mask)
        scores += torch.where(done, torch.zeros_like(score), score)
        tokens = torch.where(done, torch.full_like(tokens, model.config.pad_id), tokens)
        outputs = torch.cat([outputs, tokens[:, None]], dim=1)
        done |= (tokens == model.config.eos_id) | (step + 1 >= budget)
        if bool(done.all()):
            break
    return [_strip(row, model.config.eos_id, model.config.pad_id) for row in outputs.tolist()], scores.tolist()


@torch.inference_mode()
def greedy_decode_uncached(model: EncoderDecoder, src: torch.Tensor, src_mask: torch.Tensor,
                           max_len: int = 256) -> list[list[int]]:
    """Greedy search that re-runs the decoder over the whole prefix every step (the reference for the cache)."""
    batch = src.shape[0]
    memory = model.encode(src, src_mask)
    prefix = torch.full((batch, 1), model.config.bos_id, dtype=torch.long, device=src.device)
    done = torch.zeros(batch, dtype=torch.bool, device=src.device)
    budget = budgets(src_mask, max_len, model.config.max_len)
    for step in range(int(budget.max())):
        log_probs = model.decode(prefix, memory, src_mask, torch.ones_like(prefix, dtype=torch.bool))
        tokens = log_probs[:, -1].argmax(dim=-1)
        tokens = torch.where(done, torch.full_like(tokens, model.config.pad_id), tokens)
        prefix = torch.cat([prefix, tokens[:, None]], dim=1)
        done |= (tokens == model.config.eos_id) | (step + 1 >= budget)
        if bool(done.all()):
            break
    return [_strip(row, model.config.eos_id, model.config.pad_id) for row in prefix[:, 1:].tolist()]


@torch.inference_mode()
def beam_search(model: EncoderDecoder, src: torch.Tensor, src_mask: torch.Tensor, *, beam_size: int = 4,
                num_hypotheses: int = 1, length_penalty: float = 0.0, patience: float = 1.0,
                beam_stopping: str = "ctranslate2", max_decoding_length: int = 256, length_rule: str = "nmtserve",
                no_repeat_ngram_size: int = 0, repetition_penalty: float = 1.0) -> list[list[tuple[list[int], float]]]:
    """The n-best (tokens, score) of each source, best first, by nmtserve/search.py's BeamSearch rules.

    Each source's k beams are rows b·k … b·k + k − 1 of one batch; every step the (k × V) extensions of
    a source are sorted (stable: ties go to the lower row, then the lower token id), and the cache rows
    are gathered from their parents. Optional, here only: no_repeat_ngram_size bans a token that would
    repeat an n-gram of the hypothesis; repetition_penalty multiplies the log-probabilities of tokens the
    hypothesis already holds (they are negative, so > 1 lowers them), then renormalises.
    """
    n, k, device = src.shape[0], beam_size, src.device
    cross_k, cross_v = prefill(model, src, src_mask)
    beams = torch.arange(n, device=device).repeat_interleave(k)  # (n·k,) the source of each row
    cross_k, cross_v, mask = cross_k[:, beams], cross_v[:, beams], src_mask[beams]
    cache = KVCache.empty(model.config, n * k, device=device, dtype=cross_k.dtype)
    tokens = torch.full((n * k,), model.config.bos_id, dtype=torch.long, device=device)
    scores = torch.full((n, k), float("-inf"), device=device)
    scores[:, 0] = 0.0  # the first step extends beam 0 only: every beam holds the same start
    seqs: list[list[int]] = [[] for _ in range(n * k)]
    budget = budgets(src_mask, max_decoding_length, model.config.max_len, length_rule).tolist()
    forced_eos = length_rule == "transformers"  # after the budget's last step, every live beam ends with eos
    finished: list[list[tuple[list[int], float, bool]]] = [[] for _ in range(n)]
    top_finished, done = [False] * n, [False] * n
    for step in range(max(budget)):
        positions = torch.full((n * k,), step, dtype=torch.long, device=device)
        log_probs, new_k, new_v = model.decode_step(tokens, positions, cache, cross_k, cross_v, mask)
        cache.append(new_k, new_v)
        log_probs = _penalise(log_probs, seqs, no_repeat_ngram_size, repetition_penalty)
        total = (scores.reshape(-1, 1) + log_probs).reshape(n, -1)  # (n, k·V): flat index = beam·V + token
        cand_scores, flat = torch.sort(total, dim=1, descending=True, stable=True)
        cand_scores, flat = cand_scores[:, : 2 * k].tolist(), flat[:, : 2 * k]
        cand_beam, cand_token = (flat // log_probs.shape[1]).tolist(), (flat % log_probs.shape[1]).tolist()
        parents, next_tokens, next_scores = [], [], []
        for b in range(n):
            last, spare, row = step + 1 == budget[b], k, []
            for i in range(k):
                c = i
                if not done[b] and (cand_token[b][i] == model.config.eos_id or last and not forced_eos):
                    eos = cand_token[b][i] == model.config.eos_id
                    hyp = seqs[b * k + cand_beam[b][i]] + ([] if eos else [cand_token[b][i]])
                    finished[b].append((hyp, cand_scores[b][i], eos))
                    top_finished[b] |= i == 0
                    spare = next((j for j in range(spare, 2 * k) if cand_token[b][j] != model.config.eos_id), 2 * k)
                    if spare < 2 * k:
                        c, spare = spare, spare + 1
                row.append(c)
            parents += [b * k + cand_beam[b][c] for c in row]
            next_tokens += [cand_token[b][c] for c in row]
            next_scores.append([cand_scores[b][c] for c in row])
            if beam_stopping == "transformers":  # can the best live beam beat the worst of the k best finished?
                normalised = sorted(score / (len(hyp) + eos) ** length_penalty for hyp, score, eos in finished[b])
                stop = len(normalised) >= k and max(next_scores[-1]) / (step + 1) ** length_penalty \
                    <= normalised[-k]
            elif length_penalty == 0:
                stop = top_finished[b] and len(finished[b]) >= num_hypotheses
            else:
                stop = len(finished[b]) >= round(k * patience)
            if last and forced_eos and not done[b] and not stop:
                finished[b] += [(seqs[b * k + cand_beam[b][c]] + [cand_token[b][c]], cand_scores[b][c], True)
                                for c in row if cand_scores[b][c] > float("-inf")]
            done[b] = done[b] or last or stop
        if all(done):
            break
        index = torch.tensor(parents, device=device)
        cache = cache.select(index)
        seqs = [seqs[p] + [t] for p, t in zip(parents, next_tokens)]
        tokens = torch.tensor(next_tokens, device=device)
        scores = torch.tensor(next_scores, device=device)
    return [sorted(((hyp, score / (len(hyp) + eos) ** length_penalty if length_penalty else score)
                    for hyp, score, eos in found), key=lambda h: -h[1])[:num_hypotheses] for found in finished]


def _penalise(log_probs: torch.Tensor, seqs: list[list[int]], no_repeat_ngram_size: int,
              repetition_penalty: float) -> torch.Tensor:
    """log_probs (R, V) of rows whose hypotheses are `seqs`, with the optional penalties applied."""
    if repetition_penalty != 1.0:
        log_probs = log_probs.clone()
        for r, seq in enumerate(seqs):
            if seq:
                seen = torch.tensor(sorted(set(seq)), device=log_probs.device)
                log_probs[r, seen] *= repetition_penalty
        log_probs = torch.log_softmax(log_probs, dim=-1)
    if no_repeat_ngram_size > 0:
        log_probs = log_probs.clone() if repetition_penalty == 1.0 else log_probs
        n = no_repeat_ngram_size
        for r, seq in enumerate(seqs):
            tail = tuple(seq[len(seq) - n + 1:]) if n > 1 else ()
            if len(seq) >= n - 1:
                banned = [seq[i + n - 1] for i in range(len(seq) - n + 1) if tuple(seq[i:i + n - 1]) == tail]
                log_probs[r, banned] = float("-inf")
    return log_probs


@torch.inference_mode()
def sample(model: EncoderDecoder, src: torch.Tensor, src_mask: torch.Tensor, *, sampling_topk: int = 0,
           sampling_topp: float = 1.0, sampling_temperature: float = 1.0, seed: int = 1,
           max_decoding_length: int = 256, length_rule: str = "nmtserve") -> list[tuple[list[int], float]]:
    """Random sampling, one row per source, each with its own generator seeded with `seed`: the best
    sampling_topk tokens (all if 0), sorted best first (ties: lower id), drawn by `sample_index`."""
    n, device = src.shape[0], src.device
    cross_k, cross_v = prefill(model, src, src_mask)
    cache = KVCache.empty(model.config, n, device=device, dtype=cross_k.dtype)
    rngs = [np.random.Generator(np.random.PCG64(seed)) for _ in range(n)]
    tokens = torch.full((n,), model.config.bos_id, dtype=torch.long, device=device)
    budget = budgets(src_mask, max_decoding_length, model.config.max_len, length_rule).tolist()
    outputs: list[list[int]] = [[] for _ in range(n)]
    scores, done = [0.0] * n, [False] * n
    for step in range(max(budget)):
        positions = torch.full((n,), step, dtype=torch.long, device=device)
        log_probs, new_k, new_v = model.decode_step(tokens, positions, cache, cross_k, cross_v, src_mask)
        cache.append(new_k, new_v)
        best, ids = torch.sort(log_probs, dim=1, descending=True, stable=True)
        if sampling_topk:
            best, ids = best[:, :sampling_topk], ids[:, :sampling_topk]
        picked = []
        for r in range(n):
            i = sample_index(best[r].numpy(), sampling_temperature, sampling_topp, rngs[r])
            token = int(ids[r, i])
            picked.append(token)
            if done[r]:
                continue
            scores[r] += float(best[r, i])
            if token == model.config.eos_id:
                done[r] = True
            else:
                outputs[r].append(token)
                done[r] = len(outputs[r]) >= budget[r]
        if all(done):
            break
        tokens = torch.tensor(picked, device=device)
    return list(zip(outputs, scores))


def _strip(row: list[int], eos_id: int, pad_id: int) -> list[int]:
    """Tokens up to (not including) eos."""
    return row[: row.index(eos_id)] if eos_id in row else [t for t in row if t != pad_id]


def translate(model: EncoderDecoder, tokenizer: Tokenizer | MarianTokenizer, texts: list[str], *, max_batch_size: int = 64,
              max_decoding_length: int = 256, length_rule: str = "nmtserve", device="cpu") -> list[str]:
    """Translate texts greedily, batching them sorted by length to cut padding."""
    ids = [tokenizer.encode(t, model.config.max_len) or [tokenizer.eos_id] for t in texts]
    results: list[str] = [""] * len(texts)
    model.eval()
    for rows in sorted_batches([len(i) for i in ids], max_batch_size):
        src, src_mask = pad([ids[i] for i in rows], model.config.pad_id)
        out, _ = greedy_decode(model, src.to(device), src_mask.to(device), max_decoding_length, length_rule)
        for i, tokens in zip(rows, out):
            results[i] = tokenizer.decode(tokens)
    return results
