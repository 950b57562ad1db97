"""`nmtserve soak`: sustained mixed traffic against one server, then a verdict.

    nmtserve soak bundles/default --seconds 600 --clients 24 --out runs/soak

Client threads send, for `seconds`, a mixture of unary calls of 1-4 sentences, streams read to the
end, streams read slowly, streams cancelled after their first delta, calls with a 1 ms deadline,
well-formed but odd requests (control characters, emoji, right-to-left and zero-width text, a
sentence at the length limit, the largest option values, the most sentences per call) and invalid
ones. A sampler scrapes the server's /metrics: resident memory and the running/waiting gauges.

Exit 1 when a call ends with a status code its kind does not expect (INTERNAL and UNKNOWN never are;
UNAVAILABLE is not while the server is up), the started server's log holds a traceback, the gauges
do not return to 0 after the run, health is
no longer SERVING, a fixed sentence translates differently at the end, or resident memory grows by
more than `max_memory_growth` after the warm-up (the first minute, or the first third of a short run;
see memory_verdict).
"""

from __future__ import annotations

import collections
import json
import random
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nmtserve.client import open_channel, wait_serving
from nmtserve.console import Progress
from nmtserve.errors import ConfigError
from nmtserve.loadtests.charts import gap, host, legend_outside, pyplot, save
from nmtserve.loadtests.machine import machine_info
from nmtserve.loadtests.workload import ServerProcess, default_sentence_file, free_port, read_sentences, scrape
from nmtserve.v1 import translation_pb2 as pb
from nmtserve.v1 import translation_pb2_grpc as pb_grpc

CALL_TIMEOUT = 120.0  # seconds; no call of the mixture may take longer, even behind a full batch
SLOW_READ = 0.05  # seconds a slow stream waits before reading each message
FIXED_SENTENCE_INDEX = 0  # of the sentence file: translated at the start and at the end
# kind -> (weight in the mixture, status codes that are a correct answer). RESOURCE_EXHAUSTED is a
# correct answer to any call (the server refuses what its queue cannot hold) and is counted apart.
KINDS = {
    "unary": (30, {"OK"}),
    "stream": (15, {"OK"}),
    "slow stream": (10, {"OK"}),
    "cancelled stream": (10, {"CANCELLED", "OK"}),  # OK when the whole answer came in its first message
    "1 ms deadline": (10, {"DEADLINE_EXCEEDED", "OK"}),
    "odd": (20, {"OK"}),
    "invalid": (5, {"INVALID_ARGUMENT"}),
}
ALWAYS_CORRECT = {"RESOURCE_EXHAUSTED"}
ODD_TEXTS = {
    "control characters": "The cat\x00 sat\x07 on\x1b[0m the\tmat.\r\n",
    "emoji": "\U0001f408 The cat \U0001f600 eats the apples \U0001f34e\U0001f44d\U0001f3fd",
    "right-to-left": "\u0645\u0631\u062d\u0628\u0627 \u2014 The cat \u05e9\u05dc\u05d5\u05dd sleeps.",
    "zero-width": "The\u200b cat\u200c sleeps\u200d in the\ufeff garden.",
    "combining marks": "Z\u0351a\u0353l\u0354g\u0355o " * 8,
}


@dataclass
class SoakConfig:
    bundle: str = "bundles/default"
    server: str = ""  # HOST:PORT of a running server instead of starting one
    metrics_url: str = ""  # its /metrics; without it memory and gauges of a given server are not measured
    seconds: float = 600.0
    clients: int = 24
    out: str = "runs/soak"
    sentences: str = ""
    seed: int = 0
    sample_seconds: float = 2.0
    warmup_seconds: float = 60.0
    max_memory_growth: float = 0.10
    server_flags: list[str] = field(default_factory=list)


@dataclass
class Plan:
    """What the clients send: sentences, the odd and the invalid requests by name."""

    sentences: list[str]
    odd: dict[str, pb.TranslateRequest]
    invalid: dict[str, pb.TranslateRequest]


