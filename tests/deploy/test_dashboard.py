"""The Grafana dashboard queries only what the server (and the limiter overlay's HAProxy) exports, and every query
runs on a real Prometheus that scrapes a real server, and HAProxy in front of it, after real traffic."""

import contextlib
import json
import re
import subprocess
import time
import urllib.parse
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from nmtserve.loadtests.limiter import Limiter
from nmtserve.loadtests.workload import free_port
from nmtserve.server.auth import client_entry
from nmtserve.server.config import ServerConfig
from nmtserve.training.data import read_tsv
from nmtserve.v1 import translation_pb2 as pb
from nmtserve.v1 import translation_pb2_grpc as pb_grpc
from tests.helpers import ROOT, TARGET_LABELS, ServerThread, exported_series, metric_names, system_tool

DASHBOARD = ROOT / "deploy" / "grafana" / "nmtserve-dashboard.json"
# Grafana's variables, as a local Prometheus without Kubernetes labels must read them
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$namespace": ".*", "$pod": ".*", "$model": ".*", "$client": ".*"}
# series of an API key's client that no model labels: filtered by the client variable instead
CLIENT_SERIES = ("nmtserve_quota_rejections_total", "nmtserve_client_characters_total")
# series of a pod as a whole (its process, its build): filtered by the pod variable
POD_SERIES = ("process_resident_memory_bytes", "process_cpu_seconds_total", "process_start_time_seconds",
              "nmtserve_build_info")
# HAProxy's, in the limiter overlay's pods (deploy/kubernetes/overlays/limiter): filtered by the pod variable too
LIMITER_SERIES = ("haproxy_frontend_intercepted_requests_total",)
LIMITER_CONFIG = ROOT / "deploy" / "kubernetes" / "overlays" / "limiter" / "haproxy.cfg"
DASH, TIGHT = "key-of-the-dashboards-client", "key-of-a-client-of-ten-characters-a-minute"


def dashboard_queries() -> dict[str, str]:
    """'panel title / refId' -> PromQL, over every panel (rows included) and template variable."""
    board = json.loads(DASHBOARD.read_text())
    panels = [p for top in board["panels"] for p in [top, *top.get("panels", [])]]
    queries = {f"{p['title']} / {t['refId']}": t["expr"] for p in panels for t in p.get("targets", [])}
    for var in board["templating"]["list"]:
        if var["type"] == "query":
            queries[f"variable {var['name']}"] = var["query"]["query"]
    return queries


def as_promql(expr: str) -> str:
    """Substitute Grafana's variables; label_values(M, L) (a Grafana function) becomes M."""
    for var, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(var, value)
    assert "$" not in expr, f"an unknown Grafana variable in {expr}"
    match = re.fullmatch(r"label_values\((.+), (\w+)\)", expr)
    return match.group(1) if match else expr


def test_the_dashboard_covers_the_server_and_names_only_exported_metrics():
    queries = dashboard_queries()
    exported = exported_series() | set(LIMITER_SERIES)
    used = set().union(*map(metric_names, queries.values()))
    assert used <= exported, f"not exported by server/metrics.py: {sorted(used - exported)}"
    # throughput, latency percentiles, TTFT, queue, batch rows, rejections, cancellations, per-client traffic
    for needed in ("nmtserve_sentences_total", "nmtserve_output_tokens_total", "nmtserve_request_duration_seconds_bucket",
                   "nmtserve_time_to_first_token_seconds_bucket", "nmtserve_request_queue_seconds_bucket",
                   "nmtserve_requests_waiting", "nmtserve_step_rows_bucket", "nmtserve_rejected_requests_total",
                   "nmtserve_cancelled_sentences_total", *CLIENT_SERIES, *POD_SERIES, *LIMITER_SERIES):
        assert needed in used, f"no panel queries {needed}"
    panel_queries = {name: expr for name, expr in queries.items() if not name.startswith("variable ")}
    def filtered(name: str, selector: str) -> bool:
        needed = 'client=~"$client"' if name in CLIENT_SERIES else 'pod=~"$pod"' \
            if name in POD_SERIES + LIMITER_SERIES else 'model=~"$model"'
        return needed in selector

    unfiltered = [name for name, expr in panel_queries.items()
                  for series, selector in re.findall(r"(\w+)\{([^}]*)\}", expr) if not filtered(series, selector)]
    assert not unfiltered, f"every series a panel reads must be filtered by the model (client, pod) variable: {unfiltered}"
    board = json.loads(DASHBOARD.read_text())
    datasources = {json.dumps(p.get("datasource")) for p in board["panels"] if p["type"] != "row"}
    assert datasources == {json.dumps({"type": "prometheus", "uid": "${datasource}"})}, "panels must use the datasource variable"


