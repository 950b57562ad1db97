"""The `nmtserve` command line.

    nmtserve data --out data/ --pairs 200000 --seed 1
    nmtserve train --data data/ --out runs/small --max-minutes 20
    nmtserve evaluate runs/small/best.pt --split test --json
    nmtserve translate runs/small/best.pt "The cat sleeps." "Did the dogs eat?"

Every error is one line on stderr and exit status 2; never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import fields
from pathlib import Path

from nmtserve.errors import NmtserveError

EXIT_USAGE = 2


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but an error is a single line."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _print_json(obj) -> None:
    print(json.dumps(obj, indent=2, ensure_ascii=False))


# ---------------------------------------------------------------- data
def cmd_data(args) -> int:
    from training.corpus import generate_corpus

    for name in ("pairs", "valid", "test", "novel"):
        if getattr(args, name) < (1 if name == "pairs" else 0):
            raise NmtserveError(f"--{name} {getattr(args, name)}: must be positive")
    stats = generate_corpus(Path(args.out), args.pairs, seed=args.seed, valid=args.valid, test=args.test,
                            novel=args.novel, workers=args.workers)
    summary = {"out": args.out, **stats.__dict__}
    if args.json:
        _print_json(summary)
    else:
        w = stats.written
        print(f"wrote {w['train']} train, {w['valid']} valid, {w['test']} test, {w['novel']} novel pairs to {args.out}; "
              f"dropped {stats.dropped_unrealisable} unrealisable, {stats.dropped_duplicate} duplicates")
    return 0


# ---------------------------------------------------------------- train
def cmd_train(args) -> int:
    from training.train import TrainConfig, train

    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig)})
    summary = train(cfg)
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun, one process reports
        _print_json(summary) if args.json else print(
            f"trained {summary['steps']} steps; best valid BLEU {summary['best_valid_bleu']:.2f}; checkpoints in {cfg.out}")
    return 0


def cmd_average(args) -> int:
    from training.checkpoint import average

    print(average(args.checkpoints, args.out))
    return 0


# ---------------------------------------------------------------- evaluate / translate
def _split_pairs(args, payload: dict) -> tuple[list[tuple[str, str]], str]:
    from training.data import read_corpus, split_file

    if args.file:
        corpus = read_corpus(args.file)
        return corpus.pairs, corpus.source
    data_dir = args.data or (payload.get("train_config") or {}).get("data")
    if not data_dir:
        raise NmtserveError("no evaluation data: give --data DIR or --file FILE [TARGET_FILE]")
    path = split_file(data_dir, args.split)
    return read_corpus([path]).pairs, str(path)


def cmd_evaluate(args) -> int:
    from training.checkpoint import load_model
    from training.evaluate import evaluate_pairs

    loaded = load_model(args.checkpoint, device=args.device)
    pairs, source = _split_pairs(args, loaded.payload)
    if args.limit:
        pairs = pairs[: args.limit]
    if not pairs:
        raise NmtserveError(f"{source}: no sentence pairs to evaluate")
    scores, hyps = evaluate_pairs(loaded.model, loaded.tokenizer, pairs, batch_size=args.batch_size, device=args.device)
    result = {"checkpoint": str(args.checkpoint), "data": source, "split": None if args.file else args.split,
              **scores.to_dict()}
    if args.output:
        Path(args.output).write_text("".join(h + "\n" for h in hyps), encoding="utf-8")
    if args.json:
        _print_json(result)
    else:
        print(f"{source}: BLEU {scores.bleu:.2f}  chrF {scores.chrf:.2f}  exact {scores.exact_match:.1%}  "
              f"({scores.sentences} sentences)")
    return 0


def cmd_translate(args) -> int:
    if args.stream and not args.server:
        raise NmtserveError("--stream needs --server (it calls TranslateStream)")
    if args.stream and args.json:
        raise NmtserveError("--stream prints text as it is decoded; use --json without --stream")
    if args.server:
        return _translate_remote(args)
    from training.checkpoint import load_model
    from training.decode import translate

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


def cmd_serve(args) -> int:
    import asyncio
    import logging

    from server.app import serve
    from server.config import ServerConfig

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    config = ServerConfig(**{f.name: getattr(args, f.name) for f in fields(ServerConfig)})
    return asyncio.run(serve(config))


# ---------------------------------------------------------------- export
def cmd_export(args) -> int:
    from export.exporter import ExportConfig, export_bundle, parse_variants

    cfg = ExportConfig(args.checkpoint, args.out, parse_variants(args.variants), args.verify, args.verify_split,
                       args.verify_limit, args.source_lang, args.target_lang)
    manifest = export_bundle(cfg)
    report = manifest.get("verification")
    if args.json:
        _print_json(manifest)
    else:
        print(f"wrote bundle {args.out} with variants {', '.join(manifest['variants'])}")
        if report:
            for name, ok in report["checks"].items():
                print(f"  {'pass' if ok else 'FAIL'}  {name}")
            for name, why in report["not_measured"].items():
                print(f"  not measured  {name}: {why}")
    if report and not report["passed"]:
        failed = [name for name, ok in report["checks"].items() if not ok]
        print(f"nmtserve export: verification failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


# ---------------------------------------------------------------- bench
def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def cmd_bench_offline(args) -> int:
    from loadtests.bench_offline import ENGINES, BenchConfig, format_table, run_bench

    engines = tuple(e.strip() for e in args.engines.split(","))
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        raise NmtserveError(f"--engines: unknown {', '.join(unknown)}; choose from {', '.join(ENGINES)}")
    report = run_bench(BenchConfig(args.bundle, args.checkpoint, args.sentences, args.runs, args.threads,
                                   args.batch_sizes, engines, args.split))
    print(json.dumps(report, indent=2) if args.json else format_table(report))
    return 0


def cmd_bench_served(args) -> int:
    from loadtests.bench_served import MODES, ServedBenchConfig, format_table, run_served_bench

    modes = tuple(m.strip() for m in args.modes.split(","))
    if not modes or any(m not in MODES for m in modes):
        raise NmtserveError(f"--modes {args.modes!r}: choose from {', '.join(MODES)}")
    report = run_served_bench(ServedBenchConfig(args.bundle, args.sentences, args.concurrency, args.requests, args.runs,
                                                args.threads, args.variant, args.max_running_rows, args.device, modes,
                                                server_flags=args.server_flag or []))
    print(format_table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


# ---------------------------------------------------------------- load tests
def cmd_loadtest(args) -> int:
    from loadtests.run import LoadTestConfig, run_loadtest

    return run_loadtest(LoadTestConfig(args.scenario, args.bundle, args.server or "", args.peak_users, args.seconds,
                                       args.out or "", args.sentences or "", args.slo or "", args.think_time,
                                       args.server_flag or []))


def cmd_check_slo(args) -> int:
    from loadtests import slo

    objectives = slo.load_slo(args.slo)
    lines, met = slo.verdict(objectives, slo.read_stats(args.results))
    print("\n".join(lines))
    if met:
        print(f"all {len(objectives)} objectives met")
    return 0 if met else 1


# ---------------------------------------------------------------- parser
def _add_train_args(p: argparse.ArgumentParser) -> None:
    from training.model import PRESETS
    from training.train import TrainConfig

    d = TrainConfig()
    p.add_argument("--out", default=d.out, help="run directory: checkpoints, logs, TensorBoard (default %(default)s)")
    p.add_argument("--data", default=d.data, help="a directory written by `nmtserve data`")
    p.add_argument("--train", nargs="+", metavar="FILE", help="a TSV file (source<TAB>target) or a Moses pair SRC TGT")
    p.add_argument("--valid", nargs="+", metavar="FILE", help="validation data, same forms as --train")
    p.add_argument("--preset", default=d.preset, choices=list(PRESETS), help="model size (default %(default)s)")
    p.add_argument("--pre-norm", action="store_true", help="pre-LN residual blocks instead of the paper's post-LN")
    p.add_argument("--dropout", type=float, default=d.dropout)
    p.add_argument("--vocab-size", type=int, default=d.vocab_size, help="SentencePiece vocabulary size (upper bound)")
    p.add_argument("--max-len", type=int, default=d.max_len, help="skip pairs longer than this many tokens")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="padded tokens per batch")
    p.add_argument("--lr-factor", type=float, default=d.lr_factor, help="scales the paper's learning-rate schedule")
    p.add_argument("--warmup", type=int, default=d.warmup, help="warm-up steps of the schedule")
    p.add_argument("--label-smoothing", type=float, default=d.label_smoothing)
    p.add_argument("--clip-norm", type=float, default=d.clip_norm, help="gradient clipping (0: off)")
    p.add_argument("--max-steps", type=int, default=d.max_steps)
    p.add_argument("--max-minutes", type=float, default=d.max_minutes, help="wall-clock training budget")
    p.add_argument("--epochs", type=int, default=d.epochs)
    p.add_argument("--valid-every", type=int, default=d.valid_every, help="validate and checkpoint every N steps")
    p.add_argument("--valid-bleu-sentences", type=int, default=d.valid_bleu_sentences)
    p.add_argument("--log-every", type=int, default=d.log_every)
    p.add_argument("--keep-checkpoints", type=int, default=d.keep_checkpoints)
    p.add_argument("--average-last", type=int, default=d.average_last,
                   help="at the end, average the last N periodic checkpoints into average.pt")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--resume", action="store_true", help="continue exactly from OUT/last.pt")
    p.add_argument("--device", default=d.device, help="auto, cpu or cuda")


def _add_serve_parser(sub) -> None:
    from server.config import ServerConfig, defaults_from_env, env_name

    d = ServerConfig(**defaults_from_env())
    p = sub.add_parser("serve", help="serve a bundle over gRPC (flags also read NMTSERVE_* variables)")
    p.add_argument("bundle", nargs="?" if d.bundle else None, default=d.bundle)
    helps = {"threads": "ONNX Runtime intra-op threads", "device": "cpu or cuda",
             "io_binding": "auto, on or off: keep K/V caches on the device between steps (auto: on for cuda)", "max_running_rows": "rows in the running decoder batch",
             "max_batch_tokens": "Σ source + output-budget tokens of running rows",
             "max_waiting": "waiting requests before RESOURCE_EXHAUSTED", "drain_timeout": "seconds to finish in-flight work on SIGTERM",
             "tls_cert": "server certificate chain (PEM); turns TLS on", "tls_key": "its private key (PEM)",
             "tls_client_ca": "PEM roots for client certificates; turns mutual TLS on (clients must present one)"}
    for f in fields(ServerConfig):
        if f.name == "bundle":
            continue
        value = getattr(d, f.name)
        p.add_argument("--" + f.name.replace("_", "-"), type=type(value), default=value,
                       help=f"{helps.get(f.name, '')} (env {env_name(f.name)}; default %(default)s)".strip())
    p.set_defaults(func=cmd_serve)


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="nmtserve", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=ArgumentParser)

    p = sub.add_parser("data", help="generate the built-in English→French corpus")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--pairs", type=int, default=200_000, help="training pairs (default %(default)s)")
    p.add_argument("--valid", type=int, default=1000)
    p.add_argument("--test", type=int, default=2000)
    p.add_argument("--novel", type=int, default=1000, help="test pairs whose (subject, verb, object) never occur in train")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--workers", type=int, default=None, help="processes (default: all cores); output does not depend on it")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_data)

    p = sub.add_parser("train", help="train a model")
    _add_train_args(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("average", help="average checkpoints of one run")
    p.add_argument("checkpoints", nargs="+")
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_average)

    p = sub.add_parser("evaluate", help="BLEU and chrF of greedy translations")
    p.add_argument("checkpoint")
    p.add_argument("--split", default="test", help="split of the data directory (default %(default)s)")
    p.add_argument("--data", help="data directory (default: the one the checkpoint was trained on)")
    p.add_argument("--file", nargs="+", metavar="FILE", help="evaluate on a TSV file or a Moses pair instead")
    p.add_argument("--limit", type=int, default=0, help="only the first N pairs")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--output", help="write the translations here")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_evaluate)

    p = sub.add_parser("export", help="export a checkpoint to an ONNX bundle")
    p.add_argument("checkpoint")
    p.add_argument("--out", required=True, help="bundle directory")
    p.add_argument("--variants", default="fp32,int8", help="comma-separated: fp32, int8 (CPU), fp16 (CUDA)")
    p.add_argument("--verify", action="store_true", help="check the bundle against PyTorch (exit 1 if a check fails)")
    p.add_argument("--verify-split", default="test", help="data split for the end-to-end checks (default %(default)s)")
    p.add_argument("--verify-limit", type=int, default=0, help="only the first N pairs of that split (0: all)")
    p.add_argument("--source-lang", default="", help="source language code for the manifest "
                   "(default: the training data's corpus.json; the built-in corpus is en)")
    p.add_argument("--target-lang", default="", help="target language code (likewise; the built-in corpus is fr)")
    p.add_argument("--json", action="store_true", help="print the manifest")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("bench", help="benchmarks")
    bench = p.add_subparsers(dest="bench", required=True, parser_class=ArgumentParser)
    p = bench.add_parser("offline", help="PyTorch vs ONNX Runtime vs CTranslate2 on the same weights and sentences")
    p.add_argument("bundle")
    p.add_argument("--checkpoint", help="default: the bundle's source checkpoint")
    p.add_argument("--sentences", type=int, default=300, help="first N sentences of the split (default %(default)s)")
    p.add_argument("--split", default="test")
    p.add_argument("--runs", type=int, default=5, help="runs per engine and batch size; the median is reported")
    p.add_argument("--threads", type=int, default=2, help="intra-op threads of every engine")
    p.add_argument("--batch-sizes", type=_int_list, default=(1, 8, 32, 64))
    p.add_argument("--engines", default="pytorch,ort_fp32,ort_int8,ct2_fp32,ct2_int8")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_bench_offline)
    p = bench.add_parser("served", help="served throughput and latency: continuous vs static batching, vs batch-1 ORT")
    p.add_argument("bundle")
    p.add_argument("--sentences", help="sentence file (.tsv: first column; else one per line); default: the test split")
    p.add_argument("--concurrency", type=_int_list, default=(1, 8, 32, 128), help="closed-loop clients per cell")
    p.add_argument("--requests", type=int, default=0, help="requests per cell (0: max(48, 4 × concurrency))")
    p.add_argument("--runs", type=int, default=3, help="runs per cell; the median is reported")
    p.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads of servers and baseline")
    p.add_argument("--variant", default="fp32")
    p.add_argument("--max-running-rows", type=int, default=64)
    p.add_argument("--device", default="cpu", help="cpu or cuda, for the servers and the baseline")
    p.add_argument("--modes", default="continuous,static")
    p.add_argument("--server-flag", action="append", help="extra flag for both servers, e.g. --server-flag=--io-binding=off")
    p.add_argument("--json", metavar="FILE", help="also write the report here")
    p.set_defaults(func=cmd_bench_served)

    p = sub.add_parser("translate", help="translate sentences with a checkpoint, or through a server")
    p.add_argument("inputs", nargs="*", metavar="CHECKPOINT_OR_TEXT",
                   help="CHECKPOINT TEXT… (PyTorch reference), or TEXT… with --server; stdin lines if no TEXT")
    p.add_argument("--server", help="HOST:PORT (or dns:///HOST:PORT) of `nmtserve serve`")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds, with --server")
    p.add_argument("--wait", type=float, default=0.0, help="with --server: first wait up to this many seconds for SERVING")
    p.add_argument("--stream", action="store_true", help="with --server: print each translation as it is decoded (TranslateStream)")
    p.add_argument("--tls-ca", default="", help="with --server: PEM roots that sign the server's certificate (turns TLS on)")
    p.add_argument("--tls-cert", default="", help="with --server: client certificate (PEM) for mutual TLS")
    p.add_argument("--tls-key", default="", help="with --server: the client certificate's private key (PEM)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--max-length", type=int, default=None,
                   help="most target tokens per sentence (default: 256 locally; the server's own limit with --server)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_translate)

    _add_serve_parser(sub)

    p = sub.add_parser("loadtest", help="run a locust scenario headless against a server (started on loopback if none)")
    p.add_argument("--scenario", default="steady", help="steady, step, spike or overload (default %(default)s)")
    p.add_argument("--bundle", default="bundles/default", help="bundle to serve, and whose test split is sent")
    p.add_argument("--server", help="HOST:PORT of a running server instead of starting one")
    p.add_argument("--peak-users", type=int, default=32, help="users (requests in flight) at the peak")
    p.add_argument("--seconds", type=float, default=60.0, help="length of the scenario; the run stops by itself")
    p.add_argument("--out", help="results directory (default runs/loadtest/SCENARIO)")
    p.add_argument("--sentences", help="sentence file (.tsv: first column; else one per line)")
    p.add_argument("--slo", help="SLO file (TOML) to check the results against (exit 1 if violated)")
    p.add_argument("--think-time", type=float, default=0.0, help="mean seconds a user waits between calls")
    p.add_argument("--server-flag", action="append", help="extra flag for the started server (repeat)")
    p.set_defaults(func=cmd_loadtest)

    p = sub.add_parser("check-slo", help="check a load test's results against service-level objectives")
    p.add_argument("results", help="results directory of `nmtserve loadtest`, or a locust *_stats.csv")
    p.add_argument("--slo", required=True, help="SLO file (TOML): p95_latency_ms, p95_time_to_first_token_ms, "
                   "max_error_rate, min_throughput_rps")
    p.set_defaults(func=cmd_check_slo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except NmtserveError as e:
        print(f"nmtserve {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (OSError, ValueError) as e:
        print(f"nmtserve {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"nmtserve {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a bug, not a user error: still one line, the traceback on request
        if os.environ.get("NMTSERVE_DEBUG"):
            raise
        first = str(e).splitlines()[0][:300] if str(e) else ""
        print(f"nmtserve {args.command}: internal error: {type(e).__name__}: {first} "
              f"(set NMTSERVE_DEBUG=1 for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
