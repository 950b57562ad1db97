"""The CTranslate2 converter gives CTranslate2 our model: same greedy tokens (under its length rule too); and with
CTranslate2's decoding controls (target_prefix, disabled tokens, prefix_bias_beta) both engines give the same tokens."""

from types import SimpleNamespace

import ctranslate2
import numpy as np
import pytest
import torch

from nmtserve.decoding import output_budget
from nmtserve.export.build.to_ctranslate2 import convert
from nmtserve.export.build.verify import reference_tokens
from nmtserve.training.checkpoint import load_model
from nmtserve.training.data import pad, read_tsv
from nmtserve.training.decode import greedy_decode


def test_ctranslate2_matches_pytorch_tokens(tiny_checkpoint, tiny_corpus, tmp_path):
    loaded = load_model(tiny_checkpoint)
    path = convert(loaded, tmp_path / "ct2")
    sp = loaded.tokenizer.sp
    sources = [loaded.tokenizer.encode(s) for s, _ in read_tsv(tiny_corpus / "test.tsv").pairs]
    results = ctranslate2.Translator(str(path), device="cpu").translate_batch(
        [[sp.id_to_piece(i) for i in s] for s in sources], beam_size=1, max_decoding_length=256)
    got = [[sp.piece_to_id(p) for p in r.hypotheses[0]] for r in results]
    expected = reference_tokens(loaded.model, sources, batch_size=8)
    max_len = loaded.model.config.max_len
    # CTranslate2 has one length limit per call; ours is per row (2×source+10), so a row that ran
    # into our limit counts as matching when CTranslate2's longer output starts with it
    same = sum(a == b or (len(b) == output_budget(len(s), 256, max_len) and a[: len(b)] == b)
               for a, b, s in zip(got, expected, sources)) / len(sources)
    assert same >= 0.95, same


def test_length_rule_ctranslate2_gives_ctranslate2s_tokens_where_nmtserves_cap_stops_a_row(tiny_checkpoint, tiny_corpus,
                                                                                           tmp_path):
    """The offline benchmark's rule: CTranslate2's max_decoding_length alone, so that a row that never says eos
    costs both engines the same steps (under nmtserve's 2 × source + 10 cap ours would stop first)."""
    assert (output_budget(3, 256, 256, "ctranslate2"), output_budget(3, 256, 256), output_budget(3, 40, 30,
            "ctranslate2")) == (256, 16, 30)
    loaded = load_model(tiny_checkpoint)
    sp = loaded.tokenizer.sp
    sources = [loaded.tokenizer.encode(s) for s, _ in read_tsv(tiny_corpus / "test.tsv").pairs]
    results = ctranslate2.Translator(str(convert(loaded, tmp_path / "ct2")), device="cpu").translate_batch(
        [[sp.id_to_piece(i) for i in s] for s in sources], beam_size=1, max_decoding_length=60)
    got = [[sp.piece_to_id(p) for p in r.hypotheses[0]] for r in results]
    with torch.no_grad():
        ours = [greedy_decode(loaded.model.eval(), *pad([s], 0), 60, "ctranslate2")[0][0] for s in sources]
    assert any(len(t) > 2 * len(s) + 10 for t, s in zip(ours, sources))  # some rows ran past nmtserve's cap
    assert sum(a == b for a, b in zip(got, ours)) >= 0.95 * len(sources)


@pytest.fixture(scope="module")
def both(tiny_checkpoint, tiny_bundle, tiny_corpus, tmp_path_factory):
    """CTranslate2 and ONNX Runtime on the tiny model's weights; 200 training sentences, and for each the first 0
    to 3 words of its reference as a target prefix (None for 0)."""
    from nmtserve.export.runtime.translator import OnnxTranslator

    loaded = load_model(tiny_checkpoint)
    pairs = read_tsv(tiny_corpus / "train.tsv").pairs[:200]
    return SimpleNamespace(sp=loaded.tokenizer.sp, texts=[source for source, _ in pairs],
                           prefixes=[" ".join(target.split()[:i % 4]) or None for i, (_, target) in enumerate(pairs)],
                           ct2=ctranslate2.Translator(str(convert(loaded, tmp_path_factory.mktemp("ct2") / "ct2")),
                                                      device="cpu"),
                           ours=OnnxTranslator(tiny_bundle))


def _same(both, got, theirs) -> int:
    """How many of our translations have CTranslate2's tokens (its best hypothesis)."""
    return sum(t.tokens == [both.sp.piece_to_id(p) for p in r.hypotheses[0]] for t, r in zip(got, theirs))


def _pieces(both, texts) -> list:
    return [both.sp.encode(t, out_type=str) if t else None for t in texts]


# greedy on every sentence, beam 4 on at least 95% (this barely trained model's near-ties); fp32, length penalty 1
AGREEMENT = ((1, 200), (4, 190))
CT2_OPTIONS = dict(max_decoding_length=40, min_decoding_length=0, length_penalty=1.0)
OUR_OPTIONS = dict(max_decoding_length=40, length_rule="ctranslate2", length_penalty=1.0)


