"""Commands of nmtserve.loadtests: bench offline|served, loadtest and soak (the loadtest extra), check-slo.

    nmtserve bench offline bundles/default          # PyTorch (train extra) vs ONNX Runtime vs CTranslate2 (bench extra)
    nmtserve bench served bundles/default           # continuous vs static batching, served over gRPC
    nmtserve bench models bundles/en-fr bundles/fr-en   # one server, two models: a flood on one, the other's latency
    nmtserve bench quotas bundles/default           # one API key floods under its quota: another key's latency
    nmtserve bench documents bundles/default        # a document in one TranslateText call vs separate calls
    nmtserve bench cross-kv bundles/default         # a beam's copies of its cross-attention K/V vs one shared copy
    nmtserve loadtest bundles/default --scenario steady --peak-users 32 --seconds 60 --slo loadtests/slo.toml
    nmtserve loadtest bundles/default --protocol http --slo loadtests/slo.toml   # through the HTTP/JSON front
    nmtserve loadtest bundles/default --scenario replicas   # replicas behind one name: added, drained, killed
    nmtserve check-slo runs/loadtest/steady --slo loadtests/slo.toml
    nmtserve soak bundles/default --seconds 600 --clients 24 --out runs/soak
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from nmtserve.cli import ArgumentParser
from nmtserve.console import Progress, print_json
from nmtserve.errors import NmtserveError


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def cmd_bench_offline(args) -> int:
    from nmtserve.loadtests.bench_offline import (
        BenchConfig,
        check_isolation,
        default_engines,
        draw_chart,
        format_table,
        run_bench,
    )

    _at_least(1, runs=args.runs, repeats=args.repeats)
    engines = (tuple(e.strip() for e in args.engines.split(",")) if args.engines
               else default_engines(args.bundle, args.device))
    cfg = BenchConfig(args.bundle, args.checkpoint, args.sentences, args.runs, args.threads or (), args.batch_sizes,
                      engines, args.sentences_file, args.max_decoding_length, args.beam_size, args.repeats, args.device)
    with Progress(f"bench offline {args.bundle}", unit="measurement") as progress:
        report = run_bench(cfg, progress)
    _show(report, args, format_table, draw_chart)
    leaks = check_isolation(report)
    if leaks:
        raise NmtserveError(f"a measuring process had another engine loaded ({'; '.join(leaks)}): figures not fair")
    return 0


def _at_least(low: int, **flags: int) -> None:
    """NmtserveError naming the first flag below `low`, and its value."""
    for name, value in flags.items():
        if value < low:
            raise NmtserveError(f"--{name.replace('_', '-')} {value}: must be at least {low}")


def _show(report: dict, args, format_table, draw=None) -> None:
    """A bench's report: its table on stdout (--json: the report as JSON instead), and with --report PATH the
    report as JSON there, with its chart beside it (same name, .png) where the bench draws one."""
    if args.json:
        print_json(report)
    else:
        print(format_table(report))
    if not args.report:
        return
    path = Path(args.report)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    if draw is not None:
        draw(report, path.with_suffix(".png"))
    print(f"report: {path}" + (f", chart: {path.with_suffix('.png')}" if draw else ""), file=sys.stderr)


def cmd_bench_served(args) -> int:
    from nmtserve.export.runtime.bundle import default_variant
    from nmtserve.loadtests.bench_served import MODES, ServedBenchConfig, draw_chart, format_table, run_served_bench

    _at_least(1, runs=args.runs, sentences_per_call=args.sentences_per_call, inter_threads=args.inter_threads)
    _at_least(0, requests=args.requests)
    modes = tuple(m.strip() for m in args.modes.split(","))
    if not modes or any(m not in MODES for m in modes):
        raise NmtserveError(f"--modes {args.modes!r}: choose from {', '.join(MODES)}")
    if args.inter_threads > 1 and len(args.threads) > 1:
        raise NmtserveError(f"--inter-threads {args.inter_threads} with --threads {','.join(map(str, args.threads))}: "
                            "a sweep sets the engines itself (1 x n and n x 1)")
    for flag in args.server_flag or []:  # the bench names each server's layout: it sets these two itself
        if flag.split("=")[0] in ("--threads", "--inter-threads"):
            raise NmtserveError(f"--server-flag {flag}: use bench served's own {flag.split('=')[0]}")
    if args.profile and not args.report:
        raise NmtserveError("--profile: give --report PATH too (the profiles are written beside it)")
    cfg = ServedBenchConfig(args.bundle, args.sentences_file, args.concurrency, args.requests, args.runs, args.threads,
                            args.inter_threads, args.variant or default_variant(args.device), args.max_running_rows,
                            args.device, modes, server_flags=args.server_flag or [], decoding=args.decoding,
                            sentences_per_call=args.sentences_per_call,
                            profile=str(Path(args.report).with_suffix("")) + "-profile" if args.profile else "")
    with Progress(f"bench served {args.bundle}", unit="measurement") as progress:
        report = run_served_bench(cfg, progress)
    _show(report, args, format_table, draw_chart)
    return 0


def cmd_loadtest(args) -> int:
    from nmtserve.loadtests.run import LoadTestConfig, run_loadtest

    if args.scenario == "replicas":
        return _replicas(args)

    return run_loadtest(LoadTestConfig(args.scenario, args.bundle, args.server or "", args.peak_users, args.seconds,
                                       args.out or "", args.sentences_file or "", args.slo or "", args.think_time,
                                       args.server_flag or [], args.decoding, args.metrics_url or "",
                                       protocol=args.protocol, workers=args.workers, api_key=args.api_key))


def _replicas(args) -> int:
    """--scenario replicas: replicas behind one name in a network namespace (loadtests/replicas.py); --peak-users
    clients, --seconds split into the run's phases."""
    from nmtserve.loadtests.replicas import ReplicasConfig, run_replicas

    cfg = ReplicasConfig(args.bundle, args.out or "runs/loadtest/replicas", clients=args.peak_users,
                         phase=max(6.0, args.seconds / 5))
    report = run_replicas(cfg)
    for name, check in report["checks"].items():
        figures = ", ".join(f"{k} {v}" for k, v in check.items() if k != "held")
        print(f"{'held' if check['held'] else 'FAILED'}: {name} ({figures})")
    print(f"{report['calls']} calls, {report['failed']} failed; results in {cfg.out}: replicas.json, replicas.png")
    return 0 if all(check["held"] for check in report["checks"].values()) else 1


