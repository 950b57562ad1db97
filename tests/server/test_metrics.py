"""The /metrics page, scraped over HTTP, agrees with the traffic sent; static batching serves the same output."""

import subprocess
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from nmtserve.server.config import ServerConfig
from nmtserve.training.data import read_tsv
from nmtserve.v1 import translation_pb2 as pb
from nmtserve.v1 import translation_pb2_grpc as pb_grpc
from tests.helpers import ServerThread, system_tool


def _page(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()


def _scrape(port: int) -> dict:
    text = _page(port)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_scrape_agrees_with_traffic_and_static_batching_gives_the_same_text(tiny_bundle, tiny_corpus):
    sentences = [s for s, _ in read_tsv(tiny_corpus / "test.tsv").pairs][:6]
    outputs = {}
    for batching in ("continuous", "static"):
        server = ServerThread(ServerConfig.from_flags(bundle=str(tiny_bundle), host="127.0.0.1", port=0, metrics_port=0,
                                           batching=batching, max_decoding_length=64))
        try:
            before = _scrape(server.running.metrics_port)  # after the server's own warm-up sentence
            with server.channel() as channel:
                stub = pb_grpc.TranslationServiceStub(channel)
                responses = [stub.Translate(pb.TranslateRequest(sentences=sentences[i:i + 2]), timeout=30)
                             for i in range(0, 6, 2)]
                try:
                    stub.Translate(pb.TranslateRequest(sentences=[""]), timeout=5)
                except Exception:
                    pass
            outputs[batching] = [t.text for r in responses for t in r.translations]
            after = _scrape(server.running.metrics_port)

            [model] = server.running.models  # every series carries the model it counts

            def delta(name, **labels):  # request series also carry the decoding mode; step series do not
                labels = {"model": model, "mode": "greedy", **labels}
                key = (name, tuple(sorted((k, v) for k, v in labels.items() if v is not None)))
                return after.get(key, 0) - before.get(key, 0)

            translations = [t for r in responses for t in r.translations]
            assert delta("nmtserve_output_tokens_total") == sum(t.output_tokens for t in translations)
            assert delta("nmtserve_input_tokens_total") == sum(t.input_tokens for t in translations)
            assert delta("nmtserve_sentences_total", finish_reason="eos") == sum(
                t.finish_reason == pb.FINISH_REASON_EOS for t in translations)
            assert delta("nmtserve_sentences_total", finish_reason="length") == sum(
                t.finish_reason == pb.FINISH_REASON_LENGTH for t in translations)
            assert delta("nmtserve_requests_total", code="OK", rpc="Translate", client="") == 3
            assert delta("nmtserve_requests_total", code="INVALID_ARGUMENT", rpc="Translate", client="") == 1
            assert delta("nmtserve_rejected_requests_total", code="INVALID_ARGUMENT", client="") == 1
            assert delta("nmtserve_time_to_first_token_seconds_count") == 6
            assert delta("nmtserve_request_duration_seconds_count", rpc="Translate") == 6
            assert delta("nmtserve_step_duration_seconds_count", mode=None) > 0
            assert 3 <= delta("nmtserve_admissions_total", mode=None) <= 6  # three calls of two sentences
            idle = (("model", model),)
            assert after[("nmtserve_requests_running", idle)] == 0 and after[("nmtserve_requests_waiting", idle)] == 0
        finally:
            server.stop()
    assert outputs["continuous"] == outputs["static"]


def test_metrics_page_passes_promtool_lint(served):
    """Prometheus' own linter (Debian's prometheus package, installed by `make test`) on a page with traffic."""
    with served.channel() as channel:
        pb_grpc.TranslationServiceStub(channel).Translate(pb.TranslateRequest(sentences=["The cat sleeps."]), timeout=30)
    page = _page(served.running.metrics_port)
    assert "nmtserve_requests_total" in page
    process = {line.split()[0]: float(line.split()[1]) for line in page.splitlines() if line.startswith("process_")}
    assert process["process_resident_memory_bytes"] > 0 and process["process_open_fds"] > 0
    assert process["process_cpu_seconds_total"] > 0
    promtool = system_tool("promtool")
    check = subprocess.run([promtool, "check", "metrics"], input=page, capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr


def test_the_memory_limit_is_the_cgroups_and_absent_without_one(tmp_path):
    from nmtserve.server.metrics import memory_limit_bytes

    v2, v1 = tmp_path / "memory.max", tmp_path / "memory.limit_in_bytes"
    v2.write_text("4294967296\n")
    assert memory_limit_bytes((str(v2), str(v1))) == 4294967296
    v2.write_text("max\n")
    assert memory_limit_bytes((str(v2), str(v1))) is None
    v1.write_text("9223372036854771712\n")  # cgroup v1's "no limit"
    assert memory_limit_bytes((str(tmp_path / "absent"), str(v1))) is None
    assert memory_limit_bytes((str(tmp_path / "absent"),)) is None