def _code(call) -> str:
    """Run a call; its status code name ('OK' when it returns)."""
    try:
        call()
        return "OK"
    except grpc.RpcError as e:
        return e.code().name


def _read_stream(stub, request, slow: bool = False, cancel_after_first: bool = False) -> None:
    stream = stub.TranslateStream(request, timeout=CALL_TIMEOUT)
    for _ in stream:
        if cancel_after_first:
            stream.cancel()
        if slow:
            time.sleep(SLOW_READ)


def _longest_accepted(stub, words: list[str], limits: pb.Limits) -> str:
    """The longest run of `words` the server takes as one sentence: at its token or character limit."""
    def accepted(n: int) -> bool:
        text = " ".join(words[:n])
        if len(text) > limits.max_sentence_chars:
            return False
        request = pb.TranslateRequest(sentences=[text], options=pb.DecodingOptions(max_decoding_length=1))
        return _code(lambda: stub.Translate(request, timeout=CALL_TIMEOUT)) == "OK"

    lo, hi = 1, len(words)  # accepted(lo) holds; find the largest such n by bisection
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if accepted(mid) else (lo, mid - 1)
    return " ".join(words[:lo])


def make_plan(stub, sentences: list[str]) -> Plan:
    limits = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=CALL_TIMEOUT).limits
    words = " ".join(sentences[:200]).split()
    while len(" ".join(words)) <= limits.max_sentence_chars:
        words += words
    one = sentences[FIXED_SENTENCE_INDEX]
    odd = {name: pb.TranslateRequest(sentences=[text]) for name, text in ODD_TEXTS.items()}
    odd["at the length limit"] = pb.TranslateRequest(sentences=[_longest_accepted(stub, words, limits)])
    odd["largest options"] = pb.TranslateRequest(
        sentences=[one], options=pb.DecodingOptions(max_decoding_length=limits.max_decoding_length, return_scores=True))
    odd["most sentences per call"] = pb.TranslateRequest(
        sentences=[sentences[i % len(sentences)] for i in range(limits.max_sentences)])
    too_long = ("word " * limits.max_sentence_chars)[: limits.max_sentence_chars + 1]
    invalid = {"empty sentence": pb.TranslateRequest(sentences=[""]),
               "whitespace only": pb.TranslateRequest(sentences=[" \t\n"]),
               "no sentence": pb.TranslateRequest(),
               "too many sentences": pb.TranslateRequest(sentences=[one] * (limits.max_sentences + 1)),
               "over the character limit": pb.TranslateRequest(sentences=[too_long]),
               "max_decoding_length over the limit": pb.TranslateRequest(
                   sentences=[one], options=pb.DecodingOptions(max_decoding_length=limits.max_decoding_length + 1))}
    return Plan(sentences, odd, invalid)


def _one_call(stub, plan: Plan, rng: random.Random) -> tuple[str, str]:
    """Send one call of a kind drawn from the mixture -> (kind, status code)."""
    kind = rng.choices(list(KINDS), weights=[w for w, _ in KINDS.values()])[0]
    sentence = pb.TranslateStreamRequest(sentence=rng.choice(plan.sentences))
    if kind == "unary":
        request = pb.TranslateRequest(sentences=rng.sample(plan.sentences, rng.randint(1, 4)))
        return kind, _code(lambda: stub.Translate(request, timeout=CALL_TIMEOUT))
    if kind == "stream":
        return kind, _code(lambda: _read_stream(stub, sentence))
    if kind == "slow stream":
        return kind, _code(lambda: _read_stream(stub, sentence, slow=True))
    if kind == "cancelled stream":
        return kind, _code(lambda: _read_stream(stub, sentence, cancel_after_first=True))
    if kind == "1 ms deadline":
        request = pb.TranslateRequest(sentences=[sentence.sentence])
        return kind, _code(lambda: stub.Translate(request, timeout=0.001))
    case = rng.choice(sorted(getattr(plan, kind)))
    request = getattr(plan, kind)[case]
    return f"{kind}: {case}", _code(lambda: stub.Translate(request, timeout=CALL_TIMEOUT))