def cmd_check_slo(args) -> int:
    from nmtserve.loadtests import slo

    objectives = slo.load_slo(args.slo)
    lines, met = slo.verdict(objectives, slo.read_stats(args.results))
    print("\n".join(lines))
    if met:
        print(f"all {len(objectives)} objectives met")
    return 0 if met else 1


def cmd_soak(args) -> int:
    from nmtserve.loadtests.soak import SoakConfig, format_report, run_soak

    if args.seconds <= 0 or args.clients < 1 or args.sample_seconds <= 0:
        raise NmtserveError(f"--seconds {args.seconds}, --clients {args.clients} and --sample-seconds "
                            f"{args.sample_seconds}: each must be positive")
    report = run_soak(SoakConfig(args.bundle, args.server or "", args.metrics_url or "", args.seconds, args.clients,
                                 args.out, args.sentences_file or "", args.seed, sample_seconds=args.sample_seconds,
                                 max_memory_growth=args.max_memory_growth, server_flags=args.server_flag or []))
    if args.json:
        print_json(report)
    else:
        print(format_report(report))
    print(f"report: {Path(args.out) / 'report.json'}", file=sys.stderr)
    return 0 if report["passed"] else 1


def _add_report_flags(p, chart: bool = False) -> None:
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of the table")
    p.add_argument("--report", metavar="PATH", help="also write the report here (JSON)"
                   + (", and its chart beside it (.png)" if chart else ""))


