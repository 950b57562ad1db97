"""The models one server serves: which bundles (flags or a --models file), under which ids, and each
model's half of a request — validation against its limits and languages, its decoding defaults, its
ModelInfo. Protobuf in, engine requests out; the servicer (server/service.py) routes to a model.

    nmtserve serve bundles/en-fr bundles/fr-en          # ids from the bundles' languages: en-fr, fr-en
    nmtserve serve --models models.toml                 # ids, bundles and per-model settings in a file

models.toml:

    [[models]]
    bundle = "/models/en-fr"     # required
    id = "en-fr"                 # default: the bundle's languages ("en-fr"), else its directory's name
    variant = "int8"             # default: --variant (fp32 on cpu, fp16 on cuda); also device, threads, inter_threads
    glossary = "/models/en-fr-terms.tsv"   # source term<TAB>target term a line: the calls that give none use it
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import tomllib
from dataclasses import dataclass
from pathlib import Path

from nmtserve.decoding import DecodingOptions
from nmtserve.errors import ConfigError
from nmtserve.export.runtime.bundle import MANIFEST, default_variant, load_bundle
from nmtserve.export.runtime.decoder import CUDA_INTER_THREADS
from nmtserve.export.runtime.engine import EnginePool
from nmtserve.glossary import Glossary
from nmtserve.hf_folder import bundle_for
from nmtserve.search import constrained_beam
from nmtserve.server.config import ServerConfig
from nmtserve.server.convert import CallOptions, InvalidRequest, ModelNotFound, decoding_options
from nmtserve.server.documents import fit, sentence_spans
from nmtserve.tokenizer import M2M100Tokenizer
from nmtserve.v1 import translation_pb2 as pb

log = logging.getLogger("nmtserve.server")

SPEC_KEYS = ("bundle", "id", "variant", "device", "threads", "inter_threads", "glossary")
INTEGER_KEYS = ("threads", "inter_threads")
OPTIONS_KEPT = 256  # distinct DecodingOptions messages whose conversion a model keeps (ServedModel.options)


@dataclass
class ModelSpec:
    """One model to serve: its id on this server, its bundle and how to run it."""

    id: str
    bundle: str
    variant: str
    device: str
    threads: int
    inter_threads: int = 1  # engines over the model's sessions (export/runtime/engine.py, EnginePool)
    glossary: str = ""  # a file of the model's glossary (read_glossary), for the calls that give none


def default_id(bundle: str) -> str:
    """The bundle's languages ("en-fr"); a multilingual model's (M2M100, NLLB) or one whose manifest names no
    languages: the name of the folder it was imported from, else of its directory."""
    manifest = load_bundle(bundle).manifest
    languages = manifest.get("languages") or {}
    multilingual = (manifest.get("tokenizer") or {}).get("scheme") == M2M100Tokenizer.scheme
    if languages.get("source") and languages.get("target") and not multilingual:
        return f"{languages['source']}-{languages['target']}"
    imported = ((manifest.get("source") or {}).get("imported_from") or {}).get("directory")
    return Path(imported or bundle).resolve().name


def model_specs(config: ServerConfig) -> list[ModelSpec]:
    """The models of --models FILE, or else of the bundle arguments (comma-separated in NMTSERVE_BUNDLE,
    which the images set: a models file replaces it); ConfigError for none, a bad file, or two models
    under one id."""
    entries: list[dict] = []
    if config.runtime.models:
        try:
            parsed = tomllib.loads(Path(config.runtime.models).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"--models {config.runtime.models}: {e}") from None
        extra = sorted(set(parsed) - {"models"})
        if extra or not isinstance(parsed.get("models"), list):
            raise ConfigError(f"--models {config.runtime.models}: expected [[models]] tables only, found {extra or 'none'}")
        for i, entry in enumerate(parsed["models"]):
            where = f"--models {config.runtime.models}: models[{i}]"
            unknown = sorted(set(entry) - set(SPEC_KEYS))
            if unknown or "bundle" not in entry:
                raise ConfigError(f"{where}: " + (f"unknown key {unknown[0]!r}; keys are {', '.join(SPEC_KEYS)}"
                                                  if unknown else "bundle is required"))
            for key, value in entry.items():
                if not isinstance(value, int if key in INTEGER_KEYS else str) or isinstance(value, bool):
                    raise ConfigError(f"{where}.{key} = {value!r}: expected "
                                      + ("an integer" if key in INTEGER_KEYS else "a string"))
            entries.append(entry)
    else:
        entries = [{"bundle": b.strip()} for b in config.runtime.bundle.split(",") if b.strip()]
    if not entries:
        raise ConfigError("no model to serve: give one or more bundle directories, or --models FILE")
    for e in entries:  # a Hugging Face model folder: its bundle, made once into the cache
        e["bundle"] = bundle_for(e["bundle"], log.info)
    specs = []
    for e in entries:
        device = e.get("device", config.runtime.device)
        specs.append(ModelSpec(e.get("id") or default_id(e["bundle"]), e["bundle"],
                               e.get("variant", config.runtime.variant) or default_variant(device), device,
                               e.get("threads", config.runtime.threads), e.get("inter_threads", config.runtime.inter_threads),
                               e.get("glossary", "")))
    seen: dict[str, str] = {}
    for spec in specs:
        if spec.inter_threads < 1:
            raise ConfigError(f"inter_threads {spec.inter_threads} for model {spec.id!r} (--inter-threads, or its "
                              "models file): must be at least 1")
        if spec.inter_threads > 1 and spec.device == "cuda":
            raise ConfigError(f"model {spec.id!r}: " + CUDA_INTER_THREADS.format(n=spec.inter_threads)
                              + " (--inter-threads, or its models file)")
        if spec.id in seen:
            raise ConfigError(f"model id {spec.id!r} names both {seen[spec.id]} and {spec.bundle}: "
                              "give each an id in a --models file")
        seen[spec.id] = spec.bundle
    return specs


def read_glossary(path: str) -> Glossary:
    """A model's glossary file: a source term, a tab and its target term a line (UTF-8; blank lines and lines
    starting with # skipped). ConfigError naming the file, and the line or entry."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"glossary {path}: {e}") from None
    entries, labels = [], []
    for n, line in enumerate(lines, 1):
        if not line.strip() or line.startswith("#"):
            continue
        if line.count("\t") != 1:
            raise ConfigError(f"glossary {path}, line {n}: expected a source term, a tab and a target term; got {line!r}")
        source, target = line.split("\t")
        entries.append((source, target))
        labels.append(f"glossary {path}, line {n}")
    return Glossary(entries, f"glossary {path}", labels)