class Prometheus:
    """A real Prometheus server scraping its targets every second, with its HTTP query API."""

    def __init__(self, workdir, *targets: str):
        binary = system_tool("prometheus")
        config = workdir / "prometheus.yml"
        config.write_text("global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
                          "scrape_configs:\n"
                          f"  - job_name: nmtserve\n    static_configs: [{{targets: {json.dumps(targets)}}}]\n")
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = open(workdir / "prometheus.log", "w")
        self.process = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
                                         f"--web.listen-address={self.url.removeprefix('http://')}"],
                                        stdout=self.log, stderr=subprocess.STDOUT)

    def query(self, expr: str) -> list:
        """The instant vector of `expr`; a PromQL error raises with Prometheus' message."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        try:
            body = json.loads(urllib.request.urlopen(url, timeout=10).read())
        except urllib.error.HTTPError as e:
            raise AssertionError(f"{expr}: {e.read().decode()}") from None
        assert body["status"] == "success", body
        return body["data"]["result"]

    def wait_for(self, expr: str, seconds: float = 30) -> list:
        """Poll until `expr` returns a non-empty vector."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                if result := self.query(expr):
                    return result
            except (OSError, AssertionError):
                pass  # not listening yet
            time.sleep(0.25)
        raise AssertionError(f"Prometheus never returned {expr}")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(30)
        self.log.close()


def test_every_dashboard_query_returns_data_from_a_real_prometheus(tiny_bundle, tiny_corpus, tmp_path):
    sentences = [s for s, _ in read_tsv(tiny_corpus / "test.tsv").pairs][:8]
    keys = tmp_path / "keys.toml"
    keys.write_text(client_entry("dashboard", DASH) + client_entry("tight", TIGHT, chars_per_minute=10))
    with contextlib.ExitStack() as stack:  # each started thing stopped, whatever fails after it
        server = ServerThread(ServerConfig.from_flags(bundle=str(tiny_bundle), host="127.0.0.1", port=0, metrics_port=0,
                                                      http_port=0, max_decoding_length=64, api_keys=str(keys)))
        stack.callback(server.stop)
        system_tool("haproxy")
        limiter = stack.enter_context(Limiter(LIMITER_CONFIG, f"127.0.0.1:{server.running.port}",
                                              f"127.0.0.1:{server.running.http_port}", 1, log=tmp_path / "haproxy.log"))
        key = [("authorization", f"Bearer {DASH}")]
        refused_in_front = []

        def traffic(round_: int) -> None:
            with server.channel() as channel:
                stub = pb_grpc.TranslationServiceStub(channel)
                responses = [stub.Translate(pb.TranslateRequest(sentences=sentences[i:i + 2]), metadata=key, timeout=30)
                             for i in (0, 2, 4)]
                assert all(t.text for r in responses for t in r.translations)
                list(stub.TranslateStream(pb.TranslateStreamRequest(sentence=sentences[6]), metadata=key, timeout=30))
                with pytest.raises(grpc.RpcError):  # over the tight client's quota: a call of more than 10 characters
                    stub.Translate(pb.TranslateRequest(sentences=[sentences[7]]), timeout=5,
                                   metadata=[("authorization", f"Bearer {TIGHT}")])
                with pytest.raises(grpc.RpcError):
                    stub.Translate(pb.TranslateRequest(sentences=[""]), metadata=key, timeout=5)  # a rejection, the last call
            with grpc.insecure_channel(limiter.target) as channel:  # one call a second: three at once, refused in front
                stub, codes = pb_grpc.TranslationServiceStub(channel), []
                for _ in range(3):
                    try:
                        stub.Translate(pb.TranslateRequest(sentences=sentences[:1]), metadata=key, timeout=30)
                        codes.append(grpc.StatusCode.OK)
                    except grpc.RpcError as e:
                        codes.append(e.code())
                assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes
                refused_in_front.extend(c for c in codes if c != grpc.StatusCode.OK)
                assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}
            # a scrape after all of it
            prometheus.wait_for(f'nmtserve_rejected_requests_total{{code="INVALID_ARGUMENT"}} >= {round_}')
            prometheus.wait_for(f'haproxy_frontend_intercepted_requests_total{{proxy="grpc"}} >= {len(refused_in_front)}')

        prometheus = Prometheus(tmp_path, f"127.0.0.1:{server.running.metrics_port}",
                                limiter.metrics_url.removeprefix("http://").removesuffix("/metrics"))
        stack.callback(prometheus.stop)
        # every series exists before the second round, so rate() over both scrapes is positive
        traffic(1)
        traffic(2)

        labels: dict[str, set[str]] = {}
        for page in (f"http://127.0.0.1:{server.running.metrics_port}/metrics", limiter.metrics_url):
            for family in text_string_to_metric_families(urllib.request.urlopen(page, timeout=10).read().decode()):
                for sample in family.samples:
                    labels.setdefault(sample.name, set()).update(sample.labels)

        checked = 0
        for name, expr in dashboard_queries().items():
            result = prometheus.query(as_promql(expr))  # valid PromQL, or the query raises
            present = metric_names(expr) <= set(labels)
            if not present:  # e.g. no cancellation happened: the series does not exist yet, nothing to return
                continue
            known = set().union(*(labels[m] for m in metric_names(expr))) | TARGET_LABELS
            used = set(re.findall(r"(\w+)\s*(?:=~|!=|=)\s*\"", expr)) | {
                label for group in re.findall(r"by \(([^)]*)\)", expr) for label in re.split(r",\s*", group)}
            assert used <= known, f"{name}: labels {sorted(used - known)} are on none of {sorted(metric_names(expr))}"
            assert result, f"{name}: {expr} returned nothing after traffic"
            assert all(sample["value"][1] not in ("NaN", "+Inf", "-Inf") for sample in result), f"{name}: {result}"
            checked += 1
        assert checked >= len(dashboard_queries()) - 1  # only the cancellations panel may lack data