def _add_bench(p) -> None:
    bench = p.add_subparsers(dest="bench", required=True, parser_class=ArgumentParser)
    p = bench.add_parser("offline", help="PyTorch vs ONNX Runtime vs CTranslate2 on the same weights and sentences")
    p.add_argument("bundle")
    p.add_argument("--checkpoint", help="default: the bundle's source checkpoint")
    p.add_argument("--sentences", type=int, default=200, help="first N sentences (default %(default)s)")
    p.add_argument("--sentences-file", help="sentence file (.tsv: first column; else one per line); "
                   "default: the test split of the bundle's training data")
    p.add_argument("--runs", type=int, default=3, help="runs (a process per engine and thread count each); "
                   "median and min–max are reported")
    p.add_argument("--repeats", type=int, default=3, help="passes over the sentences at each batch size within a "
                   "worker; the median pass counts (default %(default)s)")
    p.add_argument("--threads", type=_int_list, help="thread counts to sweep, each as intra-op threads on one batch and "
                   "(ONNX Runtime, CTranslate2) as batches at once (default: half the usable cores, and all)")
    p.add_argument("--batch-sizes", type=_int_list, default=(1, 8, 32, 64))
    p.add_argument("--engines", help="comma-separated, of pytorch, transformers, ort_fp32, ort_int8, ort_fp16, "
                   "ct2_fp32, ct2_int8, ct2_fp16 (default: every one of the device but transformers; for a bundle "
                   "imported from Marian, every one but pytorch)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu (fp32, int8) or cuda (fp16: ort_fp16, ct2_fp16, PyTorch and transformers in fp16; "
                   "threads default to 1)")
    p.add_argument("--beam-size", type=int, default=1, help="1: greedy (default)")
    p.add_argument("--max-decoding-length", type=int, default=256,
                   help="output tokens per sentence at most (default %(default)s)")
    _add_report_flags(p, chart=True)
    p.set_defaults(func=cmd_bench_offline)
    p = bench.add_parser("served", help="served throughput and latency: continuous vs static batching, vs batch-1 ORT")
    p.add_argument("bundle")
    p.add_argument("--sentences-file", help="sentence file (.tsv: first column; else one per line); "
                   "default: the test split")
    p.add_argument("--concurrency", type=_int_list, default=(1, 8, 32, 128), help="closed-loop clients per cell")
    p.add_argument("--requests", type=int, default=0, help="requests per cell (0: max(64, 16 × concurrency))")
    p.add_argument("--runs", type=int, default=3, help="runs per cell; the median is reported")
    p.add_argument("--threads", type=_int_list, default=(2,),
                   help="ONNX Runtime intra-op threads of servers and baseline; several (1,2) are swept as layouts "
                        "1x1, 1x2, 2x1 (engines x threads each), a server each, each mode shown at its best")
    p.add_argument("--inter-threads", type=int, default=1,
                   help="engines per server (serve --inter-threads), each with --threads threads; one thread count only")
    p.add_argument("--variant", help="the servers' and baseline's (default: fp32 on cpu, fp16 on cuda)")
    p.add_argument("--max-running-rows", type=int, default=64)
    p.add_argument("--device", default="cpu", help="cpu or cuda, for the servers and the baseline")
    p.add_argument("--modes", default="continuous,static")
    p.add_argument("--decoding", choices=("greedy", "mixed"), default="greedy",
                   help="mixed: 50%% greedy, 40%% beam 4, 10%% sampled requests")
    p.add_argument("--sentences-per-call", type=int, default=1,
                   help="sentences in each Translate call (default 1; above 1, no OnnxTranslator baseline)")
    p.add_argument("--server-flag", action="append",
                   help="extra flag for both servers, e.g. --server-flag=--io-binding=off")
    p.add_argument("--profile", action="store_true",
                   help="after the runs, one more cell at the most clients for each server, sampled by py-spy: each "
                        "thread's share of the server's CPU and the functions that took most, in the report; the "
                        "stacks beside it (REPORT-profile-MODE-LAYOUT-N-clients.txt, for a flame graph)")
    _add_report_flags(p, chart=True)
    p.set_defaults(func=cmd_bench_served)
    p = bench.add_parser("models", help="two models behind one server: a flood on one, the other's latency")
    p.add_argument("flooded", help="bundle whose model is flooded")
    p.add_argument("probed", help="bundle whose model is probed, one sentence at a time")
    p.add_argument("--flooded-sentences-file", help="sentence file for the flood (default: the bundle's test split)")
    p.add_argument("--probed-sentences-file", help="sentence file for the probes (default: the bundle's test split)")
    _add_flood_flags(p, "seconds the flood alone is measured", "ONNX Runtime intra-op threads of each model")
    p.set_defaults(func=cmd_bench_models)
    p = bench.add_parser("quotas", help="one API key floods the server under its quota: another key's latency")
    p.add_argument("bundle")
    p.add_argument("--sentences-file", help="sentence file (default: the bundle's test split)")
    p.add_argument("--max-concurrent", type=int, default=2, help="the flooding key's quota of calls at once")
    p.add_argument("--chars-per-minute", type=int, help="the flooding key's quota of characters (default: none)")
    p.add_argument("--limiter", metavar="HAPROXY_CFG",
                   help="every call through HAProxy with this configuration in front of the server (the "
                        "deployment's: deploy/kubernetes/overlays/limiter/haproxy.cfg; the keys' own ceilings from "
                        "ceilings.map beside it)")
    p.add_argument("--limiter-calls-per-second", type=int, default=300,
                   help="with --limiter: each client's calls a second (default %(default)s)")
    p.add_argument("--flood-nice", type=int, default=0,
                   help="the flooding process's niceness (19: it takes cores only when the server leaves them, as a "
                        "client on another host would)")
    _add_flood_flags(p, "seconds the probes run under each flood", "ONNX Runtime intra-op threads")
    p.set_defaults(func=cmd_bench_quotas)
    p = bench.add_parser("cross-kv", help="a beam's copies of its cross-attention K/V against one shared copy")
    p.add_argument("bundle")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--beam-size", type=int, default=4)
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads")
    p.add_argument("--sentences-file", help="sentence file (default: the bundle's test split)")
    _add_report_flags(p)
    p.set_defaults(func=cmd_bench_cross_kv)
    p = bench.add_parser("documents", help="a document in one TranslateText call vs its sentences in separate calls")
    p.add_argument("bundle")
    p.add_argument("--sentences-file", help="sentence file (default: the bundle's test split)")
    p.add_argument("--sentences", type=int, default=50, help="sentences in the document (default %(default)s)")
    p.add_argument("--max-decoding-length", type=int, default=32)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads of the server")
    _add_report_flags(p)
    p.set_defaults(func=cmd_bench_documents)


