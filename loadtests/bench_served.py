"""Served benchmark: throughput and latency of `nmtserve serve` under closed-loop load, continuous
versus static batching on the same bundle, side by side in one run, against OnnxTranslator batch 1.

    nmtserve bench served bundles/default --concurrency 1,8,32,128 --report runs/bench/served.json

Both servers run at once (their engines sleep while idle) and take turns cell by cell within each
run, so drift of the machine hits them alike. Several thread counts (`--threads 1,2`) are swept in
layouts as the offline benchmark's, engines × intra-op threads each: 1 × n for each count n, and n × 1
(`serve --inter-threads n --threads 1`) for each n above 1 on a CPU; a server per mode and layout, all
taking turns in an order rotated from run to run, and each mode is reported at its best layout for each
concurrency (highest steady-state tokens/s), the others beside it: on a small host the engine's
threads compete with gRPC's and the client's for the cores, and the modes need not be best alike.
Each request is one sentence of the bundle's test split, drawn at random (seeded) so that lengths mix
as in traffic; with `--decoding mixed` each request's decoding mode is drawn too (50% greedy, 40% beam
4, 10% sampled, half from the top 10 and half by top-p 0.9: workload.DECODING_MIX), the same draws for every server. Throughput counts target tokens of the best translation (eos
excluded); latency is the client's time for one Translate call, broken down into stages (STAGES)
with the server's Timings, each cell's sentences per admission (one encoder call each) comes from
the server's /metrics (nmtserve_admissions_total), and its CPU a call by whom (`cpu_per_call`: the server's
event loop, engines and other threads, each also waiting for a core, and the client). The baseline is OnnxTranslator on
the same requests at batch 1 (at each thread count; the lowest p50 is reported), in this process
while the servers are idle; with greedy decoding, OnnxTranslator's offline throughput too, in a process of
its own at each layout once a run (bench_offline's worker, on sentences drawn from the same pool, at half the
servers' rows and at all of them), to which each mode's highest steady throughput compares, and the servers'
engines alone (`engines_alone`: a server's model and engines as `serve` loads them, in a process of their own at
each layout, fed the same kind of calls by a closed loop without gRPC, continuous batching): where the served
throughput falls short of the offline one, this says whether the engines or the RPC path around them lose it.
Once a run the RPC path's own cost is measured too (`rpc_floor`, loadtests/grpc_floor.py: a bare grpc.aio
server's no-op call from the same kind of client, as fast as its clients can call and again paced to the calls/s
of the busiest continuous server at the most clients, against whose servicer's CPU a call both compare), and the
two figures that it bounds:
the least served p50 at one client it leaves above the baseline's, and the most a server whose calls cost
only that could reach at saturation against the offline best, its CPU taken from the same cores: once with the
floor's CPU a call at its own saturation, and again with what the floor costs paced to that bound's calls/s
(an event loop woken by fewer calls at a time spends more on each: the second bound is the tighter one).
With `--sentences-per-call N` each call carries N sentences (Translate's `sentences`), so the cost of
a call is paid once for N (no batch-1 baseline then: it compares one-sentence calls).

    nmtserve bench served bundles/default --decoding mixed --concurrency 1,8,32
    nmtserve bench served bundles/default --variant int8 --threads 1,2 --concurrency 1,8,64,128  # 1x1, 1x2, 2x1
    nmtserve bench served bundles/default --sentences-per-call 8 --concurrency 4,16,32
"""

from __future__ import annotations

import json
import math
import queue
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from nmtserve.console import Progress
from nmtserve.errors import NmtserveError
from nmtserve.loadtests.charts import host, legend_outside, pyplot, save
from nmtserve.loadtests.grpc_floor import FLOOR_CLIENTS, grpc_floor
from nmtserve.loadtests.machine import (
    PROBES,
    THREAD_KINDS,
    describe,
    host_probe,
    machine_info,
    thread_times,
    usable_cores,
)
from nmtserve.loadtests.measure import layout_name, percentile, run_measure, run_worker
from nmtserve.loadtests.profile import Sampler
from nmtserve.loadtests.workload import (
    ServerProcess,
    default_sentence_file,
    draw_decoding,
    free_port,
    mixed,
    read_sentences,
    scrape,
)

MODES = ("continuous", "static")
OFFLINE_SENTENCES = 256  # the offline throughput baseline's (offline_spec)
# the series each cell reads from its server's /metrics, before and after (workload.scrape)
ADMISSIONS = {"nmtserve_admissions_total": "admissions", "nmtserve_sentences_total": "sentences"}


@dataclass
class ServedBenchConfig:
    bundle: str
    sentences_file: str | None = None  # default: the bundle's training data test split
    concurrency: tuple[int, ...] = (1, 8, 32, 128)
    requests: int = 0  # per cell; 0: max(64, 16 × concurrency), so that the steady window spans ~14 rounds
    runs: int = 3
    threads: tuple[int, ...] = (2,)  # ONNX Runtime intra-op threads of servers and baseline (as serve); several: swept
    inter_threads: int = 1  # engines per server (serve --inter-threads) when one thread count is given
    variant: str = "fp32"
    max_running_rows: int = 64
    device: str = "cpu"  # cuda: servers and baseline on the GPU (IOBinding, unless a server flag says otherwise)
    modes: tuple[str, ...] = MODES
    seed: int = 0
    server_flags: list[str] = field(default_factory=list)
    decoding: str = "greedy"  # or "mixed": each request's mode drawn from workload.DECODING_MIX
    sentences_per_call: int = 1  # sentences in each Translate call
    profile: str = ""  # where each server's profile goes (PROFILE-MODE-LAYOUT-CLIENTS.txt): an extra cell each, sampled


def work(cfg: ServedBenchConfig, pool: list[str], n: int, seed: int) -> list[tuple[list[str], dict]]:
    """n calls: (sentences, DecodingOptions fields), drawn (seeded) from the pool and the decoding mix."""
    rng, k = random.Random(seed), cfg.sentences_per_call
    sentences = mixed(pool, n * k, seed=seed)
    # greedy says beam_size 1: a call that gave nothing would get the bundle's defaults (beam 4 for OPUS-MT)
    return [(sentences[i * k:(i + 1) * k], draw_decoding(rng)[1] if cfg.decoding == "mixed" else {"beam_size": 1})
            for i in range(n)]


