"""Marian import: tokenization, weights and log-probabilities equal transformers'; variants
nmtserve cannot represent are refused with one line naming the key."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from nmtserve.loadtests.marian_model import ENGLISH, ODD, build_marian_dir, sentences
from nmtserve.tokenizer import MarianTokenizer
from nmtserve.training.checkpoint import load_model
from nmtserve.training.marian import ImportRefused, import_marian
from nmtserve.training.model import KVCache
from tests.helpers import run_cli, stream_decoded


def reference(marian_dir):
    from transformers import MarianMTModel
    from transformers import MarianTokenizer as HFTokenizer

    tok = HFTokenizer(str(marian_dir / "source.spm"), str(marian_dir / "target.spm"), str(marian_dir / "vocab.json"))
    return tok, MarianMTModel.from_pretrained(marian_dir, dtype=torch.float32).eval()


def test_token_ids_and_text_equal_marian_tokenizers(marian_dir):
    hf, _ = reference(marian_dir)
    ours = MarianTokenizer.from_files(marian_dir)
    texts = sentences(ENGLISH, 60, 3) + ODD
    for text in texts:  # an empty text is [] for nmtserve (nothing to translate), [eos] for transformers
        assert (ours.encode(text) or [ours.eos_id]) == hf(text)["input_ids"], text
    assert any(hf.unk_token_id in hf(t)["input_ids"] for t in texts)  # the <unk> fallback was exercised
    for text in texts[:20]:
        ids = ours.encode(text)
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True, use_source_tokenizer=False)
    assert ours.encode(texts[0], max_tokens=3)[-1] == ours.eos_id and len(ours.encode(texts[0], max_tokens=3)) == 3


def test_log_probs_equal_marian_mt_models(marian_dir, marian_checkpoint):
    tok, hf = reference(marian_dir)
    loaded = load_model(marian_checkpoint)
    model, c = loaded.model, loaded.model.config
    suppress = torch.zeros(c.vocab_size)
    suppress[list(c.suppressed_ids)] = float("-inf")  # generate's bad_words_ids, renormalised
    worst = 0.0
    for batch, src_len, tgt_len in [(1, 1, 1), (1, 9, 5), (3, 7, 12), (4, 30, 20)]:
        g = torch.Generator().manual_seed(batch * 100 + src_len)
        src = torch.randint(2, c.vocab_size - 1, (batch, src_len), generator=g)
        src_mask = torch.ones(batch, src_len, dtype=torch.bool)
        src_mask[1:, src_len // 2 + 1:] = False  # padded rows
        src = src.masked_fill(~src_mask, c.pad_id)
        tgt = torch.cat([torch.full((batch, 1), c.bos_id), torch.randint(2, c.vocab_size - 1, (batch, tgt_len - 1),
                                                                         generator=g)], dim=1)
        with torch.no_grad():
            logits = hf(input_ids=src, attention_mask=src_mask.long(), decoder_input_ids=tgt).logits
            expected = torch.log_softmax(logits + suppress, dim=-1)
            got = model(src, src_mask, tgt, torch.ones_like(tgt, dtype=torch.bool))
            # and step by step through the KV cache, as the ONNX decoder does
            cross_k, cross_v = model.cross_kv(model.encode(src, src_mask))
            cache = KVCache.empty(c, batch)
            for t in range(tgt_len):
                step, new_k, new_v = model.decode_step(tgt[:, t], torch.full((batch,), t), cache, cross_k, cross_v,
                                                       src_mask)
                cache.append(new_k, new_v)
                finite = torch.isfinite(expected[:, t])
                worst = max(worst, float((step - expected[:, t])[finite].abs().max()))
        finite = torch.isfinite(expected)
        assert torch.equal(finite, torch.isfinite(got))
        worst = max(worst, float((got - expected)[finite].abs().max()))
    assert worst < 1e-4, worst


def test_checkpoint_records_origin_and_generation_defaults(marian_dir, marian_checkpoint):
    payload = torch.load(marian_checkpoint, weights_only=False)
    origin = payload["imported_from"]
    assert origin["format"] == "marian" and set(origin["files"]) >= {"config.json", "vocab.json", "source.spm"}
    assert origin["config"] == json.loads((marian_dir / "config.json").read_text())
    assert payload["decoding_defaults"] == {"beam_size": 4, "length_penalty": 1.0, "beam_stopping": "transformers",
                                           "max_decoding_length": 39}
    assert payload["languages"] == {"source": "en", "target": "fr"}
    assert list(payload["model_config"]["suppressed_ids"]) == [payload["special_ids"]["pad"]]


@pytest.mark.parametrize("marian_dir", ["swish"], indirect=True)
@pytest.mark.parametrize("key, value", [
    ("decoder_vocab_size", 7),
    ("decoder_attention_heads", 2),
    ("activation_function", "tanh"),
    ("normalize_embedding", True),
    ("model_type", "bart"),
])
def test_unrepresentable_variants_are_refused_naming_the_key(marian_dir, tmp_path, key, value):
    bad = tmp_path / "bad"
    shutil.copytree(marian_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    config[key] = value
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ImportRefused, match=f"config.json: {key}={json.dumps(value)}"):
        import_marian(bad, tmp_path / "x.pt")
    result = run_cli("import", str(bad), "--out", str(tmp_path / "x.pt"))
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert key in result.stderr and not (tmp_path / "x.pt").exists()


def test_missing_files_and_multilingual_target_are_named(tmp_path):
    d = build_marian_dir(tmp_path / "multi", languages=("fr", "de"))
    tok = MarianTokenizer.from_files(d)
    assert tok.target_languages == ["de", "fr"]
    assert tok.encode("the cat", target_language="de")[0] == tok.vocab[">>de<<"]
    with pytest.raises(ValueError, match="'es'.*de, fr"):
        tok.encode("the cat", target_language="es")
    with pytest.raises(ImportRefused, match="--target-lang es"):
        import_marian(d, tmp_path / "m.pt", "en", "es")
    (d / "target.spm").unlink()
    result = run_cli("import", str(d), "--out", str(tmp_path / "m.pt"))
    assert result.returncode == 2 and "target.spm: missing" in result.stderr


@pytest.mark.parametrize("length_rule", ["nmtserve", "transformers"])
def test_reference_beam_search_with_transformers_stopping_equals_generate(marian_dir, marian_checkpoint, length_rule):
    """Under length_rule "transformers" generate keeps its own max_length and forced eos."""
    from nmtserve.decoding import output_budget
    from nmtserve.training.decode import beam_search

    _, hf = reference(marian_dir)
    loaded = load_model(marian_checkpoint)
    eos, pad = loaded.tokenizer.eos_id, loaded.tokenizer.pad_id
    at_limit = 0
    for text in sentences(ENGLISH, 20, 11):
        ids = loaded.tokenizer.encode(text)
        src = torch.tensor([ids])
        got = beam_search(loaded.model, src, torch.ones_like(src, dtype=torch.bool), beam_size=4, num_hypotheses=4,
                          length_penalty=1.0, beam_stopping="transformers", max_decoding_length=39,
                          length_rule=length_rule)[0]
        limits = dict(max_length=40, forced_eos_token_id=eos) if length_rule == "transformers" else \
            dict(max_new_tokens=output_budget(len(ids), 39, loaded.model.config.max_len), forced_eos_token_id=None)
        out = hf.generate(src, num_beams=4, num_return_sequences=4, length_penalty=1.0, **limits)
        expected = [[t for t in seq[1:] if t not in (eos, pad)] for seq in out.tolist()]
        assert [tokens for tokens, _ in got] == expected, text
        at_limit += any(len(tokens) == 38 for tokens in expected)
    assert length_rule == "nmtserve" or at_limit >= 3  # the forced eos decided some n-best lists


def test_translate_cli_uses_the_imported_models_defaults(marian_checkpoint):
    text = "The cat sees the dog."
    default = run_cli("translate", "--json", str(marian_checkpoint), text)
    explicit = run_cli("translate", "--json", "--beam-size", "4", "--length-penalty", "1", "--beam-stopping",
                       "transformers", str(marian_checkpoint), text)
    assert default.returncode == explicit.returncode == 0, default.stderr + explicit.stderr
    assert default.stdout == explicit.stdout


@pytest.mark.parametrize("marian_dir", ["swish"], indirect=True)
def test_generation_settings_in_config_json_are_read_when_there_is_no_generation_config(marian_dir, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(marian_dir, old)
    (old / "generation_config.json").unlink()
    config = json.loads((old / "config.json").read_text())
    (old / "config.json").write_text(json.dumps({**config, "num_beams": 6, "max_length": 20,
                                                 "bad_words_ids": [[config["pad_token_id"]]]}))
    summary = import_marian(old, tmp_path / "old.pt")
    assert summary["decoding_defaults"] == {"beam_size": 6, "length_penalty": 1.0, "beam_stopping": "transformers",
                                            "max_decoding_length": 19}
    assert load_model(tmp_path / "old.pt").model.config.suppressed_ids == (config["pad_token_id"],)


def test_stream_text_of_a_marian_target_is_always_a_prefix_of_the_whole(marian_dir):
    """Marian's target detokenization strips the ends: a trailing space waits for the next piece. What the stream
    emits is always a prefix of transformers' decode of the whole, and it holds back no more than the last piece,
    which the final text then adds."""
    hf, _ = reference(marian_dir)
    tok = MarianTokenizer.from_files(marian_dir)
    rng = random.Random(0)
    for text in sentences(ENGLISH, 60, 3):
        ids = [i for i in tok.encode(text) if i != tok.eos_id]
        whole = hf.decode(ids, skip_special_tokens=True, use_source_tokenizer=False)
        out, _ = stream_decoded(tok.decode, ids, rng)
        assert whole.startswith(out), (ids, out, whole)
        assert len(whole) - len(out) <= len(hf.decode(ids[-1:], skip_special_tokens=True,
                                                       use_source_tokenizer=False)) + 1, (ids, out, whole)
