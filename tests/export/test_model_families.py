"""The model families people run, imported from Hugging Face directories built offline and checked against
transformers on the same weights: M2M100 and NLLB (pre-norm, fairseq's positions, the target language forced as the
first token, NLLB's legacy source layout) and the Marian variants the OPUS-MT tc-big models use (separate source
and target vocabularies, an untied output projection), with configs varied as real checkpoints vary (activation,
scale_embedding, layer counts, tied or untied embeddings). For each: token ids equal transformers' tokenizer,
log-probs equal transformers' model within 1e-4, and the exported bundle's greedy and beam-4 n-best lists equal
generate()'s on 50 sentences, where the kernel library is used and where it is not."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nmtserve.export.build.exporter import ExportConfig, export_bundle
from nmtserve.export.runtime.translator import OnnxTranslator
from nmtserve.loadtests.m2m100_model import build_m2m100_dir
from nmtserve.loadtests.marian_model import ENGLISH, ODD, build_marian_dir, sentences
from nmtserve.training.checkpoint import load_model
from nmtserve.training.m2m100 import import_m2m100
from nmtserve.training.marian import import_marian

MAX_LENGTH = 40  # generation_config.json's, the decoder start token included
FAMILIES = {
    "m2m100": dict(family="m2m100", seed=0),
    "nllb-legacy-untied": dict(family="nllb", activation="gelu", scale_embedding=False, encoder_layers=3,
                               decoder_layers=1, tied=False, legacy_behaviour=True, seed=1),
    "marian-separate-vocabs": dict(family="marian", separate_vocabs=True, activation="swish", seed=2),
    "marian-untied": dict(family="marian", tied=False, activation="gelu", encoder_layers=1, decoder_layers=3, seed=3),
}
LANGUAGES = {"m2m100": ("en", "fr"), "nllb": ("eng_Latn", "fra_Latn"), "marian": ("en", "fr")}


class Family:
    """A directory, transformers' tokenizer and model over it, and nmtserve's import and bundle of it."""

    def __init__(self, name: str, tmp: Path):
        spec = dict(FAMILIES[name])
        self.family = spec.pop("family")
        self.source, self.target = LANGUAGES[self.family]
        if self.family == "marian":
            from transformers import MarianMTModel, MarianTokenizer

            self.dir = build_marian_dir(tmp / "hf", **spec)
            import_marian(self.dir, tmp / "model.pt", self.source, self.target)
            self.tokenizer, self.model = MarianTokenizer.from_pretrained(self.dir), MarianMTModel.from_pretrained(self.dir)
        else:
            from transformers import AutoTokenizer, M2M100ForConditionalGeneration

            self.dir = build_m2m100_dir(tmp / "hf", family=self.family, **spec)
            import_m2m100(self.dir, tmp / "model.pt")
            self.tokenizer = AutoTokenizer.from_pretrained(self.dir, src_lang=self.source, tgt_lang=self.target)
            self.model = M2M100ForConditionalGeneration.from_pretrained(self.dir)
        self.model.eval()
        self.loaded = load_model(tmp / "model.pt")
        export_bundle(ExportConfig(str(tmp / "model.pt"), str(tmp / "bundle"), ["fp32"]))
        self.bundle = tmp / "bundle"
        self.forced = self.loaded.tokenizer.target_prefix(self.target)

    def generate(self, texts: list[str], beams: int):
        batch = self.tokenizer(texts, return_tensors="pt", padding=True)
        forced = {"forced_bos_token_id": self.forced[0]} if self.forced else {}
        with torch.no_grad():
            return self.model.generate(**batch, **forced, num_beams=beams, num_return_sequences=beams, do_sample=False,
                                       max_length=MAX_LENGTH, length_penalty=1.0, early_stopping=False,
                                       output_scores=True, return_dict_in_generate=True)

    def strip(self, ids: list[int]) -> list[int]:
        """generate's sequence: the decoder start and forced tokens first, eos and pad after the hypothesis."""
        special = self.loaded.tokenizer.special_ids()
        return [t for t in ids[1 + len(self.forced):] if t not in (special["eos"], special["pad"])]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory) -> Family:
    return Family(request.param, tmp_path_factory.mktemp(request.param))