def bundle_defaults(manifest: dict, max_decoding_length: int) -> tuple[DecodingOptions, int]:
    """How a call that leaves its options unset is decoded: the bundle's decoding defaults (an imported Marian
    model's generation_config.json; else CTranslate2's), and the most output tokens, the bundle's
    max_decoding_length within the server's limit."""
    defaults = dict(manifest.get("decoding_defaults") or {})
    output_tokens = min(max_decoding_length, defaults.pop("max_decoding_length", max_decoding_length))
    return DecodingOptions(**defaults), output_tokens


class ServedModel:
    """One model behind the server: its engine, and the checks and defaults of its requests."""

    def __init__(self, spec: ModelSpec, engine: EnginePool, config: ServerConfig):
        self.id, self.spec, self.engine, self.config = spec.id, spec, engine, config
        tr = engine.tr
        self.tokenizer = tr.tokenizer
        self.max_source_tokens = tr.limits.max_source_tokens
        # a budget past the decoder's position table could never be spent: the smaller limit is the one told
        self.max_decoding_length = min(config.limits.max_decoding_length, tr.limits.max_target_tokens)
        self.max_beam_size = min(config.limits.max_beam_size, config.engine.max_running_rows)  # a beam takes beam_size rows
        self.defaults, self.default_output_tokens = bundle_defaults(tr.bundle.manifest, self.max_decoding_length)
        self.manifest_path = Path(spec.bundle) / MANIFEST
        self._info: pb.ModelInfo | None = None  # info(), built on first use
        self._options: dict[bytes, tuple[int, DecodingOptions]] = {}  # options(), by the message's bytes
        languages = tr.bundle.manifest.get("languages") or {}
        self.source_language, self.target_language = languages.get("source", ""), languages.get("target", "")
        self.glossary = read_glossary(spec.glossary) if spec.glossary else None  # the calls that give none use it

    @property
    def target_languages(self) -> list[str]:
        """Every language this model translates into ([] when its bundle does not say)."""
        return self.tokenizer.target_languages or ([self.target_language] if self.target_language else [])

    def describe(self) -> str:
        """'en-fr (en→fr)', as error messages list the served models."""
        return f"{self.id} ({_listed(self.source_languages, '/') or '?'}→{_listed(self.target_languages, '/') or '?'})"

    # -- validation
    def options(self, options: pb.DecodingOptions) -> tuple[int, DecodingOptions]:
        """(most output tokens, the search's options) of a call to this model (convert.decoding_options), worked out
        once for each distinct message: most calls send the same few (the defaults, above all)."""
        if options.return_attention:
            self.require_aligner("options.")
        key = options.SerializeToString(deterministic=True)
        found = self._options.get(key)
        if found is None:
            found = decoding_options(options, self.defaults, self.default_output_tokens, self.max_decoding_length,
                                     self.engine.tr.vocab_size, self.max_beam_size, self.tokenizer.encode_target)
            if len(self._options) >= OPTIONS_KEPT:  # a client sending ever new options cannot grow it without end
                self._options.clear()
            self._options[key] = found
        return found

    def require_aligner(self, field: str) -> None:
        """InvalidRequest, its message led by `field`, where this model's bundle has no aligner graph (the attention
        that return_attention returns and that places inline tags)."""
        try:
            self.engine.tr.require_aligner()
        except ConfigError as e:
            raise InvalidRequest(f"{field}{e}") from None

    def with_glossary(self, options: CallOptions, entries, sentences) -> list[CallOptions]:
        """Each sentence's options under a call's glossary (its GlossaryEntry messages; none: the model's, if it has
        one): constrained beam search (search.constrained_beam) where the sentence contains a source term.
        InvalidRequest naming the entry or the sentence."""
        try:
            glossary = Glossary([(e.source, e.target) for e in entries]) if entries else self.glossary
        except ConfigError as e:
            raise InvalidRequest(str(e)) from None
        if glossary is None:
            return [options] * len(sentences)
        search = options.search
        found = []
        for i, sentence in enumerate(sentences):
            constrained = constrained_beam(search, glossary.constraints_for(sentence, self.tokenizer.encode_target))
            try:
                if constrained is not search:  # the call's options were checked already
                    constrained.check(self.engine.tr.vocab_size, self.max_beam_size)
            except ConfigError as e:
                raise InvalidRequest(f"glossary: sentences[{i}]'s terms: {e}") from None
            found.append(options._replace(search=constrained))
        return found

    @property
    def source_languages(self) -> list[str]:
        """Every language this model translates from ([] when its bundle does not say)."""
        return self.tokenizer.source_languages or ([self.source_language] if self.source_language else [])

    def languages(self, source_language: str, target_language: str) -> CallLanguages:
        """How a call's sentences are encoded and decoded for its languages; InvalidRequest for a language the model
        does not know, or none where a multilingual model has no default."""
        multilingual, served = self.tokenizer.target_languages, self.target_languages
        language = target_language or self.target_language
        if (target_language and served and target_language not in served) or \
                (multilingual and language not in multilingual):
            raise InvalidRequest(f"target_language {target_language!r}: model {self.id} translates into "
                                 f"{_listed(served)}")
        source = ""
        if self.tokenizer.source_languages:  # a source language token (M2M100, NLLB)
            source = source_language or self.source_language
            if source not in self.tokenizer.source_languages:
                raise InvalidRequest(f"source_language {source_language!r}: model {self.id} translates from "
                                     f"{_listed(self.tokenizer.source_languages)}")
        target = language if multilingual else ""
        return CallLanguages(source, target, tuple(self.tokenizer.target_prefix(target)))

    def target_prefixes(self, texts, sources: list[list[int]], options: CallOptions,
                        languages: CallLanguages) -> list[list[int]]:
        """Each sentence's target_prefix as target ids ([] where none; OnnxTranslator.target_prefix_ids);
        InvalidRequest for a count other than the sentences' or a prefix without room in its output budget."""
        try:
            return self.engine.tr.target_prefix_ids(sources, texts, options.max_tokens, options.search.length_rule,
                                                    languages.prefix)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None

    def source(self, field: str, text: str, languages: CallLanguages) -> list[int]:
        if not text.strip():
            raise InvalidRequest(f"{field}: empty sentence")
        if len(text) > self.config.limits.max_sentence_chars:
            raise InvalidRequest(f"{field}: {len(text)} characters, the limit is {self.config.limits.max_sentence_chars}")
        ids = self.tokenizer.encode(text, target_language=languages.target, source_language=languages.source)
        if not ids:  # only characters the tokenizer's normalisation removes (zero-width, controls)
            raise InvalidRequest(f"{field}: nothing to translate in {text[:40]!r} (no token after normalisation)")
        if len(ids) > self.max_source_tokens:
            raise InvalidRequest(f"{field}: {len(ids)} tokens, the limit is {self.max_source_tokens}")
        return ids

    def check_text(self, field: str, text: str) -> None:
        """InvalidRequest naming the field for a whole text over the server's limit (--max-text-chars)."""
        if len(text) > self.config.limits.max_text_chars:
            raise InvalidRequest(f"{field}: {len(text)} characters, the limit is {self.config.limits.max_text_chars}")

    def text_pieces(self, field: str, text: str, languages: CallLanguages) -> tuple[list[tuple[int, int]], list[list[int]]]:
        """A whole text's sentences (pieces of those over the character or token limit) as spans and
        token ids; a piece of nothing but what the tokenizer drops has no ids and is kept as it is."""
        self.check_text(field, text)

        @functools.cache  # fit() measures a piece, then its ids are kept: each piece is encoded once
        def encode(piece: str) -> list[int]:
            return self.tokenizer.encode(piece, target_language=languages.target, source_language=languages.source)

        def too_long(piece: str) -> bool:
            return len(piece) > self.config.limits.max_sentence_chars or len(encode(piece)) > self.max_source_tokens

        spans = [piece for span in sentence_spans(text, languages.source or self.source_language)
                 for piece in fit(text, span, too_long)]
        return spans, [encode(text[start:end]) for start, end in spans]

    # -- description
    def info(self) -> pb.ModelInfo:
        """What GetModelInfo and ListModels tell of this model; built once (reading and hashing the
        manifest is not free), since the model served does not change while it runs."""
        if self._info is None:
            self._info = self._build_info()
        return self._info

    def _build_info(self) -> pb.ModelInfo:
        manifest_bytes = self.manifest_path.read_bytes()
        manifest = json.loads(manifest_bytes)
        return pb.ModelInfo(
            model=self.id, source_language=self.source_language, target_language=self.target_language,
            bundle_id=hashlib.sha256(manifest_bytes).hexdigest(), variant=self.engine.tr.variant,
            device=self.engine.tr.device, model_json=json.dumps(manifest["model"], sort_keys=True),
            limits=pb.Limits(max_sentences=self.config.limits.max_sentences, max_sentence_chars=self.config.limits.max_sentence_chars,
                             max_source_tokens=self.max_source_tokens, max_decoding_length=self.max_decoding_length,
                             max_beam_size=self.max_beam_size, max_text_chars=self.config.limits.max_text_chars,
                             max_call_chars=self.config.limits.max_call_chars),
            default_options=pb.DecodingOptions(
                max_decoding_length=self.default_output_tokens, beam_size=self.defaults.beam_size,
                num_hypotheses=1, length_penalty=self.defaults.length_penalty, patience=self.defaults.patience,
                sampling_topk=1, sampling_topp=1.0, sampling_temperature=1.0,
                beam_stopping=pb.BeamStopping.Value(f"BEAM_STOPPING_{self.defaults.beam_stopping.upper()}"),
                length_rule=pb.LengthRule.Value(f"LENGTH_RULE_{self.defaults.length_rule.upper()}")),
            target_languages=self.tokenizer.target_languages, source_languages=self.tokenizer.source_languages,
            graphs=self.engine.tr.graphs, kernels=self.engine.tr.kernel_note)


