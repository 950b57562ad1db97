"""The joint SentencePiece tokenizer: fixed special ids, lossless round trip; a stream's text decoded
incrementally."""

import random

from nmtserve.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Tokenizer
from nmtserve.training.data import read_tsv
from tests.helpers import stream_decoded


def test_round_trip_and_special_ids(tiny_corpus):
    pairs = read_tsv(tiny_corpus / "train.tsv").pairs
    tok = Tokenizer.train((s for p in pairs for s in p), vocab_size=400)
    assert (tok.pad_id, tok.unk_id, tok.bos_id, tok.eos_id) == (PAD_ID, UNK_ID, BOS_ID, EOS_ID) == (0, 1, 2, 3)
    assert tok.sp.id_to_piece(PAD_ID) == "<pad>" and tok.sp.id_to_piece(EOS_ID) == "</s>"
    for src, tgt in pairs[:100]:
        for text in (src, tgt):
            ids = tok.encode(text)
            assert PAD_ID not in ids and UNK_ID not in ids
            assert tok.decode(ids) == text
    assert tok.decode([BOS_ID] + tok.encode(pairs[0][1]) + [EOS_ID, PAD_ID]) == pairs[0][1]
    again = Tokenizer(tok.model_proto)
    assert again.encode(pairs[0][0]) == tok.encode(pairs[0][0])


def test_stream_text_joins_to_the_whole_and_decodes_only_a_window(tiny_corpus):
    pairs = read_tsv(tiny_corpus / "train.tsv").pairs
    tok = Tokenizer.train((s for p in pairs for s in p), vocab_size=400)
    rng = random.Random(0)
    for _, target in pairs[:200]:
        ids = tok.encode(target)
        text, _ = stream_decoded(tok.decode, ids, rng)
        assert text == tok.decode(ids) == target
    # a long stream (40 sentences, ~500 ids): each add decodes the ids since the previous delta's start,
    # so the work is linear in the length (decoding the whole prefix each time: ~n²/2 ids)
    long = " ".join(target for _, target in pairs[:40])
    ids = tok.encode(long)
    text, windows = stream_decoded(tok.decode, ids, rng)
    assert text == long and len(ids) > 400
    assert sum(windows) <= 6 * len(ids)
