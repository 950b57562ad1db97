"""An imported Marian model, exported to ONNX, gives transformers' MarianMTModel.generate tokens:
greedy, and beam 4 with its n-best list under beam_stopping="transformers".

Under nmtserve's length rule both sides get the same budget per sentence (min(max_decoding_length,
2 × source + 10, the position table)) and generate runs without forced_eos_token_id: at the budget
nmtserve ends with a real token (FINISH_REASON_LENGTH). Under length_rule "transformers" generate
runs as configured, max_length and forced eos included, and the tokens are equal at every length."""

from __future__ import annotations

import pytest
import torch

from nmtserve.decoding import DecodingOptions
from nmtserve.export.build.exporter import ExportConfig, export_bundle
from nmtserve.export.runtime.translator import OnnxTranslator
from nmtserve.loadtests.marian_model import ENGLISH, sentences

MAX_LENGTH = 39  # generation_config.json's max_length 40, less the decoder start token


@pytest.fixture(scope="module")
def marian_pair(marian_dir, marian_checkpoint, tmp_path_factory):
    from transformers import MarianMTModel

    out = tmp_path_factory.mktemp("marian-bundle")
    export_bundle(ExportConfig(str(marian_checkpoint), str(out), ["fp32"]))
    translator = OnnxTranslator(out)
    sources = [translator.tokenizer.encode(t, translator.limits.max_source_tokens) for t in sentences(ENGLISH, 50, 11)]
    return translator, MarianMTModel.from_pretrained(marian_dir, dtype=torch.float32).eval(), sources


def generate(model, translator, source: list[int], length_rule: str, **kwargs):
    """generate under the length rule: nmtserve's budget and no forced eos, or transformers' own
    max_length (the decoder start token included) with eos forced at it."""
    if length_rule == "transformers":
        limits = dict(max_length=MAX_LENGTH + 1, forced_eos_token_id=translator.eos_id)
    else:
        limits = dict(max_new_tokens=translator.limits.output_budget(len(source), MAX_LENGTH), forced_eos_token_id=None)
    return model.generate(torch.tensor([source]), return_dict_in_generate=True, output_scores=True, **limits, **kwargs)


def strip(translator, ids: list[int]) -> list[int]:
    """generate's sequences: decoder start first, then eos and pad after the hypothesis."""
    return [t for t in ids[1:] if t not in (translator.eos_id, translator.pad_id)]


def test_manifest_names_the_marian_tokenizer_and_generation_defaults(marian_pair):
    translator, _, _ = marian_pair
    manifest = translator.bundle.manifest
    assert manifest["tokenizer"] == {"scheme": "marian", "files": ["source.spm", "target.spm", "vocab.json"],
                                     "decoder_start_id": translator.pad_id}
    assert manifest["decoding_defaults"]["beam_stopping"] == "transformers"
    assert manifest["languages"] == {"source": "en", "target": "fr"}
    assert manifest["source"]["imported_from"]["format"] == "marian"


@pytest.mark.parametrize("length_rule", ["nmtserve", "transformers"])
def test_greedy_tokens_equal_generate(marian_pair, length_rule):
    translator, model, sources = marian_pair
    options = DecodingOptions(max_decoding_length=MAX_LENGTH, length_rule=length_rule)
    got = translator.search_ids(sources, options, max_batch_size=16)
    expected = [strip(translator, generate(model, translator, s, length_rule, num_beams=1).sequences[0].tolist())
                for s in sources]
    assert [h[0].tokens for h in got] == expected
    lengths = [len(e) for e in expected]
    if length_rule == "transformers":  # some reach max_length, where eos is forced: one real token fewer
        assert lengths.count(MAX_LENGTH - 1) >= 3
    else:
        assert len(set(lengths)) > 3  # outputs of many lengths: some end at eos, some at 2 × source + 10


@pytest.mark.parametrize("length_rule", ["nmtserve", "transformers"])
def test_beam4_nbest_equals_generate_with_transformers_stopping(marian_pair, length_rule):
    translator, model, sources = marian_pair
    options = DecodingOptions(beam_size=4, num_hypotheses=4, length_penalty=1.0, beam_stopping="transformers",
                              max_decoding_length=MAX_LENGTH, length_rule=length_rule)
    got = translator.search_ids(sources, options, max_batch_size=16)
    at_limit = 0
    for source, hypotheses in zip(sources, got):
        out = generate(model, translator, source, length_rule, num_beams=4, num_return_sequences=4, length_penalty=1.0)
        assert [h.tokens for h in hypotheses] == [strip(translator, s) for s in out.sequences.tolist()]
        assert [h.score for h in hypotheses] == pytest.approx(out.sequences_scores.tolist(), abs=1e-4)
        at_limit += any(h.finish == "length" for h in hypotheses)
    if length_rule == "transformers":
        assert at_limit >= 3  # n-best lists with hypotheses ended by the forced eos


@pytest.mark.parametrize("marian_dir", ["relu"], indirect=True)
def test_export_verify_checks_an_imported_model_against_transformers(marian_checkpoint, tmp_path):
    manifest = export_bundle(ExportConfig(str(marian_checkpoint), str(tmp_path / "bundle"), ["fp32"], verify=True))
    report = manifest["verification"]
    assert report["passed"], report["checks"]
    assert report["checks"]["log_probs_within_1e-4_of_transformers"]
    assert report["transformers"]["greedy_identical"] == report["transformers"]["beam4_identical"] == 1.0