def route(models: dict[str, ServedModel], model: str, source_language: str, target_language: str) -> ServedModel:
    """The model a request names, or the one whose languages match; ModelNotFound (an unknown model, or a pair no
    model serves) or InvalidRequest (a model not named where one must be), each listing what is served."""
    served = "; ".join(m.describe() for m in models.values())
    if model:
        if model not in models:
            raise ModelNotFound(f"model {model!r}: not served here; this server serves {served}")
        chosen = models[model]
        if source_language and chosen.source_languages and source_language not in chosen.source_languages:
            raise InvalidRequest(f"source_language {source_language!r}: model {model} translates from "
                                 f"{_listed(chosen.source_languages)}")
        return chosen
    if len(models) == 1:
        chosen = next(iter(models.values()))
        if source_language and chosen.source_languages and source_language not in chosen.source_languages:
            raise InvalidRequest(f"source_language {source_language!r}: this server translates from "
                                 f"{_listed(chosen.source_languages)}")
        return chosen
    if not (source_language or target_language):
        raise InvalidRequest(f"model: not given, and this server serves several: {served}; name one, or give "
                             "source_language and target_language")
    matching = [m for m in models.values()
                if (not source_language or source_language in m.source_languages)
                and (not target_language or target_language in m.target_languages)]
    pair = f"source_language {source_language!r}, target_language {target_language!r}"
    if not matching:
        raise ModelNotFound(f"{pair}: no model serves this pair; this server serves {served}")
    if len(matching) > 1:
        raise InvalidRequest(f"{pair}: served by several models ({', '.join(m.id for m in matching)}); name one "
                             "with model")
    return matching[0]


@dataclass(frozen=True)
class CallLanguages:
    """A call's languages as its model reads them (ServedModel.languages)."""

    source: str  # the source language token's language (M2M100, NLLB), "" for a model of one source language
    target: str  # the target language token's language (multilingual models), "" for a model of one target
    prefix: tuple[int, ...]  # the target tokens decoding is forced to start with (M2M100, NLLB: the language's)


def _listed(languages: list[str], sep: str = ", ") -> str:
    """Languages for a message: all of a few, the count and the first of many."""
    return sep.join(languages) if len(languages) <= 8 else f"{len(languages)} languages ({', '.join(languages[:6])}, …)"
