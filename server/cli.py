"""The `serve` command (the base install): flags, each also an NMTSERVE_* variable (server/config.py).

    nmtserve serve bundles/default --port 50051
    nmtserve serve bundles/en-fr bundles/fr-en          # several models, one engine each
    NMTSERVE_VARIANT=int8 NMTSERVE_THREADS=1 nmtserve serve bundles/default
"""

from __future__ import annotations

HELPS = {"models": "TOML file of the models to serve: bundle, id, variant, device, threads, inter_threads each (server/models.py)",
         "threads": "ONNX Runtime intra-op threads (of each engine)", "device": "cpu or cuda",
         "variant": "the bundle's graphs: fp32 or int8 on cpu, fp16 on cuda (empty: fp32 on cpu, fp16 on cuda)",
         "inter_threads": "engines per model (CTranslate2's name): running batches decoded at once, each on a thread "
                          "of its own with its own --max-running-rows and --max-waiting (2 × 1 thread beat 1 × 2 "
                          "under load on a CPU); 1 on cuda",
         "io_binding": "auto, on or off: keep K/V caches on the device between steps (auto: on for cuda)",
         "attention_kernel": "auto, on or off: the bundle's graphs on nmtserve's decoding kernels (attention, search head, "
                             "int8 scales per row) in place of its portable ones (auto: on a CPU where the kernel "
                             "library is built for this onnxruntime: make kernels; the log and GetModelInfo say which)",
         "max_running_rows": "rows in each model's running decoder batch (a beam search takes beam_size rows)",
         "admit_rows": "continuous batching: newcomers join a running batch once this many of their rows wait and are free (at most 1/4 of --max-running-rows) …",
         "admit_steps": "… or once this many decoder steps have passed since the latest admission",
         "max_burst_steps": "when every running request is greedy and none streams, up to this many decoder steps "
                            "run at once in nmtserve's library, with no Python between them, through the rows' ends "
                            "(each request is handed back as it finishes) until newcomers may join (needs the kernels "
                            "on a CPU); 1: one step at a time",
         "max_beam_size": "highest DecodingOptions.beam_size accepted (lowered to --max-running-rows)",
         "max_batch_tokens": "Σ source + output-budget tokens of running rows",
         "max_waiting": "waiting requests per model before RESOURCE_EXHAUSTED",
         "drain_timeout": "seconds to finish in-flight work on SIGTERM",
         "max_connection_age": "seconds after which a client's connection is asked to go away (GOAWAY, ±10%%) once "
                               "its calls end, so that clients reconnect and spread over replicas added since; 0: never",
         "max_connection_age_grace": "seconds the calls still running on such a connection may take before it closes",
         "keepalive_time": "seconds between the server's pings of an idle connection",
         "keepalive_timeout": "seconds a ping may go unanswered before the connection is closed",
         "metrics_port": "Prometheus /metrics on this HTTP port (Triton's metrics port; not 9090, where Prometheus "
                         "itself listens); -1 turns it off",
         "http_port": "the HTTP/JSON front on this port: the RPCs as JSON (/v1/…, streams as server-sent events), "
                      "LibreTranslate's /translate and /languages, /openapi.json; -1 turns it off, 0 picks a free port",
         "stream_interval": "TranslateStream: send a delta once this many tokens have come since the last one "
                            "(vLLM's --stream-interval): fewer messages and less event-loop work per stream; 1 sends each",
         "api_keys": "TOML file of API keys, one [[client]] each (name, sha256 of the key, models): calls must send "
                     "`authorization: Bearer KEY`; read again when it changes or on SIGHUP (server/auth.py); "
                     "empty: every client may use every model",
         "access_log": "errors: a log line for each RPC that did not end OK (logger nmtserve.access: its sizes, "
                       "timings, status, client and request id); on: for every RPC; off: none",
         "tracing": "otlp: OpenTelemetry spans of each call (queueing, encoder admission, decoding) to the collector "
                    "of OTEL_EXPORTER_OTLP_ENDPOINT (the otel extra); off: none",
         "tls_cert": "server certificate chain (PEM); turns TLS on", "tls_key": "its private key (PEM)",
         "tls_client_ca": "PEM roots for client certificates; turns mutual TLS on (clients must present one)"}


def cmd_serve(args) -> int:
    import asyncio

    from nmtserve.errors import ConfigError
    from nmtserve.server.app import serve
    from nmtserve.server.config import ServerConfig, flag_fields

    values = {f.name: getattr(args, f.name) for _, f in flag_fields()}
    if isinstance(values["bundle"], list):  # BUNDLE [BUNDLE …] given
        if values["bundle"] and values["models"]:
            raise ConfigError("give bundle directories or --models FILE, not both")
        values["bundle"] = ",".join(values["bundle"])
    config = ServerConfig.from_flags(**values)
    return asyncio.run(serve(config))


def cmd_api_key(args) -> int:
    """A new random key, once, on stderr (give it to the client; nothing keeps it), and the client's entry of the
    key file on stdout, holding only the key's SHA-256."""
    import secrets
    import sys

    from nmtserve.server.auth import client_entry

    key = "nmt-" + secrets.token_urlsafe(32)
    limits = {k: v for k, v in (("max_concurrent", args.max_concurrent), ("chars_per_minute", args.chars_per_minute))
              if v is not None}
    print(f"API key of client {args.name} (shown once; the file keeps only its SHA-256): {key}", file=sys.stderr)
    print(client_entry(args.name, key, args.model, **limits), end="")
    return 0


def _positive(text: str) -> int:
    import argparse

    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number above 0, got {text!r}")
    return int(text)


def add_parser(sub, name: str, help_text: str) -> None:
    if name == "api-key":
        p = sub.add_parser(name, help=help_text)
        p.add_argument("name", help="the client's name, in logs and metrics (never the key)")
        p.add_argument("--model", action="append", help="a model the client may use (repeat; default: every one)")
        p.add_argument("--max-concurrent", type=_positive, help="its translation calls in flight at once")
        p.add_argument("--chars-per-minute", type=_positive, help="its source characters a minute")
        p.set_defaults(func=cmd_api_key)
        return
    _add_serve_parser(sub, name, help_text)


def _add_serve_parser(sub, name: str, help_text: str) -> None:
    from nmtserve.server.config import SECTIONS, ServerConfig, defaults_from_env, env_name, flag_fields

    d = ServerConfig.from_flags(**defaults_from_env()).flat()  # a bad NMTSERVE_* value is a ConfigError naming it
    p = sub.add_parser(name, help=help_text)
    p.add_argument("bundle", nargs="*", default=d["bundle"],
                   help=f"bundle directories, one model each (env {env_name('bundle')}, comma-separated)")
    groups = {name: p.add_argument_group(name, kind.__doc__) for name, kind in SECTIONS.items()}
    for section, f in flag_fields():
        if f.name == "bundle":
            continue
        value = d[f.name]
        groups[section].add_argument("--" + f.name.replace("_", "-"), type=type(value), default=value,
                                     help=f"{HELPS.get(f.name, '')} (env {env_name(f.name)}; default %(default)s)".strip())
    p.set_defaults(func=cmd_serve)