def _cell(target: str, requests: list[tuple[list[str], dict]], concurrency: int) -> dict:
    """Closed loop: `concurrency` client threads (blocking stubs, as most services call), each sends
    its next request when its last one returns; every request is sent exactly once. Throughput is given
    twice: over the whole cell, and at steady state (`steady_window`)."""
    from nmtserve.client import open_channel
    from nmtserve.v1 import translation_pb2 as pb
    from nmtserve.v1 import translation_pb2_grpc as pb_grpc

    latencies: list[float] = []
    in_server: list[float] = []  # the server's own arrival-to-finish time (Timings.total_ns)
    stages: list[list[float]] = []  # per request, seconds in each of STAGES
    tokens, translated = [0], [0]  # target tokens, sentences
    finished: list[tuple[float, int]] = []  # (when, target tokens) of each request, in completion order
    last_sent = [0.0]
    queue, lock = iter(requests), threading.Lock()
    with open_channel(target) as channel:
        stub = pb_grpc.TranslationServiceStub(channel)

        def client():
            while True:
                with lock:
                    request = next(queue, None)
                    if request is None:
                        return
                    t0 = last_sent[0] = time.perf_counter()
                sentences, options = request
                response = stub.Translate(pb.TranslateRequest(sentences=sentences, options=pb.DecodingOptions(**options)),
                                          timeout=120)
                elapsed = time.perf_counter() - t0
                produced = sum(t.output_tokens for t in response.translations)
                last = max(response.translations, key=lambda t: t.timings.total_ns)  # the one the call waited for
                with lock:
                    finished.append((t0 + elapsed, produced))
                    latencies.append(elapsed)
                    in_server.append(last.timings.total_ns / 1e9)
                    stages.append(_stages(last.timings, elapsed))
                    tokens[0] += produced
                    translated[0] += len(response.translations)

        threads = [threading.Thread(target=client) for _ in range(concurrency)]
        started = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - started
    return {"seconds": elapsed, "requests": len(latencies), "sentences": translated[0], "output_tokens": tokens[0],
            "tokens_per_s": tokens[0] / elapsed,
            "steady_tokens_per_s": steady_window(finished, last_sent[0], concurrency) or tokens[0] / elapsed,
            "requests_per_s": len(latencies) / elapsed,
            "p50_ms": percentile(latencies, 50) * 1e3, "p90_ms": percentile(latencies, 90) * 1e3,
            "p99_ms": percentile(latencies, 99) * 1e3, "server_p50_ms": percentile(in_server, 50) * 1e3,
            "stages_mean_ms": {name: statistics.fmean(s[i] for s in stages) * 1e3 for i, name in enumerate(STAGES)}}


def steady_window(finished: list[tuple[float, int]], last_sent: float, concurrency: int) -> float | None:
    """Target tokens/s while every client is busy and the first round is over: the tokens of the requests
    finished after the `concurrency`-th completion and before the last request was sent, over that time.
    A whole cell's figure also counts the start, when every client sends at once and nothing has come
    back yet, and the tail, when fewer and fewer clients have work (a quarter of the cell's time at 4
    requests per client). None when the window is empty (too few requests per client)."""
    start = finished[min(concurrency, len(finished)) - 1][0]
    inside = [n for when, n in finished if start < when <= last_sent]
    return sum(inside) / (last_sent - start) if inside else None


# where a one-sentence call's time goes, from the server's Timings and the client's latency; the
# stages add up to the latency, so their means add up to the mean latency
STEP_ROWS = (1, 8, 16, 32, 48, 64, 128, 256)  # step_ms_by_rows: the batch sizes timed, up to --max-running-rows
STAGES = ("prepare", "queue", "encode", "first step", "later steps", "hand-back", "response", "gRPC + client")


def _stages(t, latency: float) -> list[float]:
    """Seconds per stage of STAGES (of the sentence a call waited for longest): validation and
    tokenization; the engine's queue; the encoder call that took the sentence in; admission into the
    running batch and the first decoder step; the other steps; the engine-to-event-loop hand-back (from
    the last sentence's end to the handler's resumption); detokenization and the response's construction;
    gRPC (both ways) and the client."""
    prepare, queue, encoded, first, total, resumed, handler = (x / 1e9 for x in (
        t.prepare_ns, t.queue_ns, t.encoded_ns, t.time_to_first_token_ns, t.total_ns, t.resumed_ns, t.handler_ns))
    return [prepare, queue, encoded - queue, first - encoded, total - first, resumed - prepare - total,
            handler - resumed, latency - handler]


def cpu_per_call(before: dict | None, after: dict | None, client_seconds: float, calls: int) -> dict | None:
    """A cell's CPU, ms a call: `run` by each kind of the server's threads (machine.THREAD_KINDS, from
    `thread_times` before and after) and by the client (this process: the cell's client threads and gRPC's, which
    share the host's cores with the server here), and `waiting` (runnable, for a core) by each kind of the
    server's; None where the server's threads cannot be read."""
    if before is None or after is None:
        return None
    run = {kind: (after[kind][0] - before[kind][0]) * 1e3 / calls for kind in THREAD_KINDS}
    return {"run": {**run, "client": client_seconds * 1e3 / calls},
            "waiting": {kind: (after[kind][1] - before[kind][1]) * 1e3 / calls for kind in THREAD_KINDS}}


def served_defaults(bundle):
    """How a server with serve's default limits decodes what a call leaves unset (models.bundle_defaults): the
    bundle's decoding defaults (an imported Marian model's beam, length penalty and stopping rule)."""
    from nmtserve.server.config import LimitsConfig
    from nmtserve.server.models import bundle_defaults

    defaults, output_tokens = bundle_defaults(
        bundle.manifest, min(LimitsConfig().max_decoding_length, bundle.limits.max_target_tokens))
    return replace(defaults, max_decoding_length=output_tokens)


