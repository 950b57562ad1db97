"""The `translate` command: through a running server (gRPC; the base install), or with a checkpoint
(the PyTorch reference; the train extra).

    nmtserve translate --server localhost:50051 --wait 60 "The cat sleeps."
    nmtserve translate --server dns:///nmtserve.default.svc:50051 --stream < sentences.txt
    nmtserve translate runs/default/best.pt "The cat sleeps." "Did the dogs eat?"
"""

from __future__ import annotations

import json
import sys

from nmtserve.errors import NmtserveError


def cmd_translate(args) -> int:
    if args.stream and not args.server:
        raise NmtserveError("--stream needs --server (it calls TranslateStream)")
    if args.stream and args.json:
        raise NmtserveError("--stream prints text as it is decoded; use --json without --stream")
    if args.server:
        return _translate_remote(args)
    from nmtserve.training.checkpoint import load_model
    from nmtserve.training.decode import translate

    if not args.inputs:
        raise NmtserveError("give a checkpoint (or --server HOST:PORT) and the sentences")
    checkpoint, texts = args.inputs[0], args.inputs[1:] or [line.rstrip("\n") for line in sys.stdin]
    loaded = load_model(checkpoint, device=args.device)
    outputs = translate(loaded.model, loaded.tokenizer, texts, max_batch_size=args.batch_size,
                        max_decoding_length=args.max_length or 256, device=args.device)
    _print_translations(texts, outputs, args.json)
    return 0


def _print_translations(texts: list[str], outputs: list[str], as_json: bool) -> None:
    for text, out in zip(texts, outputs):
        print(json.dumps({"source": text, "translation": out}, ensure_ascii=False) if as_json else out)


def _translate_remote(args) -> int:
    """Client of a running server; dns:///host:port targets are balanced per call (round_robin)."""
    import grpc

    from nmtserve.client import TlsFiles, open_channel, wait_serving
    from nmtserve.v1 import translation_pb2 as pb
    from nmtserve.v1 import translation_pb2_grpc as pb_grpc

    texts = args.inputs or [line.rstrip("\n") for line in sys.stdin]
    options = pb.DecodingOptions(max_output_tokens=args.max_length or 0)
    with open_channel(args.server, TlsFiles(args.tls_ca, args.tls_cert, args.tls_key)) as channel:
        if args.wait:
            wait_serving(channel, args.server, args.wait)
        stub = pb_grpc.TranslationServiceStub(channel)
        try:
            if args.stream:  # TranslateStream per sentence: text is printed as the server decides it
                for text in texts:
                    for message in stub.TranslateStream(pb.TranslateStreamRequest(sentence=text, options=options),
                                                        timeout=args.timeout):
                        print(message.delta if message.HasField("delta") else "\n", end="", flush=True)
                return 0
            response = stub.Translate(pb.TranslateRequest(sentences=texts, options=options), timeout=args.timeout)
        except grpc.RpcError as e:
            raise NmtserveError(f"{args.server}: {e.code().name}: {e.details()}") from None
    _print_translations(texts, [t.text for t in response.translations], args.json)
    return 0


def add_parser(sub, name: str, help_text: str) -> None:
    p = sub.add_parser(name, help=help_text)
    p.add_argument("inputs", nargs="*", metavar="CHECKPOINT_OR_TEXT",
                   help="TEXT… with --server, or CHECKPOINT TEXT… (PyTorch reference); stdin lines if no TEXT")
    p.add_argument("--server", help="HOST:PORT (or dns:///HOST:PORT) of `nmtserve serve`")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds, with --server")
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
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_translate)