def expected_codes(kind: str) -> set[str]:
    return KINDS[kind.split(":")[0]][1] | ALWAYS_CORRECT


# what the sampler reads from each /metrics page: resident memory, running and waiting rows (over the models)
SAMPLED = {"process_resident_memory_bytes": "rss_bytes", "nmtserve_requests_running": "running",
           "nmtserve_requests_waiting": "waiting"}


class Sampler(threading.Thread):
    """Scrapes /metrics every `every` seconds until stopped: [(seconds since start, values), ...]."""

    def __init__(self, url: str, every: float):
        super().__init__(name="soak-sampler", daemon=True)
        self.url, self.every, self.samples, self.errors = url, every, [], 0
        self.stopped, self.start_time = threading.Event(), time.monotonic()

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                self.samples.append((round(time.monotonic() - self.start_time, 2), scrape(self.url, SAMPLED)))
            except OSError:
                self.errors += 1
            self.stopped.wait(self.every)


def memory_verdict(samples: list[tuple[float, dict]], warmup: float, bound: float) -> dict:
    """Growth of resident memory after the warm-up: the median of the last third of the remaining
    samples over the median of the first third. Memory rises and falls by a hundred MB or more with
    the batch's shapes, so single peaks say little; a leak, or an allocator that keeps what the
    largest shapes needed, lifts the whole level (ONNX Runtime's CPU arena did: docs/performance-journal.md,
    "Memory under sustained traffic")."""
    rss = [(t, v["rss_bytes"] / 2**20) for t, v in samples if "rss_bytes" in v]
    after = [mb for t, mb in rss if t >= warmup]
    third = len(after) // 3
    if third < 2:
        return {"measured": False, "why": "fewer than six memory samples after the warm-up"}
    first, last = statistics.median(after[:third]), statistics.median(after[-third:])
    growth = last / first - 1
    return {"measured": True, "warmup_seconds": warmup, "start_mb": round(rss[0][1], 1),
            "first_third_median_mb": round(first, 1), "last_third_median_mb": round(last, 1),
            "max_mb": round(max(mb for _, mb in rss), 1), "end_mb": round(rss[-1][1], 1),
            "growth": round(growth, 4), "bound": bound, "passed": growth < bound}


def _gauges_back_to_zero(url: str, seconds: float = 30.0) -> dict:
    deadline = time.monotonic() + seconds
    while True:
        try:
            values = scrape(url, SAMPLED)
        except OSError as e:
            return {"passed": False, "error": f"cannot scrape {url}: {e}"}
        if values.get("running") == 0 and values.get("waiting") == 0:
            return {"passed": True, **values}
        if time.monotonic() > deadline:
            return {"passed": False, **values}
        time.sleep(0.5)


def judge(report: dict) -> list[str]:
    """Every reason the run fails, one line each; empty when it passes."""
    failures = [f"{n} × {code} in '{kind}'" for kind, codes in report["calls"].items()
                for code, n in codes.items() if code not in expected_codes(kind)]
    if report["health"] != "SERVING":
        failures.append(f"health is {report['health']} after the run")
    if not report["fixed_sentence_same"]:
        failures.append("the fixed sentence translates differently after the run")
    gauges = report.get("gauges_after")
    if gauges is not None and not gauges["passed"]:
        failures.append(f"gauges not back at 0 after the run: running {gauges.get('running')}, "
                        f"waiting {gauges.get('waiting')}")
    if report.get("server_log_tracebacks"):
        failures.append(f"the server's log holds {report['server_log_tracebacks']} traceback(s)")
    memory = report["memory"]
    if memory.get("measured") and not memory["passed"]:
        failures.append(f"resident memory grew {memory['growth']:.1%} after the warm-up (medians "
                        f"{memory['first_third_median_mb']} -> {memory['last_third_median_mb']} MB), "
                        f"the bound is {memory['bound']:.0%}")
    return failures


