"""The client commands. `translate`: through a running server (gRPC; the base install), with a bundle (ONNX
Runtime; the base install), or with a checkpoint (the PyTorch reference; the train extra). Greedy by
default; --beam-size, --num-hypotheses and the --sampling-* options as CTranslate2's. `models`: what a
running server serves (ListModels).

    nmtserve translate --server localhost:50051 --wait 60 "The cat sleeps."
    nmtserve translate --server dns:///nmtserve.default.svc:50051 --stream < sentences.txt
    nmtserve translate --server localhost:50051 --model fr-en "Le chat dort."     # a server of several models
    nmtserve translate --server localhost:50051 --target-lang fr "The cat sleeps."
    nmtserve translate --server localhost:50051 --file report.txt > report.fr.txt   # a whole text (TranslateText)
    nmtserve translate --beam-size 4 --num-hypotheses 2 --json bundles/default "The cat sleeps."
    nmtserve translate --sampling-topk 10 --seed 1 runs/default/best.pt "The cat sleeps." "Did the dogs eat?"
    nmtserve models --server localhost:50051 --json
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from pathlib import Path

from nmtserve.console import print_json
from nmtserve.errors import NmtserveError
from nmtserve.local import Found, add_bundle_flags, add_decoding_flags, attention_json, given_options, local_translator


def cmd_translate(args) -> int:
    if args.stream and not args.server:
        raise NmtserveError("--stream needs --server (it calls TranslateStream)")
    if args.stream and args.json:
        raise NmtserveError("--stream prints text as it is decoded; use --json without --stream")
    if args.return_attention and not args.json:
        raise NmtserveError("--return-attention: the attention is printed with --json")
    if args.server and (args.threads != 0 or args.inter_threads != 1 or args.variant):
        raise NmtserveError("--threads, --inter-threads and --variant set how a local bundle runs; a server has its "
                            "own (nmtserve serve --threads, --inter-threads, --variant)")
    if args.server:
        return _translate_remote(args)
    if args.model or args.file:
        raise NmtserveError("--model and --file need --server")
    if not args.inputs:
        raise NmtserveError("give a bundle or checkpoint (or --server HOST:PORT) and the sentences")
    model, texts = args.inputs[0], args.inputs[1:] or [line.rstrip("\n") for line in sys.stdin]
    _print_translations(texts, local_translator(model, args)(texts), args.json)
    return 0


def _print_translations(texts: list[str], found: list[list[Found]], as_json: bool) -> None:
    """One line per source: the best translation, or JSON with the source, the translation, its confidence (where
    the model gives one) and attention (where asked), and, for an n-best list, every hypothesis with its score,
    confidence and attention."""
    for text, hypotheses in zip(texts, found):
        if not as_json:
            print(hypotheses[0].text)
            continue
        line = {"source": text, "translation": hypotheses[0].text}
        if not math.isnan(hypotheses[0].confidence):
            line["confidence"] = round(hypotheses[0].confidence, 4)
        if hypotheses[0].attention is not None:
            line["attention"] = hypotheses[0].attention
        if len(hypotheses) > 1:
            line["hypotheses"] = [{"text": h.text, "score": round(h.score, 4)}
                                  | ({} if math.isnan(h.confidence) else {"confidence": round(h.confidence, 4)})
                                  | ({} if h.attention is None else {"attention": h.attention}) for h in hypotheses]
        print(json.dumps(line, ensure_ascii=False))


def _translate_remote(args) -> int:
    """Client of a running server; dns:///host:port targets are balanced per call (round_robin)."""
    import grpc

    from nmtserve.client import TlsFiles, open_channel, wait_serving
    from nmtserve.v1 import translation_pb2 as pb
    from nmtserve.v1 import translation_pb2_grpc as pb_grpc

    if args.file and (args.inputs or args.stream):
        raise NmtserveError("--file translates the whole file: give no TEXT and no --stream")
    if args.return_attention and (args.file or args.stream):
        raise NmtserveError("--return-attention: sentence by sentence (Translate), not with --file or --stream")
    if args.target_prefix and args.file:
        raise NmtserveError("--target-prefix: sentence by sentence only (Translate, TranslateStream), not with --file")
    texts = [] if args.file else args.inputs or [line.rstrip("\n") for line in sys.stdin]
    given = given_options(args)
    if "beam_stopping" in given:
        given["beam_stopping"] = pb.BeamStopping.Value(f"BEAM_STOPPING_{given['beam_stopping'].upper()}")
    if "length_rule" in given:
        given["length_rule"] = pb.LengthRule.Value(f"LENGTH_RULE_{given['length_rule'].upper()}")
    options = pb.DecodingOptions(**given, suppress_sequences=args.suppress_sequence, return_scores=args.json,
                                 return_attention=args.return_attention)
    route = {"model": args.model, "source_language": args.source_lang, "target_language": args.target_lang}
    with open_channel(args.server, TlsFiles(args.tls_ca, args.tls_cert, args.tls_key), api_key=args.api_key) as channel:
        if args.wait:
            wait_serving(channel, args.server, args.wait)
        stub = pb_grpc.TranslationServiceStub(channel)
        try:
            if args.file:
                sys.stdout.write(_translate_file(stub, args.file, options, route, args.timeout))
                return 0
            if args.stream:  # TranslateStream per sentence: text is printed as the server decides it
                for text in texts:
                    for message in stub.TranslateStream(pb.TranslateStreamRequest(
                            sentence=text, options=options, target_prefix=args.target_prefix, **route),
                            timeout=args.timeout):
                        print(message.delta if message.HasField("delta") else "\n", end="", flush=True)
                return 0
            # as many calls as the server's limit on sentences a call asks (a file piped in may hold thousands)
            limit = stub.ListModels(pb.ListModelsRequest(), timeout=args.timeout).models[0].limits.max_sentences or 1
            translations = [t for start in range(0, len(texts), limit) for t in stub.Translate(
                pb.TranslateRequest(sentences=texts[start:start + limit], options=options, **route,
                                    target_prefix=[args.target_prefix] * len(texts[start:start + limit])
                                    if args.target_prefix else []),
                timeout=args.timeout).translations]
        except grpc.RpcError as e:
            raise NmtserveError(f"{args.server}: {e.code().name}: {e.details()}") from None
    def found(h) -> Found:  # a Translation or a Hypothesis message
        attention = attention_json(list(h.attention.source_tokens), list(h.attention.target_tokens),
                                   [list(r.weights) for r in h.attention.rows]) if args.return_attention else None
        return Found(h.text, h.score, h.confidence if args.json else math.nan, attention)
    _print_translations(texts, [[found(t)] + [found(a) for a in t.alternatives] for t in translations], args.json)
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