def _add_flood_flags(p, seconds_help: str, threads_help: str) -> None:
    """The flags of the benchmarks where one client floods and another probes (loadtests/flood.py)."""
    p.add_argument("--flood-clients", type=int, default=16)
    p.add_argument("--flood-sentences", type=int, default=8, help="sentences per flood call")
    p.add_argument("--probes", type=int, default=30, help="probe calls per run and phase")
    p.add_argument("--seconds", type=float, default=15.0, help=seconds_help)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help=threads_help)
    p.add_argument("--max-decoding-length", type=int, default=32, help="of every call (default %(default)s)")
    _add_report_flags(p)


def cmd_bench_models(args) -> int:
    from nmtserve.loadtests.bench_models import ModelsBenchConfig, format_table, run_models_bench

    cfg = ModelsBenchConfig(args.flooded, args.probed, args.flooded_sentences_file, args.probed_sentences_file,
                            args.flood_clients, args.flood_sentences, args.probes, args.seconds, args.runs, args.threads,
                            args.max_decoding_length)
    with Progress(f"bench models {args.flooded} {args.probed}", unit="measurement") as progress:
        report = run_models_bench(cfg, progress)
    _show(report, args, format_table)
    return 0


def cmd_bench_quotas(args) -> int:
    from nmtserve.loadtests.bench_quotas import QuotasBenchConfig, format_table, run_quotas_bench

    _at_least(1, max_concurrent=args.max_concurrent, flood_clients=args.flood_clients, runs=args.runs,
              probes=args.probes, chars_per_minute=args.chars_per_minute or 1,
              limiter_calls_per_second=args.limiter_calls_per_second)
    if not 0 <= args.flood_nice <= 19:
        raise NmtserveError(f"--flood-nice {args.flood_nice}: between 0 and 19")
    cfg = QuotasBenchConfig(args.bundle, args.sentences_file, args.max_concurrent, args.chars_per_minute,
                            args.flood_clients, args.flood_sentences, args.probes, args.seconds, args.runs,
                            args.threads, args.max_decoding_length, args.limiter, args.limiter_calls_per_second,
                            args.flood_nice)
    with Progress(f"bench quotas {args.bundle}", unit="measurement") as progress:
        report = run_quotas_bench(cfg, progress)
    _show(report, args, format_table)
    return 0


def cmd_bench_cross_kv(args) -> int:
    from nmtserve.loadtests.bench_cross_kv import CrossKvBenchConfig, format_table, run_cross_kv_bench

    report = run_cross_kv_bench(CrossKvBenchConfig(args.bundle, args.requests, args.beam_size, args.runs, args.threads,
                                                   args.sentences_file))
    _show(report, args, format_table)
    return 0


