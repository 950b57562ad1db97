"""Translation on this machine, with a bundle (ONNX Runtime; the base install) or a checkpoint (the PyTorch
reference; the train extra), and the command-line flags that say how: shared by the `translate` and `evaluate`
commands. Below the command line: parses no argv and prints nothing.
"""

from __future__ import annotations

import math
import random
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

from nmtserve.decoding import BEAM_STOPPING, LENGTH_RULES, DecodingOptions
from nmtserve.errors import NmtserveError
from nmtserve.hf_folder import bundle_for

SEARCH_FLAGS = ("max_decoding_length", "beam_size", "num_hypotheses", "length_penalty", "patience", "sampling_topk", "sampling_topp",
                "sampling_temperature", "seed", "beam_stopping", "length_rule", "min_decoding_length", "disable_unk",
                "no_repeat_ngram_size", "prefix_bias_beta", "repetition_penalty")
MASK_FLAGS = ("--min-decoding-length, --disable-unk, --no-repeat-ngram-size, --prefix-bias-beta, --repetition-penalty "
              "and --suppress-sequence")


class Found(NamedTuple):
    """A hypothesis of a translation: its text, score and confidence (search.Hypothesis.confidence; nan where the
    model gives none: the PyTorch reference)."""
    text: str
    score: float
    confidence: float = math.nan
    attention: dict | None = None  # --return-attention: source_tokens, target_tokens, and weights (a row a target token)


def attention_json(source: list[str], target: list[str], weights) -> dict:
    """A translation's attention as --json prints it (weights rounded to 4 places)."""
    return {"source_tokens": source, "target_tokens": target, "weights": [[round(w, 4) for w in row] for row in weights]}


def given_options(args) -> dict:
    """The decoding flags given on the command line; the rest are the model's defaults."""
    return {name: getattr(args, name) for name in SEARCH_FLAGS if getattr(args, name) is not None}


def local_options(args, defaults: dict) -> DecodingOptions:
    """The options of a local translation: the model's decoding defaults (an imported Marian model's
    generation_config.json; else CTranslate2's), then the flags given."""
    return DecodingOptions(**defaults).override(**given_options(args))


def local_translator(model: str, args) -> Callable[[list[str]], list[list[Found]]]:
    """A bundle directory (ONNX Runtime) or a checkpoint (the PyTorch reference), loaded once, as a function from
    texts to the n-best of each, best first; args carries the decoding and thread flags, batch_size,
    device, source_lang and target_lang."""
    if args.threads < 0:
        raise NmtserveError(f"--threads {args.threads}: must be at least 0 (0: ONNX Runtime's default, a thread per core)")
    if args.inter_threads < 1:
        raise NmtserveError(f"--inter-threads {args.inter_threads}: must be at least 1")
    if not Path(model).exists():
        raise NmtserveError(f"{model}: no such bundle directory or checkpoint file")
    if not Path(model).is_dir():
        if getattr(args, "target_prefix", ""):
            raise NmtserveError("--target-prefix: a bundle, a model folder or --server; not a checkpoint")
        return _checkpoint_translator(model, args)
    return _bundle_translator(bundle_for(model, lambda line: print(line, file=sys.stderr)), args)


def _bundle_translator(path: str, args) -> Callable[[list[str]], list[list[Found]]]:
    from nmtserve.export.runtime.translator import OnnxTranslator

    tr = OnnxTranslator(path, device=args.device, variant=args.variant, intra_op_threads=args.threads,
                        inter_threads=args.inter_threads)
    options = local_options(args, tr.bundle.manifest.get("decoding_defaults") or {})
    if args.suppress_sequence:  # target texts, as the tokens they are
        options = replace(options, suppress_sequences=tuple(tuple(tr.tokenizer.encode_target(t))
                                                           for t in args.suppress_sequence))

    def translate(texts: list[str]) -> list[list[Found]]:
        try:
            ids = [tr.tokenizer.encode(t, tr.limits.max_source_tokens, args.target_lang, args.source_lang) or [tr.eos_id]
                   for t in texts]
            language = tr.tokenizer.target_prefix(args.target_lang)
        except ValueError as e:  # a language the multilingual model has no token for
            raise NmtserveError(f"--source-lang/--target-lang: {e}") from None
        given = getattr(args, "target_prefix", "")  # translate's flags (evaluate has neither)
        attention = getattr(args, "return_attention", False)
        try:
            found = tr.search_prefixed(ids, options, [given] * len(ids) if given else None, language,
                                       max_batch_size=args.batch_size, attention=attention)
        except ValueError as e:
            raise NmtserveError(f"--target-prefix: {e}") from None
        piece = tr.tokenizer.piece
        return [[Found(tr.tokenizer.decode(shown + h.tokens), h.score, h.confidence,
                       attention_json([piece(i) for i in source], [piece(i) for i in shown + h.tokens],
                                      h.shown_attention(len(shown)).tolist()) if attention else None)
                 for h in hypotheses]
                for source, (hypotheses, shown) in zip(ids, found)]
    return translate


