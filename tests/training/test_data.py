"""Reading user corpora: clear errors for malformed input, skipped lines counted."""

import pytest

from nmtserve.errors import CorpusError
from nmtserve.training.data import read_corpus, read_moses, read_tsv, token_batches
from tests.helpers import run_cli


def test_tsv_ignores_extra_columns_and_counts_skipped_lines(tmp_path):
    path = tmp_path / "tatoeba.tsv"
    long = "x" * 1001
    path.write_text(f"Go.\tVa !\tCC-BY 2.0 (France) Attribution: tatoeba.org #2877272\n\n \tvide\n{long}\tlong\nHi.\tSalut.\n",
                    encoding="utf-8")
    corpus = read_tsv(path)
    assert corpus.pairs == [("Go.", "Va !"), ("Hi.", "Salut.")]
    assert (corpus.stats.read, corpus.stats.kept, corpus.stats.skipped_empty, corpus.stats.skipped_too_long) == (5, 2, 2, 1)


def test_tsv_missing_column_names_file_and_line(tmp_path):
    path = tmp_path / "bad.tsv"
    path.write_text("a\tb\nno tab here\n", encoding="utf-8")
    with pytest.raises(CorpusError, match=r"bad\.tsv:2: missing column"):
        read_tsv(path)


def test_moses_pair_reads_aligned_lines_and_rejects_unequal_counts(tmp_path):
    src, tgt = tmp_path / "c.en", tmp_path / "c.fr"
    src.write_text("one\ntwo\n\n", encoding="utf-8")
    tgt.write_text("un\ndeux\n\n", encoding="utf-8")
    corpus = read_moses(src, tgt)
    assert corpus.pairs == [("one", "un"), ("two", "deux")] and corpus.stats.skipped_empty == 1
    tgt.write_text("un\n", encoding="utf-8")
    with pytest.raises(CorpusError, match=r"c\.en has 3 lines but .*c\.fr has 1: unequal line counts"):
        read_corpus([src, tgt])


def test_missing_and_binary_files_get_one_clear_error(tmp_path):
    with pytest.raises(CorpusError, match="no such corpus file"):
        read_tsv(tmp_path / "absent.tsv")
    binary = tmp_path / "bin.tsv"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(CorpusError, match="not UTF-8"):
        read_tsv(binary)


def test_cli_train_on_malformed_corpus_is_one_line_and_exit_2(tmp_path):
    path = tmp_path / "bad.tsv"
    path.write_text("a\tb\nbroken\n", encoding="utf-8")
    result = run_cli("train", "--train", str(path), "--out", str(tmp_path / "run"), "--max-steps", "1")
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert "bad.tsv:2: missing column" in result.stderr and "Traceback" not in result.stderr


def test_token_batches_respect_budget_and_cover_every_example_once():
    lengths = [((i * 7) % 23) + 1 for i in range(500)]
    batches = token_batches(lengths, max_tokens=64, seed=1, epoch=0)
    assert sorted(i for b in batches for i in b) == list(range(500))
    assert all(max(lengths[i] for i in b) * len(b) <= 64 for b in batches)
    assert token_batches(lengths, 64, 1, 0) == batches != token_batches(lengths, 64, 1, 1)
