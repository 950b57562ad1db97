"""The `translate` command: through a running server (gRPC; the base install), with a bundle (ONNX
Runtime; the base install), or with a checkpoint (the PyTorch reference; the train extra). Greedy by
default; --beam-size, --num-hypotheses and the --sampling-* options as CTranslate2's.

    nmtserve translate --server localhost:50051 --wait 60 "The cat sleeps."
    nmtserve translate --server dns:///nmtserve.default.svc:50051 --stream < sentences.txt
    nmtserve translate --server localhost:50051 --model fr-en "Le chat dort."     # a server of several models
    nmtserve translate --server localhost:50051 --target-language fr "The cat sleeps."
    nmtserve translate --server localhost:50051 --file report.txt > report.fr.txt   # a whole text (TranslateText)
    nmtserve translate --beam-size 4 --num-hypotheses 2 --json bundles/default "The cat sleeps."
    nmtserve translate --sampling-topk 10 --seed 1 runs/default/best.pt "The cat sleeps." "Did the dogs eat?"
"""

from __future__ import annotations

import json
import random
import re
import sys
from dataclasses import replace
from pathlib import Path

from nmtserve.decoding import LENGTH_RULES
from nmtserve.errors import NmtserveError
from nmtserve.search import BEAM_STOPPING, DecodingOptions

SEARCH_FLAGS = ("beam_size", "num_hypotheses", "length_penalty", "patience", "sampling_topk", "sampling_topp",
                "sampling_temperature", "seed", "beam_stopping", "length_rule")


def given_options(args) -> dict:
    """The decoding flags given on the command line; the rest are the model's defaults."""
    return {name: getattr(args, name) for name in SEARCH_FLAGS if getattr(args, name) is not None}


def local_options(args, defaults: dict) -> DecodingOptions:
    """The options of a local translation: the model's decoding defaults (an imported Marian model's
    generation_config.json; else CTranslate2's), then the flags given."""
    options = DecodingOptions(**defaults).override(**given_options(args))
    return replace(options, max_decoding_length=args.max_length) if args.max_length else options


def cmd_translate(args) -> int:
    if args.stream and not args.server:
        raise NmtserveError("--stream needs --server (it calls TranslateStream)")
    if args.stream and args.json:
        raise NmtserveError("--stream prints text as it is decoded; use --json without --stream")
    if args.server and (args.threads != 0 or args.inter_threads != 1 or args.variant):
        raise NmtserveError("--threads, --inter-threads and --variant set how a local bundle runs; a server has its "
                            "own (nmtserve serve --threads, --inter-threads, --variant)")
    if args.server:
        return _translate_remote(args)
    if args.model or args.source_language or args.file:
        raise NmtserveError("--model, --source-language and --file need --server")
    if not args.inputs:
        raise NmtserveError("give a bundle or checkpoint (or --server HOST:PORT) and the sentences")
    model, texts = args.inputs[0], args.inputs[1:] or [line.rstrip("\n") for line in sys.stdin]
    _print_translations(texts, translate_local(model, texts, args), args.json)
    return 0


def translate_local(model: str, texts: list[str], args) -> list[list[tuple[str, float]]]:
    """The n-best (text, score) of each text, best first, with a bundle directory (ONNX Runtime) or a
    checkpoint (the PyTorch reference); args carries the decoding and thread flags, batch_size, max_length,
    device and target_language."""
    if args.threads < 0:
        raise NmtserveError(f"--threads {args.threads}: must be at least 0 (0: ONNX Runtime's default, a thread per core)")
    if args.inter_threads < 1:
        raise NmtserveError(f"--inter-threads {args.inter_threads}: must be at least 1")
    if not Path(model).exists():
        raise NmtserveError(f"{model}: no such bundle directory or checkpoint file")
    return _translate_bundle(model, texts, args) if Path(model).is_dir() else _translate_checkpoint(model, texts, args)


def _translate_bundle(path: str, texts: list[str], args) -> list[list[tuple[str, float]]]:
    from nmtserve.export.runtime.translator import OnnxTranslator

    tr = OnnxTranslator(path, device=args.device, variant=args.variant, intra_op_threads=args.threads,
                        inter_threads=args.inter_threads)
    options = local_options(args, tr.bundle.manifest.get("decoding_defaults") or {})
    try:
        ids = [tr.tokenizer.encode(t, tr.limits.max_source_tokens, args.target_language) or [tr.eos_id] for t in texts]
    except ValueError as e:  # a language the multilingual model has no >>xx<< token for
        raise NmtserveError(f"--target-language: {e}") from None
    return [[(tr.tokenizer.decode(h.tokens), h.score) for h in hypotheses]
            for hypotheses in tr.search_ids(ids, options, max_batch_size=args.batch_size)]


