"""The model: padding invariance, cached decoding equals uncached, rows at different positions."""

import pytest
import torch

from nmtserve.tokenizer import BOS_ID, PAD_ID
from nmtserve.training.decode import greedy_decode, greedy_decode_uncached
from nmtserve.training.model import EncoderDecoder, KVCache, ModelConfig

VOCAB = 50


def _model(pre_norm=False, seed=0) -> EncoderDecoder:
    torch.manual_seed(seed)
    model = EncoderDecoder(ModelConfig.preset("tiny", vocab_size=VOCAB, pre_norm=pre_norm, dropout=0.0))
    # sharpen the random model so greedy decoding is far from ties and runs long before eos
    with torch.no_grad():
        model.embed.weight.mul_(3.0)
    return model.eval()


def _batch(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    src = torch.full((len(lengths), max(lengths)), PAD_ID)
    for i, n in enumerate(lengths):
        src[i, :n] = torch.randint(4, VOCAB, (n,), generator=g)
    return src, src != PAD_ID


@pytest.mark.parametrize("pre_norm", [False, True])
def test_padding_never_changes_outputs_at_real_positions(pre_norm):
    model = _model(pre_norm)
    src, mask = _batch([5])
    tgt = torch.tensor([[BOS_ID, 7, 8, 9]])
    with torch.no_grad():
        memory = model.encode(src, mask)
        out = model.decode(tgt, memory, mask, tgt != PAD_ID)
        src_p = torch.cat([src, torch.full((1, 6), PAD_ID)], dim=1)
        tgt_p = torch.cat([tgt, torch.full((1, 3), PAD_ID)], dim=1)
        memory_p = model.encode(src_p, src_p != PAD_ID)
        out_p = model.decode(tgt_p, memory_p, src_p != PAD_ID, tgt_p != PAD_ID)
    torch.testing.assert_close(memory_p[:, :5], memory, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_p[:, :4], out, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pre_norm", [False, True])
def test_cached_greedy_gives_exactly_the_uncached_tokens(pre_norm):
    model = _model(pre_norm)
    src, mask = _batch([7, 3, 1, 12, 5])
    cached, _ = greedy_decode(model, src, mask, max_len=20)
    uncached = greedy_decode_uncached(model, src, mask, max_len=20)
    assert cached == uncached
    assert max(len(t) for t in cached) >= 10, "decoding should run long enough to exercise the cache"


def test_rows_at_different_positions_decode_like_alone():
    """Row 1 joins the running batch 4 steps after row 0: its cache slots before that are invalid."""
    model = _model()
    src, mask = _batch([6, 9])
    alone = [greedy_decode_uncached(model, src[i:i + 1, : int(mask[i].sum())], mask[i:i + 1, : int(mask[i].sum())],
                                    max_len=12)[0] for i in range(2)]
    with torch.no_grad():
        cross_k, cross_v = model.cross_kv(model.encode(src, mask))
        cache = KVCache.empty(model.config, 2)
        tokens = torch.tensor([BOS_ID, BOS_ID])
        outputs, join = [[], []], 4
        for step in range(12 + join):
            positions = torch.tensor([step, max(0, step - join)])
            active = torch.tensor([step < 12, step >= join])
            log_probs, new_k, new_v = model.decode_step(tokens, positions, cache, cross_k, cross_v, mask)
            cache.append(new_k, new_v, new_valid=active)
            assert cache.k.shape == (model.config.n_decoder_layers, 2, model.config.n_heads, step + 1, model.config.head_dim)
            nxt = log_probs.argmax(-1)
            for row in range(2):
                if active[row]:
                    outputs[row].append(int(nxt[row]))
            tokens = torch.where(active, nxt, torch.full_like(nxt, BOS_ID))
    trimmed = [o[: o.index(3)] if 3 in o else o for o in outputs]
    assert trimmed == [a[: len(t)] for a, t in zip(alone, trimmed)]
    assert trimmed == alone


def test_cache_rows_leave_without_touching_others():
    model = _model()
    src, mask = _batch([4, 8, 6])
    with torch.no_grad():
        cross_k, cross_v = model.cross_kv(model.encode(src, mask))
        cache = KVCache.empty(model.config, 3)
        tokens = torch.full((3,), BOS_ID)
        for step in range(3):
            lp, k, v = model.decode_step(tokens, torch.full((3,), step), cache, cross_k, cross_v, mask)
            cache.append(k, v)
            tokens = lp.argmax(-1)
        keep = torch.tensor([0, 2])
        small = cache.select(keep)
        assert small.k.shape[1] == 2 and small.valid.shape == (2, 3)
        lp_all, _, _ = model.decode_step(tokens, torch.full((3,), 3), cache, cross_k, cross_v, mask)
        lp_kept, _, _ = model.decode_step(tokens[keep], torch.full((2,), 3), small, cross_k[:, keep], cross_v[:, keep], mask[keep])
    torch.testing.assert_close(lp_kept, lp_all[keep], atol=1e-5, rtol=1e-5)


def test_presets_and_shared_embeddings():
    base = ModelConfig.preset("base")
    assert (base.d_model, base.d_ff, base.n_heads, base.n_encoder_layers, base.n_decoder_layers) == (512, 2048, 8, 6, 6)
    with pytest.raises(ValueError, match="unknown model preset 'huge'"):
        ModelConfig.preset("huge")
    model = _model()
    names = [n for n, _ in model.named_parameters()]
    assert sum("embed" in n for n in names) == 1  # source, target and output projection share one matrix
