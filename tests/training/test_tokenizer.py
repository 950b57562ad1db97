"""The joint SentencePiece tokenizer: fixed special ids, lossless round trip."""

from nmtserve.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Tokenizer
from nmtserve.training.data import read_tsv


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