def offline_spec(cfg: ServedBenchConfig, pool: list[str]) -> dict:
    """The offline baseline's work (a bench_offline worker's spec): OFFLINE_SENTENCES sentences drawn from the
    pool as the cells draw them, greedy as the servers decode the greedy calls, at half the servers' rows and
    at all of them: the most tokens/s OnnxTranslator makes of such sentences, to which the servers' best
    throughput at saturation compares."""
    from nmtserve.export.runtime.bundle import load_bundle

    bundle = load_bundle(cfg.bundle)
    tokenizer, limit = bundle.tokenizer(), bundle.limits.max_source_tokens
    sources = [tokenizer.encode(t, limit) or [bundle.special_ids["eos"]] for t in mixed(pool, OFFLINE_SENTENCES, cfg.seed)]
    return {"bundle": cfg.bundle, "device": cfg.device, "sources": sources, "repeats": 1,
            "batch_sizes": sorted({max(1, cfg.max_running_rows // 2), cfg.max_running_rows}),
            "search": asdict(served_defaults(bundle).override(beam_size=1)), "prefix": tokenizer.target_prefix()}


def max_waiting(cfg: ServedBenchConfig) -> int:
    """The servers' --max-waiting (and the engines alone's): room for every sentence the largest cell has in flight."""
    return max(256, 2 * max(cfg.concurrency) * cfg.sentences_per_call)


def engines_spec(cfg: ServedBenchConfig, pool: list[str]) -> dict:
    """The engines-alone measure's work (`engines_alone`): calls drawn as the cells draw them (as many as a cell's,
    at least 16 a client), as many clients as the largest cell's, and the flags the bench gives its servers (serve's defaults otherwise; --server-flag's are
    not applied)."""
    clients = max(cfg.concurrency)
    return {"bundle": cfg.bundle, "variant": cfg.variant, "device": cfg.device, "max_running_rows": cfg.max_running_rows,
            "max_waiting": max_waiting(cfg), "clients": clients,
            "calls": work(cfg, pool, max(cfg.requests, 16 * clients), seed=cfg.seed - 2)}


def engines_alone(spec: dict, engines: int, threads: int) -> dict:
    """The servers' engines without gRPC: the model loaded as `serve` loads it (server.app.load_model: the same
    translator, EnginePool of `engines` × `threads`, EngineConfig and metrics), each call's one sentence checked
    and tokenized as the server does (ServedModel.source, .options), fed by `clients` closed-loop submitters in
    this thread (each call's successor sent from its on_finish) -> tokens, seconds, tokens/s over the whole run and
    at steady state (`steady_window`), as a cell counts them."""
    from nmtserve.export.runtime.request import FinishReason, Request
    from nmtserve.server.app import load_model, warm_up
    from nmtserve.server.config import ServerConfig
    from nmtserve.server.metrics import ServerMetrics
    from nmtserve.server.models import ModelSpec
    from nmtserve.v1 import translation_pb2 as pb

    config = ServerConfig.from_flags(bundle=spec["bundle"], max_running_rows=spec["max_running_rows"], max_waiting=spec["max_waiting"])
    model = load_model(ModelSpec("bench", spec["bundle"], spec["variant"], spec["device"], threads, engines), config,
                       ServerMetrics())
    warm_up(model.engine)
    languages = model.languages("", "")  # the model's own
    calls = [(model.source("sentence", sentence, languages), *model.options(pb.DecodingOptions(**options)))
             for [sentence], options in spec["calls"]]
    done: queue.SimpleQueue = queue.SimpleQueue()

    def send(i: int) -> None:
        ids, max_tokens, search = calls[i]
        model.engine.submit(Request(ids, max_decoding_length=max_tokens, options=search, on_finish=done.put, scored=False,
                                    prefix=list(languages.prefix)))

    clients = min(spec["clients"], len(calls))
    started = last_sent = time.perf_counter()
    for i in range(clients):
        send(i)
    finished: list[tuple[float, int]] = []
    for i in range(clients, len(calls) + clients):
        request = done.get()
        finished.append((time.perf_counter(), len(request.tokens)))
        if request.finish not in (FinishReason.EOS, FinishReason.LENGTH):
            raise NmtserveError(f"engines alone: a request ended {request.finish} ({request.error})")
        if i < len(calls):
            last_sent = time.perf_counter()
            send(i)
    seconds = time.perf_counter() - started
    model.engine.stop()
    tokens = sum(n for _, n in finished)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "steady_tokens_per_s": steady_window(finished, last_sent, clients) or tokens / seconds}


def run_engines_alone(engines: int, threads: int, spec_path: Path) -> dict:
    """`engines_alone` in a process of its own (nothing else of the bench loaded), on the spec at spec_path."""
    return run_measure(["nmtserve.loadtests.bench_served", "engines"], engines, threads, spec_path, "engines alone")[0]


class Baseline:
    """OnnxTranslator at batch 1 in this process: per-request latency and tokens/s on given requests, and
    the mean time of its two stages: the encoder (`prefill`), then the decoding loop (`decode`: greedy
    or search, as `search_ids` runs them for one source and as the engine decides)."""

    def __init__(self, cfg: ServedBenchConfig, threads: int):
        from nmtserve.export.runtime.translator import OnnxTranslator

        self.threads = threads
        self.tr = OnnxTranslator(cfg.bundle, device=cfg.device, variant=cfg.variant, intra_op_threads=threads)
        self.tr.translate_ids([self.tr.tokenizer.encode("warm up")], max_batch_size=1)
        self.defaults = served_defaults(self.tr.bundle)

    def step_ms_by_rows(self, pool: list[str], largest: int) -> dict[str, float]:
        """One greedy decoder step's time (ms, median of 16 steps, each row 8 to 23 tokens in) at each batch
        size up to `largest` (the servers' --max-running-rows): what a step costs as the running batch fills,
        so the report shows where more rows stop buying throughput (rows / step time)."""
        tr = self.tr
        sources = [tr.tokenizer.encode(s, tr.limits.max_source_tokens) or [tr.eos_id] for s in pool]
        times_by_rows = {}
        for rows in sorted({n for n in STEP_ROWS if n < largest} | {largest}):
            state, times = tr.prefill([sources[i % len(sources)] for i in range(rows)]), []
            for step in range(24):
                t0 = time.perf_counter()
                tr.decode_one_token(state)
                if step >= 8:
                    times.append(time.perf_counter() - t0)
            times_by_rows[str(rows)] = round(statistics.median(times) * 1e3, 3)
        return times_by_rows

    def __call__(self, requests: list[tuple[list[str], dict]]) -> dict:
        tr = self.tr
        latencies, encoding, tokens = [], [], 0
        for [sentence], options in requests:
            source = tr.tokenizer.encode(sentence, tr.limits.max_source_tokens) or [tr.eos_id]
            decoding = self.defaults.override(**options)
            decoding.check(tr.vocab_size)
            t0 = time.perf_counter()
            tr.prefill([source])
            t1 = time.perf_counter()
            # no scores, as the bench's calls ask the servers (greedy then skips the log-softmax in both)
            [[best, *_]] = tr.search_ids([source], decoding, max_batch_size=1, scores=False)
            latencies.append(time.perf_counter() - t1)
            encoding.append(t1 - t0)
            tokens += len(best.tokens)
        return {"threads": self.threads, "p50_ms": percentile(latencies, 50) * 1e3, "p90_ms": percentile(latencies, 90) * 1e3,
                "tokens_per_s": tokens / sum(latencies), "encode_ms": statistics.fmean(encoding) * 1e3,
                "steps_ms": (statistics.fmean(latencies) - statistics.fmean(encoding)) * 1e3}


def layouts(cfg: ServedBenchConfig) -> list[tuple[int, int]]:
    """(engines, intra-op threads each) to serve with: the one count given (on inter_threads engines), or,
    for several, each count n as 1 × n and, on a CPU (CUDA takes one engine), as n × 1."""
    if len(cfg.threads) == 1:
        return [(cfg.inter_threads, cfg.threads[0])]
    return [(1, n) for n in cfg.threads] + [(n, 1) for n in cfg.threads if n > 1 and cfg.device == "cpu"]


def run_served_bench(cfg: ServedBenchConfig, progress: Progress) -> dict:
    pool = read_sentences(cfg.sentences_file or default_sentence_file(cfg.bundle))
    flags = ["--variant", cfg.variant, "--device", cfg.device, "--max-running-rows", str(cfg.max_running_rows),
             "--max-waiting", str(max_waiting(cfg)),
             "--max-sentences", str(max(64, cfg.sentences_per_call)),
             *cfg.server_flags]
    servers_at = [(m, layout) for m in cfg.modes for layout in layouts(cfg)]  # a server each
    cells: dict[tuple[str, tuple[int, int]], dict[int, list[dict]]] = {at: {c: [] for c in cfg.concurrency}
                                                                       for at in servers_at}
    translators = {t: Baseline(cfg, t) for t in cfg.threads} if cfg.sentences_per_call == 1 else {}
    baselines: dict[int, list[dict]] = {t: [] for t in translators}
    # greedy: OnnxTranslator's offline throughput in a process of its own at each layout, once a run
    offline: dict[tuple[int, int], list[dict]] = {layout: [] for layout in layouts(cfg)} if cfg.decoding == "greedy" else {}
    # one-sentence calls: the servers' engines without gRPC, in a process of their own at each layout, once a run
    alone: dict[tuple[int, int], list[dict]] = {layout: [] for layout in layouts(cfg)} \
        if cfg.sentences_per_call == 1 else {}
    floors: list[dict] = []  # the RPC path's own cost (grpc_floor), once a run, every server idle
    profiles: dict[str, dict] = {}  # with cfg.profile: where each server's CPU went (loadtests/profile.py)
    with tempfile.TemporaryDirectory() as logs:
        spec_path, engines_path = Path(logs) / "offline-spec.json", Path(logs) / "engines-spec.json"
        if offline:
            spec_path.write_text(json.dumps(offline_spec(cfg, pool)), encoding="utf-8")
        if alone:
            engines_path.write_text(json.dumps(engines_spec(cfg, pool)), encoding="utf-8")
        ports = {at: free_port() for at in servers_at}  # /metrics: the admissions of each cell
        servers = {}
        try:
            for at in servers_at:
                m, (engines, t) = at
                servers[at] = ServerProcess(cfg.bundle, "--batching", m, "--inter-threads", str(engines), "--threads",
                                            str(t), "--metrics-port", str(ports[at]), *flags,
                                            log=Path(logs) / f"{m}-{layout_name(engines, t)}.log")
            for server in servers.values():  # warm-up: the first calls of a channel and a process
                _cell(server.target, work(cfg, pool, 16, seed=-1), 8)
            progress.expect(cfg.runs * (len(cfg.concurrency) + 1))
            for run in range(cfg.runs):
                order = servers_at[run % len(servers_at):] + servers_at[:run % len(servers_at)]  # none always first
                for c in cfg.concurrency:
                    progress.stage(f"run {run + 1}/{cfg.runs}: {c} client(s), {len(order)} server(s)")
                    requests = work(cfg, pool, cfg.requests or max(64, 16 * c), seed=cfg.seed + 1000 * run + c)
                    for at in order:
                        probe = host_probe()  # every server idle: how fast the host runs as the cell starts
                        url = f"http://127.0.0.1:{ports[at]}/metrics"
                        before = scrape(url, ADMISSIONS)
                        threads, client = thread_times(servers[at].proc.pid), time.process_time()
                        cell = _cell(servers[at].target, requests, c)
                        cpu = cpu_per_call(threads, thread_times(servers[at].proc.pid),
                                           time.process_time() - client, len(requests))
                        after = scrape(url, ADMISSIONS)
                        admitted = {k: after[k] - before[k] for k in after}
                        cells[at][c].append({**cell, "host_probe": probe, "cpu_ms_per_call": cpu, "sentences_per_admission":
                                             admitted["sentences"] / max(1.0, admitted["admissions"])})
                    if c == 1:  # the same requests, right after, while every server is idle
                        for t, baseline in translators.items():
                            baselines[t].append(baseline(requests))
                progress.stage(f"run {run + 1}/{cfg.runs}: offline, engines alone, the gRPC floor")
                for engines, t in offline:  # every server idle
                    offline[engines, t].append(run_worker(f"ort_{cfg.variant}", engines, t, spec_path))
                for engines, t in alone:
                    alone[engines, t].append(run_engines_alone(engines, t, engines_path))
                busiest = busiest_cell(cells, max(cfg.concurrency))
                floors.append(grpc_floor(rate=busiest["requests_per_s"], bound_rate=bound_rate(offline, busiest)))
            if cfg.profile:  # an extra cell at the most clients for each server, not measured: py-spy samples it
                c = max(cfg.concurrency)
                progress.stage(f"profiles: {c} client(s), {len(servers_at)} server(s)")
                requests = work(cfg, pool, 4 * (cfg.requests or max(64, 16 * c)), seed=cfg.seed - 1)  # more samples
                for (m, layout), server in servers.items():
                    name = f"{m} {layout_name(*layout)} {c} clients"
                    sampler = Sampler(server.proc.pid, Path(f"{cfg.profile}-{name.replace(' ', '-')}.txt"))
                    _cell(server.target, requests, c)
                    profiles[name] = sampler.stop()
        finally:
            for server in servers.values():
                server.stop()
    # the servers gone: at the most threads swept
    steps = translators[max(cfg.threads)].step_ms_by_rows(pool, cfg.max_running_rows) if translators else None
    return _report(cfg, cells, baselines, steps, offline_best(offline), engines_best(alone), floors) | \
        {"profile": profiles or None}


def offline_best(offline: dict[tuple[int, int], list[dict]]) -> dict | None:
    """The highest median tokens/s of the offline runs over layouts and batch sizes, with its spread."""
    return _best("tokens_per_s", (([r["tokens"][batch] / r["seconds"][batch] for r in runs],
                                   {"layout": layout_name(*layout), "batch_size": int(batch)})
                                  for layout, runs in offline.items() for batch in runs[0]["seconds"]))


def engines_best(alone: dict[tuple[int, int], list[dict]]) -> dict | None:
    """The highest median steady tokens/s of the engines-alone runs over layouts, with its spread."""
    return _best("steady_tokens_per_s", (([r["steady_tokens_per_s"] for r in runs], {"layout": layout_name(*layout)})
                                         for layout, runs in alone.items()))


def _best(key: str, candidates) -> dict | None:
    """Of (runs' values, what names them) candidates, the one of the highest median: {key: median, key_min_max:
    [min, max], **what names it}; None without any."""
    best = None
    for values, named in candidates:
        found = {key: round(statistics.median(values), 1),
                 f"{key}_min_max": [round(min(values), 1), round(max(values), 1)], **named}
        if best is None or found[key] > best[key]:
            best = found
    return best


def _summary(runs: list[dict]) -> dict:
    """One cell's runs: the median of each figure, the spread of some, the median of each stage's mean."""
    cell = {key: round(statistics.median(r[key] for r in runs), 2)
            for key in ("tokens_per_s", "steady_tokens_per_s", "requests_per_s", "p50_ms", "p90_ms", "p99_ms",
                        "server_p50_ms")}
    for key in ("tokens_per_s", "steady_tokens_per_s", "p50_ms"):  # the spread over runs, beside the median
        cell[f"{key}_min_max"] = [round(min(r[key] for r in runs), 2), round(max(r[key] for r in runs), 2)]
    cell["requests"], cell["sentences"] = runs[0]["requests"], runs[0]["sentences"]
    cell["stages_mean_ms"] = {name: round(statistics.median(r["stages_mean_ms"][name] for r in runs), 3) for name in STAGES}
    cell["host_probe_runs"] = [r["host_probe"] for r in runs]
    cell["sentences_per_admission"] = round(statistics.median(r["sentences_per_admission"] for r in runs), 2)
    cpu = [r["cpu_ms_per_call"] for r in runs if r["cpu_ms_per_call"]]
    cell["cpu_ms_per_call"] = {part: {who: round(statistics.median(c[part][who] for c in cpu), 3) for who in cpu[0][part]}
                               for part in cpu[0]} if cpu else None
    # the cores the server and its client kept busy: their CPU a call at the cell's calls a second
    busy = [sum(r["cpu_ms_per_call"]["run"].values()) * r["requests_per_s"] / 1e3 for r in runs if r["cpu_ms_per_call"]]
    cell["cores_busy"] = round(statistics.median(busy), 2) if busy else None
    return cell


def _ratios(results: dict, key: str) -> dict[str, float]:
    return {c: round(results["continuous"][c][key] / results["static"][c][key], 2) for c in results["continuous"]}


def busiest_cell(cells: dict, clients: int) -> dict:
    """The latest run's cell of the busiest continuous server (any mode's without one) at `clients`: the load at
    which the RPC floor is measured a second time (grpc_floor's `rate`)."""
    servers = [runs for (mode, _), runs in cells.items() if mode == "continuous"] or list(cells.values())
    return max((runs[clients][-1] for runs in servers if runs[clients]), key=lambda cell: cell["requests_per_s"])


def bound_rate(offline: dict[tuple[int, int], list[dict]], cell: dict):
    """None without offline runs; else grpc_floor's `bound_rate`: from the floor's saturated measure, the calls a
    second of rpc_bound's server, on the latest run's offline best and `cell`'s tokens a call."""
    if not offline:
        return None
    best, tokens_per_call = offline_best({layout: runs[-1:] for layout, runs in offline.items()}), \
        cell["tokens_per_s"] / cell["requests_per_s"]
    return lambda floor: rpc_bound(best, floor, tokens_per_call) * best["tokens_per_s"] / tokens_per_call


def rpc_floor(floors: list[dict]) -> dict | None:
    """The runs' grpc_floor measures: the median of each figure (at_rate's and at_bound's too), the p50's spread."""
    if not floors:
        return None

    def medians(measures: list[dict]) -> dict:
        return {key: None if any(m[key] is None for m in measures) else round(statistics.median(m[key] for m in measures), 3)
                for key in measures[0]}

    floor = medians([{k: v for k, v in f.items() if k not in ("at_rate", "at_bound")} for f in floors])
    paced = {key: [f[key] for f in floors if f.get(key)] for key in ("at_rate", "at_bound")}
    return {**floor, "p50_ms_min_max": [round(min(f["p50_ms"] for f in floors), 3), round(max(f["p50_ms"] for f in floors), 3)],
            "clients": FLOOR_CLIENTS, **{key: medians(runs) if runs else None for key, runs in paced.items()}}


def rpc_bound(offline: dict, floor: dict, tokens_per_call: float) -> float:
    """The saturated throughput, against OnnxTranslator's offline best, of a server whose calls cost nothing but
    the RPC floor's CPU (its server's and its client's, on the host's cores) beside engines as fast as offline:
    offline spends E ms of its cores a call (its layout's cores over its calls/s), such a server E + R of the
    host's; never above 1, its engines being as fast as offline at most."""
    engines, threads = map(int, offline["layout"].split("x"))
    cores = min(engines * threads, usable_cores())
    offline_ms = cores * 1e3 * tokens_per_call / offline["tokens_per_s"]
    return min(1.0, usable_cores() / cores * offline_ms / (offline_ms + floor["server_cpu_ms"] + floor["client_cpu_ms"]))


def _report(cfg: ServedBenchConfig, cells: dict, baselines: dict[int, list[dict]],
            step_ms_by_rows: dict | None = None, offline: dict | None = None, alone: dict | None = None,
            floors: list[dict] | None = None) -> dict:
    """`results`: each mode at its best layout for each concurrency (highest steady-state tokens/s; `layout`
    says which, engines x threads); with several layouts, `results_by_layout` has every one. `offline`:
    offline_best's, `alone`: engines_best's, to each of which each mode's highest steady tokens/s over the
    concurrencies compares; `floors`: grpc_floor's, which bound one client's p50 and the saturation from the RPC path alone."""
    by_layout = {layout_name(*layout): {m: {str(c): _summary(cells[m, layout][c]) for c in cfg.concurrency}
                                        for m in cfg.modes} for layout in layouts(cfg)}
    results = {}
    for m in cfg.modes:
        results[m] = {}
        for c in map(str, cfg.concurrency):
            best = max(by_layout, key=lambda name: by_layout[name][m][c]["steady_tokens_per_s"])
            results[m][c] = {"layout": best, **by_layout[best][m][c]}
    ratios = {}
    if {"continuous", "static"} <= set(results):
        for key in ("tokens_per_s", "steady_tokens_per_s"):
            ratios[f"continuous/static {key}"] = _ratios(results, key)
        if len(by_layout) > 1:
            for name, at in by_layout.items():
                ratios[f"continuous/static steady_tokens_per_s, both at {name}"] = _ratios(at, "steady_tokens_per_s")
    medians = [{key: statistics.median(b[key] for b in runs) for key in runs[0]} for runs in baselines.values() if runs]
    baseline = min(medians, key=lambda b: b["p50_ms"]) if medians else None  # at its best thread count
    if baseline:
        for mode in results:
            ratios[f"{mode} p50 at concurrency 1 / OnnxTranslator batch-1 p50"] = round(
                results[mode]["1"]["p50_ms"] / baseline["p50_ms"], 3)
    saturation = {mode: max(cell["steady_tokens_per_s"] for cell in results[mode].values()) for mode in results}
    if offline:
        for mode in results:
            ratios[f"{mode} saturation / OnnxTranslator offline best"] = round(saturation[mode] / offline["tokens_per_s"], 3)
    if offline and cfg.device == "cpu":  # the engines' CPU a call against the offline best's: its cores' time a call
        cores = math.prod(map(int, offline["layout"].split("x")))
        for mode in results:
            for c, cell in results[mode].items():
                if c != "1" and cell.get("cpu_ms_per_call"):
                    offline_ms = cores * 1e3 * cell["tokens_per_s"] / cell["requests_per_s"] / offline["tokens_per_s"]
                    ratios[f"{mode} engines' CPU a call at {c} clients / OnnxTranslator offline best's"] = round(
                        cell["cpu_ms_per_call"]["run"]["engines"] / offline_ms, 3)
    if alone:
        ratios["continuous saturation / the engines alone"] = round(
            saturation["continuous"] / alone["steady_tokens_per_s"], 3) if "continuous" in saturation else None
        if offline:
            ratios["the engines alone / OnnxTranslator offline best"] = round(
                alone["steady_tokens_per_s"] / offline["tokens_per_s"], 3)
    floor = rpc_floor(floors or [])
    if floor and baseline:  # what gRPC alone adds to one client's wait, against the translation's own
        ratios["RPC floor p50 / OnnxTranslator batch-1 p50"] = round(floor["p50_ms"] / baseline["p50_ms"], 3)
    if floor and floor["server_cpu_ms"] is not None and "continuous" in results:  # the servicer's CPU against gRPC's own
        c = max(cfg.concurrency)
        cpu = results["continuous"][str(c)]["cpu_ms_per_call"]
        if cpu:
            servicer = cpu["run"]["event loop"] + cpu["run"]["other server threads"]
            ratios[f"continuous servicer CPU a call at {c} clients / the RPC floor's"] = round(
                servicer / floor["server_cpu_ms"], 3)
            if (floor["at_rate"] or {}).get("server_cpu_ms"):
                ratios[f"continuous servicer CPU a call at {c} clients / the RPC floor's at its calls/s"] = round(
                    servicer / floor["at_rate"]["server_cpu_ms"], 3)
    if floor and offline and floor["server_cpu_ms"] is not None and cfg.device == "cpu":  # engines on the cores
        mode = max(saturation, key=saturation.get)
        cell = max(results[mode].values(), key=lambda c: c["steady_tokens_per_s"])
        ratios["at most, over the RPC floor / OnnxTranslator offline best"] = round(
            rpc_bound(offline, floor, cell["tokens_per_s"] / cell["requests_per_s"]), 3)
        if (floor["at_bound"] or {}).get("server_cpu_ms") is not None:  # the floor as it costs at that bound's rate
            paced = rpc_bound(offline, floor["at_bound"], cell["tokens_per_s"] / cell["requests_per_s"])
            ratios["at most, over the RPC floor paced to that bound / OnnxTranslator offline best"] = round(paced, 3)
            for mode in results:  # how much of what the RPC path leaves each mode makes
                ratios[f"{mode} saturation / at most, over the RPC floor paced"] = round(
                    saturation[mode] / offline["tokens_per_s"] / paced, 3)
    return {"bundle": cfg.bundle, "variant": cfg.variant, "device": cfg.device, "server_flags": cfg.server_flags,
            "decoding": cfg.decoding, "sentences_per_call": cfg.sentences_per_call,
            "threads": list(cfg.threads), "runs": cfg.runs,
            "max_running_rows": cfg.max_running_rows, "concurrency": list(cfg.concurrency),
            "machine": machine_info(cfg.device),
            "results": results, "results_by_layout": by_layout if len(by_layout) > 1 else None,
            "baseline_onnx_translator_batch1": {k: round(v, 2) for k, v in baseline.items()} if baseline else None,
            "step_ms_by_rows": step_ms_by_rows, "offline_best": offline, "engines_alone": alone, "rpc_floor": floor,
            "ratios": ratios}


def _threads(report: dict) -> str:
    swept = report["results_by_layout"]
    return f"layouts {', '.join(swept)} (engines x ORT threads) swept, each mode at its best" if swept \
        else f"{report['threads'][0]} ORT thread(s)"


def format_table(report: dict) -> str:
    lines = [describe(report["machine"]),
             f"{report['variant']} on {report['device']}, {_threads(report)}, {report['decoding']} decoding, "
             f"{report['sentences_per_call']} sentence(s) a call, median of {report['runs']} runs",
             f"{'mode':<11}{'clients':>8}{'layout':>7}{'tok/s [min–max]':>22}{'steady tok/s [min–max]':>25}{'req/s':>8}"
             f"{'p50 ms [min–max]':>24}{'p90 ms':>9}{'p99 ms':>9}{'in-server p50':>15}"]
    for mode, by_c in report["results"].items():
        for c, r in by_c.items():
            (t_lo, t_hi), (s_lo, s_hi), (p_lo, p_hi) = (r[f"{key}_min_max"] for key in (
                "tokens_per_s", "steady_tokens_per_s", "p50_ms"))
            throughput = f"{r['tokens_per_s']:.0f} [{t_lo:.0f}–{t_hi:.0f}]"
            steady = f"{r['steady_tokens_per_s']:.0f} [{s_lo:.0f}–{s_hi:.0f}]"
            p50 = f"{r['p50_ms']:.1f} [{p_lo:.1f}–{p_hi:.1f}]"
            lines.append(f"{mode:<11}{c:>8}{r['layout']:>7}{throughput:>22}{steady:>25}{r['requests_per_s']:>8.1f}{p50:>24}"
                         f"{r['p90_ms']:>9.1f}{r['p99_ms']:>9.1f}{r['server_p50_ms']:>15.1f}")
    for name, by_mode in (report["results_by_layout"] or {}).items():  # every layout: steady tok/s, p50 / p99 ms
        lines.append(f"at {name}, steady tok/s, p50 / p99 ms: " + "; ".join(
            f"{mode} " + ", ".join(f"{c}: {r['steady_tokens_per_s']:.0f}, {r['p50_ms']:.1f} / {r['p99_ms']:.1f}"
                                   for c, r in by_c.items()) for mode, by_c in by_mode.items()))
    lines.append("mean ms per stage: " + ", ".join(STAGES))
    for mode, by_c in report["results"].items():
        for c, r in by_c.items():
            lines.append(f"{mode:<11}{c:>8}  " + "  ".join(f"{r['stages_mean_ms'][name]:.2f}" for name in STAGES))
    if all(r["cpu_ms_per_call"] for by_c in report["results"].values() for r in by_c.values()):
        lines.append("CPU ms a call, run (and runnable, waiting for a core): " + ", ".join(THREAD_KINDS) + ", client; "
                     f"cores busy (of {report['machine']['usable_cores']})")
        for mode, by_c in report["results"].items():
            for c, r in by_c.items():
                run, waiting = r["cpu_ms_per_call"]["run"], r["cpu_ms_per_call"]["waiting"]
                lines.append(f"{mode:<11}{c:>8}  " + "  ".join(f"{run[k]:.3f} ({waiting[k]:.3f})" for k in THREAD_KINDS)
                             + f"  {run['client']:.3f};  {r['cores_busy']:.2f}")
    lines.append("sentences per admission (one encoder call each, nmtserve_admissions_total): " + "; ".join(
        f"{mode} " + ", ".join(f"{c}: {r['sentences_per_admission']:.1f}" for c, r in by_c.items())
        for mode, by_c in report["results"].items() if all("sentences_per_admission" in r for r in by_c.values())))
    probes = [p for by_c in report["results"].values() for r in by_c.values() for p in r["host_probe_runs"]]
    lines.append("host probe as each cell started (one core), min–max: " + "; ".join(
        f"{what} {min(p[k] for p in probes):,.1f}–{max(p[k] for p in probes):,.1f}" for k, what in PROBES.items()))
    b = report["baseline_onnx_translator_batch1"]
    if b:
        lines.append(f"OnnxTranslator batch 1 ({b['threads']} thread(s)): p50 {b['p50_ms']:.1f} ms, p90 {b['p90_ms']:.1f} ms, {b['tokens_per_s']:.0f} tok/s; "
                     f"mean ms per stage: encode {b['encode_ms']:.2f}, steps {b['steps_ms']:.2f} (served at 1 client: "
                     + ", ".join(f"{mode} {r['1']['stages_mean_ms']['encode']:.2f} and "
                                 f"{r['1']['stages_mean_ms']['first step'] + r['1']['stages_mean_ms']['later steps']:.2f}"
                                 for mode, r in report["results"].items() if "1" in r) + ")")
    steps = report["step_ms_by_rows"]
    if steps:
        lines.append("OnnxTranslator decoder step, ms (rows per ms) by rows: " + ", ".join(
            f"{rows}: {ms:.2f} ({int(rows) / ms:.1f})" for rows, ms in steps.items()))
    offline = report["offline_best"]
    if offline:
        low, high = offline["tokens_per_s_min_max"]
        lines.append(f"OnnxTranslator offline, greedy, {OFFLINE_SENTENCES} of the sentences, best of batch "
                     f"{report['max_running_rows'] // 2} and {report['max_running_rows']} at each layout: "
                     f"{offline['tokens_per_s']:,.0f} [{low:,.0f}–{high:,.0f}] tok/s at batch {offline['batch_size']}, "
                     f"{offline['layout']} (against each mode's highest steady tok/s below)")
    alone = report.get("engines_alone")
    if alone:
        low, high = alone["steady_tokens_per_s_min_max"]
        lines.append(f"the servers' engines alone (no gRPC, continuous, {report['concurrency'][-1]} clients' calls), best "
                     f"layout: {alone['steady_tokens_per_s']:,.0f} [{low:,.0f}–{high:,.0f}] steady tok/s, {alone['layout']}")
    floor = report.get("rpc_floor")
    if floor:
        low, high = floor["p50_ms_min_max"]
        cpu = f"; CPU a call: server {floor['server_cpu_ms']:.3f} ms, client {floor['client_cpu_ms']:.3f} ms" \
            if floor["server_cpu_ms"] is not None else ""
        for paced in (floor.get("at_rate"), floor.get("at_bound")):
            if (paced or {}).get("server_cpu_ms") is not None:
                cpu += (f"; paced to {paced['calls_per_s']:,.0f} calls/s, server {paced['server_cpu_ms']:.3f} ms, "
                        f"client {paced['client_cpu_ms']:.3f} ms a call")
        lines.append(f"the RPC floor (a bare grpc.aio server's no-op call, Python's blocking stubs; loadtests/grpc_floor.py): "
                     f"p50 {floor['p50_ms']:.3f} ms [{low:.3f}–{high:.3f}] at one client, {floor['calls_per_s']:,.0f} "
                     f"calls/s at {floor['clients']} clients{cpu}")
    for name, value in report["ratios"].items():
        lines.append(f"{name}: {value}")
    for name, profile in (report.get("profile") or {}).items():
        if "error" in profile:
            lines.append(f"profile, {name}: none ({profile['error']})")
            continue
        lines.append(f"profile, {name} ({profile['samples']:,} samples at {profile['rate']}/s, {profile['file']}): "
                     "threads " + ", ".join(f"{t} {share:.0%}" for t, share in profile["threads"].items()))
        lines += [f"  {share:6.1%}  {function}" for function, share in profile["top_own"]]
    return "\n".join(lines)


def figure(report: dict):
    """Latency percentiles (p50, p90, p99) and throughput against the number of clients, per mode, one panel above
    the other; the legends outside the axes."""
    fig, (latency, throughput) = pyplot().subplots(2, 1, figsize=(10, 8))
    for mode, color in zip(report["results"], ("tab:blue", "tab:orange")):
        cells = report["results"][mode]
        clients = [int(c) for c in cells]
        for key, style in (("p50_ms", "-"), ("p90_ms", "--"), ("p99_ms", ":")):
            latency.plot(clients, [cells[c][key] for c in cells], style, color=color, marker="o",
                         label=f"{mode} {key[:3]}")
        throughput.plot(clients, [cells[c]["steady_tokens_per_s"] for c in cells], color=color, marker="o",
                        label=f"{mode}, steady state")
        throughput.plot(clients, [cells[c]["tokens_per_s"] for c in cells], "--", color=color, marker=".",
                        label=f"{mode}, whole cell")
    for name, key, line, color in (("offline_best", "tokens_per_s", "OnnxTranslator offline best", "gray"),
                                   ("engines_alone", "steady_tokens_per_s", "the engines alone (no gRPC)", "tab:green")):
        if report.get(name):
            throughput.axhline(report[name][key], color=color, linewidth=0.8, linestyle="-.", label=line)
    for key, line in (("at most, over the RPC floor / OnnxTranslator offline best", "at most, over the RPC floor"),
                      ("at most, over the RPC floor paced to that bound / OnnxTranslator offline best",
                       "at most, over the RPC floor at that rate")):
        if report["ratios"].get(key):
            throughput.axhline(report["ratios"][key] * report["offline_best"]["tokens_per_s"], color="tab:red",
                               linewidth=0.8, linestyle=":" if "paced" not in key else "--", label=line)
    baseline = report["baseline_onnx_translator_batch1"]
    if baseline:
        latency.axhline(baseline["p50_ms"], color="gray", linewidth=0.8, label="OnnxTranslator batch-1 p50")
        if report.get("rpc_floor"):
            latency.axhline(baseline["p50_ms"] + report["rpc_floor"]["p50_ms"], color="tab:red", linewidth=0.8,
                            linestyle=":", label="… + the RPC floor's p50")
    for ax, ylabel in ((latency, "latency per call (ms)"), (throughput, "target tokens/s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        legend_outside(ax)
    latency.set_yscale("log")
    throughput.set_ylim(bottom=0)
    flags = "".join(f" {flag}" for flag in report["server_flags"])
    fig.suptitle(f"nmtserve bench served {Path(report['bundle']).name}: serve{flags}, {report['variant']} on "
                 f"{report['device']}, {_threads(report)}, {report['decoding']} decoding, {report['sentences_per_call']} "
                 f"sentence(s) a call, median of {report['runs']} runs\n{host(report['machine'])}", fontsize=9)
    fig.tight_layout()
    return fig


def draw_chart(report: dict, path: Path) -> None:
    save(figure(report), path, dpi=110)


if __name__ == "__main__" and sys.argv[1:2] == ["engines"]:  # run_engines_alone's process: engines, threads, spec path
    print(json.dumps(engines_alone(json.loads(Path(sys.argv[4]).read_text(encoding="utf-8")), int(sys.argv[2]),
                                   int(sys.argv[3]))))