def test_target_prefix_gives_ctranslate2s_tokens(both):
    """translate_batch's target_prefix (CTranslate2's, as text): each sentence forced to start with its prefix, rows
    of every prefix length in one batch: CTranslate2's tokens, prefix included. CTranslate2 runs one sentence a call:
    its own results for a row change with the other rows' prefixes in a batch; ours do not (the batch-1 run)."""
    for beam, least in AGREEMENT:
        theirs = both.ct2.translate_batch(_pieces(both, both.texts), beam_size=beam, max_batch_size=1,
                                          target_prefix=_pieces(both, both.prefixes), **CT2_OPTIONS)
        got = both.ours.translate_batch(both.texts, beam_size=beam, target_prefix=both.prefixes, **OUR_OPTIONS)
        alone = both.ours.translate_batch(both.texts, beam_size=beam, target_prefix=both.prefixes, max_batch_size=1,
                                          **OUR_OPTIONS)
        assert [t.tokens for t in got] == [t.tokens for t in alone]
        assert all(t.tokens[:len(both.sp.encode(p))] == both.sp.encode(p) and t.text.startswith(p)
                   for t, p in zip(got, both.prefixes) if p)
        assert _same(both, got, theirs) >= least, beam


@pytest.mark.parametrize("option", [{"min_decoding_length": 12}, {"disable_unk": True}, {"no_repeat_ngram_size": 2},
                                    {"suppress_sequences": ["s", "le chat"]}, {"repetition_penalty": 1.5},
                                    {"repetition_penalty": 0.7}])
def test_logits_processors_give_ctranslate2s_tokens(both, option):
    """CTranslate2's min_decoding_length, disable_unk, no_repeat_ngram_size, suppress_sequences (here as target
    texts) and repetition_penalty (above 1 and below): CTranslate2's tokens on the same weights, and the option
    changes outputs (disable_unk aside: this model rarely says unk)."""
    theirs_option = {**CT2_OPTIONS, **option}
    if "suppress_sequences" in option:
        theirs_option["suppress_sequences"] = _pieces(both, option["suppress_sequences"])
    for beam, least in AGREEMENT:
        theirs = both.ct2.translate_batch(_pieces(both, both.texts), beam_size=beam, max_batch_size=32, **theirs_option)
        got = both.ours.translate_batch(both.texts, beam_size=beam, **OUR_OPTIONS, **option)
        assert _same(both, got, theirs) >= least, beam
        plain = both.ours.translate_batch(both.texts, beam_size=beam, **OUR_OPTIONS)
        assert "disable_unk" in option or any(a.tokens != b.tokens for a, b in zip(got, plain))


def test_prefix_bias_beta_gives_ctranslate2s_tokens(both):
    """prefix_bias_beta: the target prefix favoured, not forced (CTranslate2's BiasedDecoder): CTranslate2's tokens,
    and the bias changes outputs."""
    for beam, least in AGREEMENT:
        theirs = both.ct2.translate_batch(_pieces(both, both.texts), beam_size=beam, prefix_bias_beta=0.5,
                                          target_prefix=_pieces(both, both.prefixes), **CT2_OPTIONS)
        got = both.ours.translate_batch(both.texts, beam_size=beam, target_prefix=both.prefixes, prefix_bias_beta=0.5,
                                        **OUR_OPTIONS)
        assert _same(both, got, theirs) >= least, beam
        plain = both.ours.translate_batch(both.texts, beam_size=beam, **OUR_OPTIONS)
        assert any(a.tokens != b.tokens for a, b in zip(got, plain))


def test_return_attention_gives_ctranslate2s_attention(both):
    """return_attention: CTranslate2's attention (its last decoder layer's first head) at every token of the
    translations both engines agree on, forced target prefixes' tokens first; greedy in batches and beam 4 (CTranslate2
    one sentence a call: its batched beam search gives some rows another row's attention). Ours is the same whatever the
    batch, and each n-best hypothesis has its own."""
    prefixes = _pieces(both, both.prefixes)
    for beam, batch in ((1, 32), (4, 1)):
        theirs = both.ct2.translate_batch(_pieces(both, both.texts), beam_size=beam, max_batch_size=batch,
                                          target_prefix=prefixes, return_attention=True, **CT2_OPTIONS)
        got = both.ours.translate_batch(both.texts, beam_size=beam, target_prefix=both.prefixes, return_attention=True,
                                        **OUR_OPTIONS)
        same = [(t, r) for t, r in zip(got, theirs) if t.tokens == [both.sp.piece_to_id(p) for p in r.hypotheses[0]]]
        assert len(same) >= AGREEMENT[beam > 1][1], beam
        for t, r in same:
            assert np.array(t.attention).shape == (len(t.tokens), len(both.ours.tokenizer.encode(both.texts[got.index(t)])))
            np.testing.assert_allclose(t.attention, r.attention[0], atol=1e-4)
    alone = both.ours.translate_batch(both.texts[:20], beam_size=4, num_hypotheses=3, max_batch_size=1,
                                      return_attention=True, **OUR_OPTIONS)
    batched = both.ours.translate_batch(both.texts[:20], beam_size=4, num_hypotheses=3, return_attention=True,
                                        **OUR_OPTIONS)
    for a, b in zip(alone, batched):
        for x, y in zip(a.hypotheses, b.hypotheses, strict=True):
            assert x.tokens == y.tokens and len(x.attention) == len(x.tokens)
            np.testing.assert_allclose(x.attention, y.attention, atol=1e-5)
    assert all(t.attention is None for t in both.ours.translate_batch(both.texts[:4], **OUR_OPTIONS))