def _translate_checkpoint(path: str, texts: list[str], args) -> list[list[tuple[str, float]]]:
    """The PyTorch reference, one sentence at a time for beam search and sampling."""
    from nmtserve.training.checkpoint import load_model
    from nmtserve.training.data import pad
    from nmtserve.training.decode import beam_search, sample, translate

    if args.target_language:
        raise NmtserveError("--target-language: give a bundle or --server (the PyTorch reference reads no language token)")
    if args.threads or args.inter_threads != 1 or args.variant:
        raise NmtserveError("--threads, --inter-threads and --variant: with a bundle (ONNX Runtime), not a checkpoint")
    loaded = load_model(path, device=args.device)
    options = local_options(args, loaded.payload.get("decoding_defaults") or {})
    options.check(loaded.model.config.vocab_size)
    if options.greedy:
        return [[(text, 0.0)] for text in translate(loaded.model, loaded.tokenizer, texts, max_batch_size=args.batch_size,
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
                                seed=options.seed or random.randrange(1, 2 ** 63), max_decoding_length=options.max_decoding_length,
                                length_rule=options.length_rule)
        else:
            hypotheses = beam_search(loaded.model, src, mask, beam_size=options.beam_size,
                                     num_hypotheses=options.num_hypotheses, length_penalty=options.length_penalty,
                                     patience=options.patience, beam_stopping=options.beam_stopping,
                                     max_decoding_length=options.max_decoding_length,
                                     length_rule=options.length_rule)[0]
        found.append([(loaded.tokenizer.decode(tokens), score) for tokens, score in hypotheses])
    return found


def _print_translations(texts: list[str], found: list[list[tuple[str, float]]], as_json: bool) -> None:
    """One line per source: the best translation, or JSON with the source, the translation and, for an
    n-best list, every hypothesis with its score."""
    for text, hypotheses in zip(texts, found):
        if not as_json:
            print(hypotheses[0][0])
            continue
        line = {"source": text, "translation": hypotheses[0][0]}
        if len(hypotheses) > 1:
            line["hypotheses"] = [{"text": t, "score": round(score, 4)} for t, score in hypotheses]
        print(json.dumps(line, ensure_ascii=False))


def _translate_remote(args) -> int:
    """Client of a running server; dns:///host:port targets are balanced per call (round_robin)."""
    import grpc

    from nmtserve.client import TlsFiles, open_channel, wait_serving
    from nmtserve.v1 import translation_pb2 as pb
    from nmtserve.v1 import translation_pb2_grpc as pb_grpc

    if args.file and (args.inputs or args.stream):
        raise NmtserveError("--file translates the whole file: give no TEXT and no --stream")
    texts = [] if args.file else args.inputs or [line.rstrip("\n") for line in sys.stdin]
    given = given_options(args)
    if "beam_stopping" in given:
        given["beam_stopping"] = pb.BeamStopping.Value(f"BEAM_STOPPING_{given['beam_stopping'].upper()}")
    if "length_rule" in given:
        given["length_rule"] = pb.LengthRule.Value(f"LENGTH_RULE_{given['length_rule'].upper()}")
    options = pb.DecodingOptions(max_output_tokens=args.max_length or 0, **given)
    route = {"model": args.model, "source_language": args.source_language, "target_language": args.target_language}
    with open_channel(args.server, TlsFiles(args.tls_ca, args.tls_cert, args.tls_key)) as channel:
        if args.wait:
            wait_serving(channel, args.server, args.wait)
        stub = pb_grpc.TranslationServiceStub(channel)
        try:
            if args.file:
                sys.stdout.write(_translate_file(stub, args.file, options, route, args.timeout))
                return 0
            if args.stream:  # TranslateStream per sentence: text is printed as the server decides it
                for text in texts:
                    for message in stub.TranslateStream(pb.TranslateStreamRequest(sentence=text, options=options,
                                                                                  **route), timeout=args.timeout):
                        print(message.delta if message.HasField("delta") else "\n", end="", flush=True)
                return 0
            response = stub.Translate(pb.TranslateRequest(sentences=texts, options=options, **route),
                                      timeout=args.timeout)
        except grpc.RpcError as e:
            raise NmtserveError(f"{args.server}: {e.code().name}: {e.details()}") from None
    _print_translations(texts, [[(t.text, t.score)] + [(a.text, a.score) for a in t.alternatives]
                                for t in response.translations], args.json)
    return 0


def _chunks(text: str, max_chars: int) -> list[str]:
    """The text cut after line breaks into pieces of at most max_chars (a longer line is cut anywhere)."""
    chunks, current = [], ""
    for line in re.findall(r"[^\n]*\n|[^\n]+", text):  # the server's paragraphs end at "\n" only
        while len(line) > max_chars:
            chunks.append(line[:max_chars])
            line = line[max_chars:]
        if len(current) + len(line) > max_chars:
            chunks.append(current)
            current = ""
        current += line
    return [*chunks, current] if current else chunks


def _translate_file(stub, path: str, options, route: dict, timeout: float) -> str:
    """A whole text file through TranslateText: cut at line breaks to the server's per-text limit,
    as many texts per call as its limits allow; the translation keeps the file's whitespace."""
    from nmtserve.v1 import translation_pb2 as pb

    try:
        text = Path(path).read_bytes().decode("utf-8")  # as it is: CRLF stays CRLF
    except (OSError, UnicodeDecodeError) as e:
        raise NmtserveError(f"--file {path}: {e}") from None
    limits = stub.ListModels(pb.ListModelsRequest(), timeout=timeout).models[0].limits
    calls: list[list[str]] = []
    for chunk in _chunks(text, limits.max_text_chars):
        if not calls or len(calls[-1]) == limits.max_sentences or \
                sum(map(len, calls[-1])) + len(chunk) > limits.max_call_chars:
            calls.append([])
        calls[-1].append(chunk)
    return "".join(t.text for texts in calls for t in stub.TranslateText(
        pb.TranslateTextRequest(texts=texts, options=options, **route), timeout=timeout).translations)


def add_parser(sub, name: str, help_text: str) -> None:
    p = sub.add_parser(name, help=help_text)
    p.add_argument("inputs", nargs="*", metavar="MODEL_OR_TEXT",
                   help="TEXT… with --server, or BUNDLE_DIR TEXT… (ONNX Runtime), or CHECKPOINT TEXT… (PyTorch "
                        "reference); stdin lines if no TEXT")
    p.add_argument("--server", help="HOST:PORT (or dns:///HOST:PORT) of `nmtserve serve`")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds, with --server")
    p.add_argument("--model", default="", help="with --server: the served model (ListModels; e.g. en-fr)")
    p.add_argument("--file", help="with --server: translate this whole text file (TranslateText), keeping its layout")
    p.add_argument("--source-language", default="", help="with --server: choose the model by its languages")
    p.add_argument("--target-language", default="",
                   help="the language to translate into: chooses the model on a server of several, and the "
                        ">>xx<< token of a multilingual Marian model")
    p.add_argument("--wait", type=float, default=0.0, help="with --server: first wait up to this many seconds for SERVING")
    p.add_argument("--stream", action="store_true",
                   help="with --server: print each translation as it is decoded (TranslateStream)")
    p.add_argument("--tls-ca", default="", help="with --server: PEM roots that sign the server's certificate (turns TLS on)")
    p.add_argument("--tls-cert", default="", help="with --server: client certificate (PEM) for mutual TLS")
    p.add_argument("--tls-key", default="", help="with --server: the client certificate's private key (PEM)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--max-length", type=int, default=None,
                   help="most target tokens per sentence (default: 256 locally; the server's own limit with --server)")
    p.add_argument("--device", default="cpu")
    add_bundle_flags(p)
    add_decoding_flags(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_translate)


def add_bundle_flags(p) -> None:
    """How a bundle runs (also `nmtserve evaluate`'s): its variant and ONNX Runtime's threads."""
    p.add_argument("--variant", help="a bundle: fp32 or int8 on cpu, fp16 on cuda (default: fp32 on cpu, fp16 on cuda)")
    p.add_argument("--threads", type=int, default=0,
                   help="a bundle: ONNX Runtime intra-op threads of each batch (default 0: a thread per core)")
    p.add_argument("--inter-threads", type=int, default=1,
                   help="a bundle: batches decoded at once, each on a thread of its own (CTranslate2's name); "
                        "on a CPU, --inter-threads 2 --threads 1 beat one batch on 2 threads "
                        "(docs/performance.md, 'Batches at once')")


def add_decoding_flags(p) -> None:
    """The decoding options as flags (also `nmtserve evaluate`'s)."""
    search = p.add_argument_group("decoding (CTranslate2's options; unset: the model's defaults, greedy for the "
                                  "models nmtserve trains, generation_config.json's for an imported Marian model)")
    search.add_argument("--beam-size", type=int)
    search.add_argument("--num-hypotheses", type=int, help="n-best list length (--json prints it)")
    search.add_argument("--length-penalty", type=float, help="beam: score / length ** this")
    search.add_argument("--patience", type=float)
    search.add_argument("--beam-stopping", choices=BEAM_STOPPING, help="whose rule stops beam search")
    search.add_argument("--length-rule", choices=LENGTH_RULES, help="nmtserve: at most 2 × source + 10 tokens, "
                        "the last a real one; transformers: no such cap, the --max-length-th token a forced eos; "
                        "ctranslate2: no such cap, the last a real one")
    search.add_argument("--sampling-topk", type=int, help="1: no sampling; 0: the whole vocabulary")
    search.add_argument("--sampling-topp", type=float)
    search.add_argument("--sampling-temperature", type=float)
    search.add_argument("--seed", type=int, help="sampling: 0 picks one at random")