def cmd_models(args) -> int:
    """Each served model: its id, languages, variant, device, kernels and limits (--json: ListModels as JSON)."""
    import grpc
    from google.protobuf.json_format import MessageToDict

    from nmtserve.client import TlsFiles, open_channel, wait_serving
    from nmtserve.v1 import translation_pb2 as pb
    from nmtserve.v1 import translation_pb2_grpc as pb_grpc

    with open_channel(args.server, TlsFiles(args.tls_ca, args.tls_cert, args.tls_key), api_key=args.api_key) as channel:
        if args.wait:
            wait_serving(channel, args.server, args.wait)
        try:
            models = pb_grpc.TranslationServiceStub(channel).ListModels(pb.ListModelsRequest(), timeout=args.timeout).models
        except grpc.RpcError as e:
            raise NmtserveError(f"{args.server}: {e.code().name}: {e.details()}") from None
    if args.json:
        print_json([MessageToDict(m, preserving_proto_field_name=True) for m in models])
        return 0
    def listed(many, one: str) -> str:
        return (f"{len(many)} languages" if len(many) > 8 else "/".join(many)) or one or "?"

    for m in models:
        languages = f"{listed(m.source_languages, m.source_language)}→{listed(m.target_languages, m.target_language)}"
        print(f"{m.model}\t{languages}\t{m.variant} on {m.device}\t{m.kernels}\t"
              f"max_decoding_length {m.limits.max_decoding_length}, max_beam_size {m.limits.max_beam_size}, "
              f"max_sentences {m.limits.max_sentences}")
    return 0


def _add_server_flags(p, required: bool = False) -> None:
    """How to reach a server: its address, the call's timeout, waiting for SERVING and TLS."""
    p.add_argument("--server", required=required, help="HOST:PORT (or dns:///HOST:PORT) of `nmtserve serve`")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds a call may take (default %(default)s)")
    p.add_argument("--wait", type=float, default=0.0, help="first wait up to this many seconds for SERVING")
    p.add_argument("--tls-ca", default="", help="PEM roots that sign the server's certificate (turns TLS on)")
    p.add_argument("--tls-cert", default="", help="client certificate (PEM) for mutual TLS")
    p.add_argument("--tls-key", default="", help="the client certificate's private key (PEM)")
    p.add_argument("--api-key", default=os.environ.get("NMTSERVE_API_KEY", ""),
                   help="the server's API key for this client (sent as `authorization: Bearer KEY`; env NMTSERVE_API_KEY)")


def add_parser(sub, name: str, help_text: str) -> None:
    p = sub.add_parser(name, help=help_text)
    if name == "models":
        _add_server_flags(p, required=True)
        p.add_argument("--json", action="store_true", help="print ListModels' answer as JSON")
        p.set_defaults(func=cmd_models)
        return
    p.add_argument("inputs", nargs="*", metavar="MODEL_OR_TEXT",
                   help="TEXT… with --server, or BUNDLE_DIR TEXT… (ONNX Runtime), or CHECKPOINT TEXT… (PyTorch "
                        "reference); stdin lines if no TEXT")
    _add_server_flags(p)
    p.add_argument("--model", default="", help="with --server: the served model (ListModels; e.g. en-fr)")
    p.add_argument("--file", help="with --server: translate this whole text file (TranslateText), keeping its layout")
    p.add_argument("--stream", action="store_true",
                   help="with --server: print each translation as it is decoded (TranslateStream)")
    p.add_argument("--target-prefix", default="", help="the text every translation is forced to start with "
                   "(CTranslate2's target_prefix); a bundle, a model folder or --server, not --file")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--device", default="cpu")
    add_bundle_flags(p)
    add_decoding_flags(p)
    p.add_argument("--json", action="store_true", help="one JSON line per sentence (with --num-hypotheses, the n-best list)")
    p.add_argument("--return-attention", action="store_true", help="with --json: each translation's attention, "
                   "CTranslate2's (for each target token, its weights over the source tokens)")
    p.set_defaults(func=cmd_translate)