def cmd_bench_documents(args) -> int:
    from nmtserve.loadtests.bench_documents import DocumentsBenchConfig, format_table, run_documents_bench

    cfg = DocumentsBenchConfig(args.bundle, args.sentences_file, args.sentences, args.max_decoding_length, args.runs,
                               args.threads)
    with Progress(f"bench documents {args.bundle}", unit="measurement") as progress:
        report = run_documents_bench(cfg, progress)
    _show(report, args, format_table)
    return 0


def _add_loadtest(p) -> None:
    p.add_argument("--scenario", default="steady", help="steady, step, spike or overload (default %(default)s); "
                   "replicas: three replicas behind one name in a network namespace (root), one added, one drained, "
                   "one killed (loadtests/replicas.py)")
    p.add_argument("bundle", nargs="?", default="bundles/default", help="bundle to serve, and whose test split is "
                   "sent (default %(default)s); comma-separated: one server of several models, each sent its own "
                   "bundle's test split")
    p.add_argument("--server", help="HOST:PORT of a running server instead of starting one")
    p.add_argument("--metrics-url", help="with --server: its /metrics URL, to say where a call's time went "
                   "(queue, decoding, outside the server)")
    p.add_argument("--peak-users", type=int, default=32, help="users (requests in flight) at the peak")
    p.add_argument("--seconds", type=float, default=60.0, help="length of the scenario; the run stops by itself")
    p.add_argument("--out", help="results directory (default runs/loadtest/SCENARIO)")
    p.add_argument("--sentences-file", help="sentence file (.tsv: first column; else one per line) for every model, or "
                   "MODEL=FILE pairs, comma-separated")
    p.add_argument("--slo", help="SLO file (TOML) to check the results against (exit 1 if violated)")
    p.add_argument("--think-time", type=float, default=0.0, help="mean seconds a user waits between calls")
    p.add_argument("--decoding", choices=("default", "mixed"), default="default",
                   help="default: each model's own decoding options; mixed: 50%% greedy, 40%% beam 4, 10%% sampled")
    p.add_argument("--server-flag", action="append", help="extra flag for the started server (repeat)")
    p.add_argument("--protocol", choices=("grpc", "http"), default="grpc",
                   help="grpc, or http: the same calls through the HTTP/JSON front (--server: its http://HOST:PORT)")
    p.add_argument("--api-key", default=os.environ.get("NMTSERVE_API_KEY", ""),
                   help="for a server with --api-keys (default: NMTSERVE_API_KEY)")
    p.add_argument("--workers", type=int, default=0, help="locust's distributed mode: a master and this many worker "
                   "processes, each with its share of the users (a load generator of more than one core); 0: one "
                   "process (default)")
    p.set_defaults(func=cmd_loadtest)


def add_parser(sub, name: str, help_text: str) -> None:
    p = sub.add_parser(name, help=help_text)
    if name == "bench":
        _add_bench(p)
    elif name == "loadtest":
        _add_loadtest(p)
    elif name == "soak":
        p.add_argument("bundle", nargs="?", default="bundles/default",
                       help="bundle to serve, and whose test split is sent (default %(default)s)")
        p.add_argument("--server", help="HOST:PORT of a running server instead of starting one")
        p.add_argument("--metrics-url", help="with --server: its /metrics URL, for memory and the gauges")
        p.add_argument("--seconds", type=float, default=600.0, help="length of the run (default %(default)s)")
        p.add_argument("--clients", type=int, default=24, help="client threads (default %(default)s)")
        p.add_argument("--out", default="runs/soak", help="report.json, memory.png, server.log (default %(default)s)")
        p.add_argument("--sentences-file", help="sentence file (.tsv: first column; else one per line)")
        p.add_argument("--json", action="store_true", help="print the report as JSON instead of the summary")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--sample-seconds", type=float, default=2.0,
                       help="seconds between scrapes of the server's memory and gauges (default %(default)s)")
        p.add_argument("--max-memory-growth", type=float, default=0.10,
                       help="largest allowed growth of resident memory after the warm-up (default %(default)s)")
        p.add_argument("--server-flag", action="append", help="extra flag for the started server (repeat)")
        p.set_defaults(func=cmd_soak)
    elif name == "check-slo":
        p.add_argument("results", help="results directory of `nmtserve loadtest`, or a locust *_stats.csv")
        p.add_argument("--slo", required=True, help="SLO file (TOML): p95_latency_ms, p95_time_to_first_token_ms, "
                       "max_error_rate, min_throughput_rps")
        p.set_defaults(func=cmd_check_slo)
    else:
        raise ValueError(f"nmtserve.loadtests.cli has no command {name!r}")