def test_token_ids_equal_transformers_tokenizer(family):
    ours = family.loaded.tokenizer
    texts = sentences(ENGLISH, 60, 3) + [t for t in ODD if t.strip()]
    for text in texts:
        assert ours.encode(text, source_language=family.source, target_language=family.target) == \
            family.tokenizer(text)["input_ids"], text
    ids = family.generate(texts[:8], 1).sequences.tolist()
    for row in ids:
        tokens = family.strip(row)
        reference = family.tokenizer.decode([t for t in tokens if t not in family.forced], skip_special_tokens=True)
        assert ours.decode(tokens) == reference
    if family.family != "marian":  # the vocabulary, kept as arrays of ids, comes back whole: as the import saved it
        assert ours.vocab == family.loaded.payload["tokenizer"]["vocab"]


def test_log_probs_equal_transformers_within_1e_4(family):
    model, c = family.loaded.model, family.loaded.model.config
    batch = family.tokenizer(sentences(ENGLISH, 6, 5), return_tensors="pt", padding=True)
    g = torch.Generator().manual_seed(0)
    start = [c.bos_id, *family.forced]
    target = torch.cat([torch.tensor([start] * 6), torch.randint(4, c.vocab_size - 1, (6, 9), generator=g)], dim=1)
    with torch.no_grad():
        logits = family.model(**batch, decoder_input_ids=target).logits
        for token in c.suppressed_ids:  # generate's bad_words_ids, renormalised
            logits[..., token] = float("-inf")
        expected = torch.log_softmax(logits, dim=-1)
        got = model(batch["input_ids"], batch["attention_mask"].bool(), target, torch.ones_like(target, dtype=torch.bool))
    finite = torch.isfinite(expected)
    assert torch.equal(finite, torch.isfinite(got))
    assert float((got - expected)[finite].abs().max()) < 1e-4


@pytest.mark.parametrize("library", [False, True], ids=["onnxruntime", "kernels"])
def test_greedy_and_beam4_nbest_equal_generate(family, library, request):
    if library:
        request.getfixturevalue("kernel_library")
    translator = OnnxTranslator(family.bundle, attention_kernel=library, native_steps=library)
    texts = sentences(ENGLISH, 50, 11)
    lengths = set()
    for beams in (1, 4):
        reference = family.generate(texts, beams)
        got = translator.translate_batch(texts, beam_size=beams, num_hypotheses=beams, length_penalty=1.0,
                                         beam_stopping="transformers", max_decoding_length=MAX_LENGTH - 1,
                                         length_rule="ctranslate2" if family.forced else "transformers",
                                         return_scores=True, source_language=family.source,
                                         target_language=family.target)
        sequences = reference.sequences.tolist()
        for i, translation in enumerate(got):
            expected = [family.strip(s) for s in sequences[i * beams:(i + 1) * beams]]
            assert [h.tokens for h in translation.hypotheses] == expected, texts[i]
            lengths.update(len(t) for t in expected)
            if beams > 1:
                assert [h.score for h in translation.hypotheses] == \
                    pytest.approx(reference.sequences_scores[i * beams:(i + 1) * beams].tolist(), abs=1e-4)
    assert len(lengths) > 3  # outputs of many lengths: some end at eos, some at the limit


def test_return_attention_equals_transformers_last_layer_first_head(family):
    """return_attention on an imported model: transformers' cross-attention of the last decoder layer, first head, over
    the same source and tokens (the forced language token's row left out, as CTranslate2 leaves it), within 1e-4."""
    texts = sentences(ENGLISH, 8, 13)
    got = OnnxTranslator(family.bundle).translate_batch(texts, return_attention=True, max_decoding_length=MAX_LENGTH - 1,
                                                         source_language=family.source, target_language=family.target)
    implementation = family.model.config._attn_implementation
    family.model.set_attn_implementation("eager")  # the attention implementation that returns its weights
    try:
        for text, translation in zip(texts, got):
            batch = family.tokenizer([text], return_tensors="pt")
            fed = [family.loaded.model.config.bos_id, *family.forced, *translation.tokens]
            with torch.no_grad():
                out = family.model(**batch, decoder_input_ids=torch.tensor([fed]), output_attentions=True)
            expected = out.cross_attentions[-1][0, 0, len(family.forced):len(fed) - 1]
            assert len(translation.attention) == len(translation.tokens) == len(expected)
            if translation.tokens:
                assert float((torch.tensor(translation.attention) - expected).abs().max()) < 1e-4, text
    finally:
        family.model.set_attn_implementation(implementation)