def soak(cfg: SoakConfig, server: str, metrics_url: str, sentences: list[str]) -> dict:
    channel = open_channel(server)
    wait_serving(channel, server, 120)
    stub = pb_grpc.TranslationServiceStub(channel)
    plan = make_plan(stub, sentences)
    fixed = pb.TranslateRequest(sentences=[sentences[FIXED_SENTENCE_INDEX]])
    before = stub.Translate(fixed, timeout=CALL_TIMEOUT).translations[0].text
    calls: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    lock = threading.Lock()
    stop_at = time.monotonic() + cfg.seconds

    def client(seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < stop_at:
            kind, code = _one_call(stub, plan, rng)
            with lock:
                calls[kind][code] += 1

    sampler = Sampler(metrics_url, cfg.sample_seconds) if metrics_url else None
    if sampler:
        sampler.start()
    threads = [threading.Thread(target=client, args=(cfg.seed * 1000 + i,), daemon=True) for i in range(cfg.clients)]
    for t in threads:
        t.start()
    give_up = stop_at + CALL_TIMEOUT + 10
    with Progress(f"soak {server}", total=round(cfg.seconds), unit="second") as progress:
        while any(t.is_alive() for t in threads) and time.monotonic() < give_up:
            time.sleep(1.0)
            progress.reach(min(round(cfg.seconds), round(cfg.seconds - (stop_at - time.monotonic()))))
    for t in threads:
        t.join(max(0.0, give_up - time.monotonic()))
    report: dict = {"server": server, "seconds": cfg.seconds, "clients": cfg.clients,
                    "calls": {k: dict(sorted(v.items())) for k, v in sorted(calls.items())}}
    report["gauges_after"] = _gauges_back_to_zero(metrics_url) if metrics_url else None
    if sampler:
        sampler.stopped.set()
        sampler.join()
    try:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
        report["health"] = health_pb2.HealthCheckResponse.ServingStatus.Name(health)
        report["fixed_sentence_same"] = stub.Translate(fixed, timeout=CALL_TIMEOUT).translations[0].text == before
    except grpc.RpcError as e:  # the server is gone or broken: a finding, not a crash of the tool
        report["health"], report["fixed_sentence_same"] = f"unreachable ({e.code().name})", False
    channel.close()
    samples = sampler.samples if sampler else []
    report["failed_scrapes"] = sampler.errors if sampler else 0
    report["samples"] = [[t, round(v.get("rss_bytes", 0) / 2**20, 1), v.get("running"), v.get("waiting")]
                         for t, v in samples]
    warmup = min(cfg.warmup_seconds, cfg.seconds / 3)
    report["memory"] = memory_verdict(samples, warmup, cfg.max_memory_growth) if sampler else \
        {"measured": False, "why": "no --metrics-url for the given server"}
    return report


def run_soak(cfg: SoakConfig) -> dict:
    """Start a server (unless cfg.server), soak it, write report.json and memory.png to cfg.out."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.server:
        if not cfg.sentences:
            raise ConfigError("--sentences-file: needed with --server (a bundle's test split is the default otherwise)")
        report = soak(cfg, cfg.server, cfg.metrics_url, read_sentences(cfg.sentences))
    else:
        sentences = read_sentences(cfg.sentences or default_sentence_file(cfg.bundle))
        metrics_port = free_port()
        with ServerProcess(cfg.bundle, "--metrics-port", str(metrics_port), *cfg.server_flags,
                           log=out / "server.log") as server:
            report = soak(cfg, server.target, f"http://127.0.0.1:{metrics_port}/metrics", sentences)
        report["server_flags"] = cfg.server_flags
        report["server_log_tracebacks"] = (out / "server.log").read_text(encoding="utf-8").count("Traceback")
    report["machine"] = machine_info()
    report["failures"] = judge(report)
    report["passed"] = not report["failures"]
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    if report["samples"]:
        plot(report, out / "memory.png")
    return report


def figure(report: dict):
    """Resident memory over the run (with the warm-up's end, the first third's median and the bound for the last
    third's), and the running and waiting requests below it; legends outside the axes."""
    seconds, rss, running, waiting = zip(*report["samples"])
    plt = pyplot()
    fig, (ax, rows) = plt.subplots(2, 1, figsize=(10, 6), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    ax.plot(seconds, rss, marker=".", label="resident memory (MB)")
    memory = report["memory"]
    if memory.get("measured"):
        ax.axvline(memory["warmup_seconds"], color="grey", linestyle=":", label="end of warm-up")
        ax.axhline(memory["first_third_median_mb"], color="grey", linestyle="--", label="median, first third")
        ax.axhline(memory["first_third_median_mb"] * (1 + memory["bound"]), color="tab:red", linestyle="--",
                   label=f"bound for the last third's median (+{memory['bound']:.0%})")
    ax.set_ylabel("MB")
    ax.set_ylim(bottom=0)
    legend_outside(ax)
    rows.plot(seconds, [gap(r) for r in running], color="tab:green", label="running requests")
    rows.plot(seconds, [gap(w) for w in waiting], color="tab:orange", linestyle="--", label="waiting requests")
    rows.set_ylabel("requests")
    rows.set_xlabel("seconds")
    rows.set_ylim(bottom=0)
    legend_outside(rows)
    flags = "".join(f" {flag}" for flag in report.get("server_flags", []))
    fig.suptitle(f"nmtserve soak: {report['clients']} clients, {report['seconds']:.0f} s, against {report['server']}"
                 f"{flags}\n{host(report.get('machine'))}", fontsize=9)
    fig.tight_layout()
    return fig


def plot(report: dict, png: Path) -> Path:
    return save(figure(report), png)


def format_report(report: dict) -> str:
    lines = [f"soak of {report['server']}: {report['seconds']:.0f} s, {report['clients']} clients", "",
             f"{'kind':<42} calls  status codes"]
    for kind, codes in report["calls"].items():
        shown = ", ".join(f"{c} {n}" + ("" if c in expected_codes(kind) else " (UNEXPECTED)") for c, n in codes.items())
        lines.append(f"{kind:<42} {sum(codes.values()):>5}  {shown}")
    memory = report["memory"]
    lines.append("")
    if memory.get("measured"):
        lines.append(f"resident memory: {memory['start_mb']} MB at start; after the {memory['warmup_seconds']:.0f} s "
                     f"warm-up, median {memory['first_third_median_mb']} MB in the first third and "
                     f"{memory['last_third_median_mb']} MB in the last: growth {memory['growth']:.1%} "
                     f"(bound {memory['bound']:.0%}); max {memory['max_mb']} MB, end {memory['end_mb']} MB")
        step = max(1, len(report["samples"]) // 10)
        lines.append("  over time (s: MB): " + ", ".join(f"{t:.0f}: {mb}" for t, mb, _, _ in report["samples"][::step]))
    else:
        lines.append(f"resident memory: not measured ({memory['why']})")
    gauges = report["gauges_after"]
    lines.append("gauges after the run: " + ("not measured" if gauges is None else
                 f"running {gauges.get('running')}, waiting {gauges.get('waiting')}"))
    lines.append(f"health after the run: {report['health']}; fixed sentence "
                 + ("translates the same" if report["fixed_sentence_same"] else "CHANGED"))
    lines.append("")
    lines.extend(["PASSED"] if report["passed"] else ["FAILED:", *(f"  {f}" for f in report["failures"])])
    return "\n".join(lines)