def _checkpoint_translator(path: str, args) -> Callable[[list[str]], list[list[Found]]]:
    """The PyTorch reference, one sentence at a time for beam search and sampling."""
    from nmtserve.training.checkpoint import load_model
    from nmtserve.training.data import pad
    from nmtserve.training.decode import beam_search, sample
    from nmtserve.training.decode import translate as greedy

    if args.target_lang or args.source_lang:
        raise NmtserveError("--source-lang and --target-lang: give a bundle or --server (the PyTorch reference reads no "
                            "language token)")
    if args.threads or args.inter_threads != 1 or args.variant:
        raise NmtserveError("--threads, --inter-threads and --variant: with a bundle (ONNX Runtime), not a checkpoint")
    if getattr(args, "return_attention", False):
        raise NmtserveError("--return-attention: give a bundle or --server (its aligner graph gives the attention)")
    loaded = load_model(path, device=args.device)
    options = local_options(args, loaded.payload.get("decoding_defaults") or {})
    if options.masked or args.suppress_sequence:
        raise NmtserveError(f"{MASK_FLAGS}: give a bundle or --server (the PyTorch reference disables no token)")
    options.check(loaded.model.config.vocab_size)

    def translate(texts: list[str]) -> list[list[Found]]:
        if options.greedy:
            return [[Found(text, 0.0)] for text in greedy(loaded.model, loaded.tokenizer, texts, max_batch_size=args.batch_size,
                                                     max_decoding_length=options.max_decoding_length,
                                                     length_rule=options.length_rule, device=args.device)]
        found = []
        for text in texts:
            src, mask = pad([loaded.tokenizer.encode(text, loaded.model.config.max_len) or [loaded.tokenizer.eos_id]],
                            loaded.tokenizer.pad_id)
            src, mask = src.to(args.device), mask.to(args.device)
            if options.sampling:
                hypotheses = sample(loaded.model, src, mask, sampling_topk=options.sampling_topk,
                                    sampling_topp=options.sampling_topp, sampling_temperature=options.sampling_temperature,
                                    seed=options.seed or random.randrange(1, 2 ** 63),
                                    max_decoding_length=options.max_decoding_length, length_rule=options.length_rule)
            else:
                hypotheses = beam_search(loaded.model, src, mask, beam_size=options.beam_size,
                                         num_hypotheses=options.num_hypotheses, length_penalty=options.length_penalty,
                                         patience=options.patience, beam_stopping=options.beam_stopping,
                                         max_decoding_length=options.max_decoding_length,
                                         length_rule=options.length_rule)[0]
            found.append([Found(loaded.tokenizer.decode(tokens), score) for tokens, score in hypotheses])
        return found
    return translate


def add_bundle_flags(p) -> None:
    """How a bundle runs (also `nmtserve evaluate`'s): its variant and ONNX Runtime's threads."""
    p.add_argument("--variant", help="a bundle: fp32 or int8 on cpu, fp16 on cuda (default: fp32 on cpu, fp16 on cuda)")
    p.add_argument("--threads", type=int, default=0,
                   help="a bundle: ONNX Runtime intra-op threads of each batch (default 0: a thread per core)")
    p.add_argument("--inter-threads", type=int, default=1,
                   help="a bundle: batches decoded at once, each on a thread of its own (CTranslate2's name); "
                        "on a CPU, --inter-threads 2 --threads 1 beat one batch on 2 threads "
                        "(docs/performance-journal.md, 'Batches at once')")


def add_decoding_flags(p) -> None:
    """The decoding options as flags (also `nmtserve evaluate`'s)."""
    search = p.add_argument_group("decoding (CTranslate2's options; unset: the model's defaults, greedy for the "
                                  "models nmtserve trains, generation_config.json's for an imported Marian model)")
    search.add_argument("--max-decoding-length", type=int,
                        help="most target tokens per sentence (default: the model's, 256 for the models nmtserve trains; "
                             "with --server, the server's)")
    search.add_argument("--target-lang", default="", help="the language to translate into: a multilingual model's "
                        "target language (Marian's >>xx<<, M2M100's and NLLB's codes), and with --server the model "
                        "that translates into it")
    search.add_argument("--source-lang", default="", help="the language translated from: what a multilingual model "
                        "(M2M100, NLLB) reads, and with --server the model that translates from it")
    search.add_argument("--beam-size", type=int)
    search.add_argument("--num-hypotheses", type=int, help="n-best list length (--json prints it)")
    search.add_argument("--length-penalty", type=float, help="beam: score / length ** this")
    search.add_argument("--patience", type=float)
    search.add_argument("--beam-stopping", choices=BEAM_STOPPING, help="whose rule stops beam search")
    search.add_argument("--length-rule", choices=LENGTH_RULES, help="nmtserve: at most 2 × source + 10 tokens, "
                        "the last a real one; transformers: no such cap, the --max-decoding-length-th token a forced eos; "
                        "ctranslate2: no such cap, the last a real one")
    search.add_argument("--sampling-topk", type=int, help="1: no sampling; 0: the whole vocabulary")
    search.add_argument("--sampling-topp", type=float)
    search.add_argument("--sampling-temperature", type=float)
    search.add_argument("--seed", type=int, help="sampling: 0 picks one at random")
    search.add_argument("--min-decoding-length", type=int, help="no end of sentence before this many tokens")
    search.add_argument("--disable-unk", action="store_true", default=None, help="never the unknown token")
    search.add_argument("--no-repeat-ngram-size", type=int, help="no n-gram of this many tokens twice")
    search.add_argument("--prefix-bias-beta", type=float, help="with --target-prefix: favour the prefix by this "
                        "weight (0 to 1) instead of forcing it")
    search.add_argument("--repetition-penalty", type=float, help="divide the logits of tokens already decoded by this "
                        "before each step (above 1 discourages repeats; 1: none)")
    search.add_argument("--suppress-sequence", action="append", default=[], metavar="TEXT",
                        help="never these target tokens in this order (again for more)")
