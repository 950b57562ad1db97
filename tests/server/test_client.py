"""The client side: round_robin spreads calls over every address of a target, and `nmtserve translate`
takes dns:/// targets (what a headless Kubernetes Service gives)."""

import asyncio
import json

import grpc
import pytest

from nmtserve.client import open_channel
from nmtserve.server.config import ServerConfig
from nmtserve.v1 import translation_pb2 as pb
from nmtserve.v1 import translation_pb2_grpc as pb_grpc
from tests.helpers import ServerThread, run_cli, run_cli_each


def test_round_robin_sends_calls_to_every_server_behind_one_target(tiny_bundle):
    servers = [ServerThread(ServerConfig.from_flags(bundle=str(tiny_bundle), host="127.0.0.1", port=0, metrics_port=-1,
                                         max_decoding_length=8)) for _ in range(2)]
    try:
        before = [s.running.engine.stats()["steps"] for s in servers]
        # two addresses behind one name, as DNS returns the pods of a headless Service
        target = "ipv4:" + ",".join(f"127.0.0.1:{s.running.port}" for s in servers)
        with open_channel(target) as channel:
            grpc.channel_ready_future(channel).result(timeout=30)
            stub = pb_grpc.TranslationServiceStub(channel)
            for _ in range(40):
                stub.Translate(pb.TranslateRequest(sentences=["the cat sleeps ."]), timeout=30, wait_for_ready=True)
                if all(s.running.engine.stats()["steps"] > b for s, b in zip(servers, before)):
                    break
        worked = [s.running.engine.stats()["steps"] > b for s, b in zip(servers, before)]
        assert worked == [True, True], "every call went to one server: the channel does not balance per call"
    finally:
        for s in servers:
            s.stop()


def test_translate_cli_accepts_a_dns_target(served):
    sentence = "the cat sleeps ."
    with served.channel() as channel:
        expected = pb_grpc.TranslationServiceStub(channel).Translate(
            pb.TranslateRequest(sentences=[sentence]), timeout=30).translations[0].text
    out = run_cli("translate", "--server", f"dns:///{served.target}", "--wait", "30", sentence, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == expected.strip()


def test_translate_cli_streams_the_same_text(served):
    sentences = ["the cat sleeps .", "a dog eats the bread ."]
    with served.channel() as channel:
        expected = [t.text for t in pb_grpc.TranslationServiceStub(channel).Translate(
            pb.TranslateRequest(sentences=sentences), timeout=30).translations]
    out = run_cli("translate", "--server", served.target, "--stream", *sentences, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == expected


def test_translate_cli_decodes_with_a_beam_or_samples_locally_and_through_the_server(served, tiny_bundle,
                                                                                    tiny_checkpoint):
    """--beam-size/--num-hypotheses/--sampling-*: the same n-best list from the bundle (ONNX Runtime), the
    server and the checkpoint (the PyTorch reference)."""
    import json

    from nmtserve.export.runtime.translator import OnnxTranslator

    sentences = ["the cat sleeps .", "a dog eats the bread ."]
    reference = OnnxTranslator(tiny_bundle, shared_cross=False)  # the server's step
    expected = reference.translate_batch(sentences, beam_size=4, num_hypotheses=2, max_decoding_length=64,
                                         return_scores=True)
    beam = ["--beam-size", "4", "--num-hypotheses", "2", "--max-decoding-length", "64", "--json"]
    for model in (["--server", served.target], [str(tiny_bundle)], [str(tiny_checkpoint)]):
        out = run_cli("translate", *beam, *model, *sentences, timeout=120)
        assert out.returncode == 0, out.stderr
        lines = [json.loads(line) for line in out.stdout.splitlines()]
        assert [[h["text"] for h in line["hypotheses"]] for line in lines] == \
               [[h.text for h in t.hypotheses] for t in expected], model
    sampled = [run_cli("translate", "--sampling-topk", "0", "--seed", "9", *model, *sentences, timeout=120).stdout
               for model in (["--server", served.target], [str(tiny_bundle)], [str(tiny_checkpoint)])]
    assert sampled[0] == sampled[1] == sampled[2] and sampled[0].count("\n") == 2
    bad = run_cli("translate", "--beam-size", "2", "--num-hypotheses", "3", str(tiny_bundle), "hi")
    assert bad.returncode == 2 and bad.stderr.strip().endswith("num_hypotheses 3: must be between 1 and beam_size (2)")


def test_translate_cli_forces_a_target_prefix_locally_and_through_the_server(served, tiny_bundle, tiny_checkpoint):
    """--target-prefix: every translation starts with it, the same from the bundle, the server and its stream; a
    checkpoint or --file refuses it in one line."""
    from nmtserve.export.runtime.translator import OnnxTranslator

    sentences = ["the cat sleeps .", "a dog eats the bread ."]
    expected = OnnxTranslator(tiny_bundle, shared_cross=False).translate_batch(
        sentences, beam_size=4, max_decoding_length=64, target_prefix=["Le chien"] * 2)
    flags = ["--target-prefix", "Le chien", "--beam-size", "4", "--max-decoding-length", "64"]
    for model in (["--server", served.target], ["--server", served.target, "--stream"], [str(tiny_bundle)]):
        out = run_cli("translate", *flags, *model, *sentences, timeout=120)
        assert out.returncode == 0 and out.stdout.splitlines() == [t.text for t in expected], (model, out.stderr)
    assert all(t.text.startswith("Le chien") for t in expected)
    favoured = OnnxTranslator(tiny_bundle, shared_cross=False).translate_batch(
        sentences, beam_size=4, max_decoding_length=64, target_prefix=["Le chien"] * 2, prefix_bias_beta=0.5)
    for model in (["--server", served.target], [str(tiny_bundle)]):
        out = run_cli("translate", *flags, "--prefix-bias-beta", "0.5", *model, *sentences, timeout=120)
        assert out.returncode == 0 and out.stdout.splitlines() == [t.text for t in favoured], (model, out.stderr)
    refused = run_cli("translate", "--target-prefix", "Le", str(tiny_checkpoint), "hi")
    assert refused.returncode == 2 and "--target-prefix: a bundle, a model folder or --server" in refused.stderr


def test_translate_cli_disables_tokens_locally_and_through_the_server(served, tiny_bundle, tiny_checkpoint):
    """--no-repeat-ngram-size, --min-decoding-length, --disable-unk and --suppress-sequence: the bundle's and the
    server's translations equal translate_batch's; the PyTorch reference refuses them in one line."""
    from nmtserve.export.runtime.translator import OnnxTranslator

    sentences = ["the cat sleeps .", "a dog eats the bread ."]
    expected = OnnxTranslator(tiny_bundle, shared_cross=False).translate_batch(
        sentences, max_decoding_length=64, no_repeat_ngram_size=2, min_decoding_length=5, disable_unk=True,
        suppress_sequences=["s"])
    flags = ["--no-repeat-ngram-size", "2", "--min-decoding-length", "5", "--disable-unk", "--suppress-sequence", "s",
             "--max-decoding-length", "64"]
    for model in (["--server", served.target], [str(tiny_bundle)]):
        out = run_cli("translate", *flags, *model, *sentences, timeout=120)
        assert out.returncode == 0 and out.stdout.splitlines() == [t.text for t in expected], (model, out.stderr)
    refused = run_cli("translate", "--disable-unk", str(tiny_checkpoint), "hi")
    assert refused.returncode == 2 and "--suppress-sequence: give a bundle or --server" in refused.stderr


def test_translate_cli_runs_the_bundle_variant_it_is_given(tiny_bundle):
    """--variant int8 runs the int8 graphs (its n-best scores are not fp32's); the default is fp32 on a CPU."""
    sentences = ["the cat sleeps .", "a dog eats the bread .", "the bird sings ."]
    scores = {}
    for variant in ("", "fp32", "int8"):
        flags = ["--variant", variant] if variant else []
        out = run_cli("translate", *flags, "--beam-size", "2", "--num-hypotheses", "2", "--json", str(tiny_bundle),
                      *sentences, timeout=120)
        assert out.returncode == 0, out.stderr
        scores[variant] = [[h["score"] for h in json.loads(line)["hypotheses"]] for line in out.stdout.splitlines()]
    assert scores[""] == scores["fp32"] != scores["int8"]
    assert len(scores["int8"]) == len(sentences)


def test_translate_cli_takes_text_after_the_options_and_names_a_missing_model(tiny_bundle):
    """`translate BUNDLE --beam-size 2 TEXT…` (text after options) translates what `translate --beam-size 2
    BUNDLE TEXT…` does; an unknown option is still refused, and a path that is neither bundle nor
    checkpoint is named as such (it used to say "no such checkpoint")."""
    sentences = ["the cat sleeps .", "a dog eats the bread ."]
    before = run_cli("translate", "--beam-size", "2", str(tiny_bundle), *sentences, timeout=120)
    after = run_cli("translate", str(tiny_bundle), "--beam-size", "2", *sentences, timeout=120)
    assert before.returncode == after.returncode == 0, after.stderr
    assert after.stdout == before.stdout and after.stdout.count("\n") == 2
    bad = run_cli("translate", str(tiny_bundle), "--beam-sizes", "2", *sentences)
    assert bad.returncode == 2 and "unrecognized arguments: --beam-sizes 2" in bad.stderr
    absent = run_cli("translate", str(tiny_bundle) + "-absent", *sentences)
    assert absent.returncode == 2 and absent.stderr.strip().endswith("-absent: no such bundle directory or checkpoint file")


def test_translate_cli_decodes_a_bundles_batches_at_once_on_threads_of_their_own(served, tiny_bundle, tiny_checkpoint,
                                                                                  monkeypatch):
    """--inter-threads 2 --threads 1: one sentence per batch, two batches at once (a decoding context per
    thread), the same n-best lists as one thread; the flags are refused where they do not apply, naming
    them and the value."""
    from nmtserve.cli import build_parser
    from nmtserve.export.runtime.translator import OnnxTranslator
    from nmtserve.local import local_translator

    sentences = ["the cat sleeps .", "a dog eats the bread .", "the bird sings .", "a cat eats ."]
    contexts, replica = [], OnnxTranslator.replica
    monkeypatch.setattr(OnnxTranslator, "replica", lambda self: contexts.append(self) or replica(self))
    args = build_parser("translate").parse_args(["translate", "--inter-threads", "2", "--threads", "1",
                                                 "--batch-size", "1", str(tiny_bundle), *sentences])
    assert len(local_translator(str(tiny_bundle), args)(sentences)) == len(sentences)
    assert len(contexts) == 2 and contexts[0].inter_threads == 2  # one per thread
    flags = ["--beam-size", "3", "--num-hypotheses", "2", "--max-decoding-length", "32", "--json", "--batch-size", "1"]
    one = run_cli("translate", *flags, str(tiny_bundle), *sentences, timeout=120)
    two = run_cli("translate", *flags, "--inter-threads", "2", "--threads", "1", str(tiny_bundle), *sentences,
                  timeout=120)
    assert one.returncode == two.returncode == 0, two.stderr
    assert two.stdout == one.stdout and two.stdout.count("\n") == len(sentences)
    refused = {("--inter-threads", "0", str(tiny_bundle)): "--inter-threads 0: must be at least 1",
               ("--threads", "-1", str(tiny_bundle)): "--threads -1: must be at least 0",
               ("--inter-threads", "2", "--server", served.target): "a server has its own",
               ("--inter-threads", "2", str(tiny_checkpoint)): "with a bundle (ONNX Runtime), not a checkpoint",
               ("--variant", "int8", "--server", served.target): "a server has its own",
               ("--variant", "int8", str(tiny_checkpoint)): "with a bundle (ONNX Runtime), not a checkpoint",
               ("--variant", "int4", str(tiny_bundle)): "no variant 'int4'",
               ("--variant", "int8", "--device", "cuda", str(tiny_bundle)): "variant 'int8' runs on cpu, not cuda",
               ("--inter-threads", "2", "--device", "cuda", str(tiny_bundle)): "inter_threads 2 on cuda: one decoding"}
    for out, message in zip(run_cli_each(*(("translate", *args, "hi") for args in refused), timeout=120),
                            refused.values()):
        assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, (out.args, out.stderr)


def test_models_cli_lists_what_list_models_answers(served):
    """`nmtserve models --server`: the same models, languages and limits as ListModels, in a line each and as JSON."""
    from google.protobuf.json_format import MessageToDict

    with served.channel() as channel:
        listed = pb_grpc.TranslationServiceStub(channel).ListModels(pb.ListModelsRequest(), timeout=30).models
    out = run_cli("models", "--server", served.target, "--json", timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [MessageToDict(m, preserving_proto_field_name=True) for m in listed]
    out = run_cli("models", "--server", served.target, timeout=120)
    lines = out.stdout.splitlines()
    assert out.returncode == 0 and len(lines) == len(listed) == 1, out.stdout + out.stderr
    model = listed[0]
    assert lines[0].startswith(f"{model.model}\t{model.source_language}→{model.target_language}\t{model.variant} on cpu")
    assert f"max_decoding_length {model.limits.max_decoding_length}," in lines[0]
    closed = run_cli("models", "--server", "127.0.0.1:1", "--timeout", "2", timeout=60)
    assert closed.returncode == 2 and closed.stderr.strip().startswith("nmtserve models: error: 127.0.0.1:1: UNAVAILABLE")


def test_translate_cli_sends_a_long_stdin_in_calls_the_server_accepts(served):
    """More lines than the server's max_sentences a call: as many calls as needed, every line answered in order."""
    with served.channel() as channel:
        stub = pb_grpc.TranslationServiceStub(channel)
        limit = stub.ListModels(pb.ListModelsRequest(), timeout=30).models[0].limits.max_sentences
        sentences = [f"the cat sleeps {'.' if i % 2 else '!'}" if i % 3 else "a dog eats the bread ." for i in range(limit + 6)]
        expected = [t.text for start in (0, limit) for t in stub.Translate(
            pb.TranslateRequest(sentences=sentences[start:start + limit]), timeout=60).translations]
    out = run_cli("translate", "--server", served.target, stdin="\n".join(sentences) + "\n", timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == expected and len(expected) == limit + 6


def _draining(server, draining: bool, health: bool = True) -> None:
    """Refuse new calls with UNAVAILABLE as a replica does from the start of its drain and, with `health`, say
    NOT_SERVING as it does (or take calls again, SERVING)."""
    from grpc_health.v1 import health_pb2

    from nmtserve.server.app import health_names

    server.running.servicer.accepting = not draining
    if health:
        status = health_pb2.HealthCheckResponse.NOT_SERVING if draining else health_pb2.HealthCheckResponse.SERVING
        for name in health_names(server.running.models):
            asyncio.run_coroutine_threadsafe(server.running.health.set(name, status), server.loop).result(10)


def _unavailable(server) -> float:
    samples = server.running.servicer.metrics.registry.collect()
    return sum(s.value for family in samples for s in family.samples
               if s.name == "nmtserve_requests_total" and s.labels["code"] == "UNAVAILABLE")


def _two_replicas(tiny_bundle):
    servers = [ServerThread(ServerConfig.from_flags(bundle=str(tiny_bundle), host="127.0.0.1", port=0, metrics_port=-1,
                                                    max_decoding_length=8)) for _ in range(2)]
    return servers, "ipv4:" + ",".join(f"127.0.0.1:{s.running.port}" for s in servers)


def _translate(stub):
    return stub.Translate(pb.TranslateRequest(sentences=["the cat sleeps ."]), timeout=30).translations


def _channel_on_both(target: str, servers):
    """A channel whose connections to both replicas are READY (health-checked: once each said SERVING): calls until
    each replica has decoded one."""
    import time

    channel = open_channel(target)
    stub = pb_grpc.TranslationServiceStub(channel)
    before, end = [s.running.engine.stats()["steps"] for s in servers], time.monotonic() + 30
    while not all(s.running.engine.stats()["steps"] > b for s, b in zip(servers, before)):
        assert time.monotonic() < end, "the channel never sent a call to both replicas"
        _translate(stub)
    return channel, stub


@pytest.fixture
def replicas(tiny_bundle):
    """Two replicas on ports of their own, and a channel whose connections to both are READY. gRPC keeps a retry
    budget per target name in the process: fresh ports give each test a budget of its own."""
    servers, target = _two_replicas(tiny_bundle)
    channel, stub = _channel_on_both(target, servers)
    yield servers, stub
    channel.close()
    for s in servers:
        s.running.servicer.accepting = True
        s.stop()


def test_a_replica_that_says_not_serving_gets_no_calls(replicas):
    """One replica says NOT_SERVING (its drain): once the channel's health watch tells it, the channel sends that
    replica no call (round_robin without the watch would send it every other one)."""
    import time

    servers, stub = replicas
    _draining(servers[0], True)
    end = time.monotonic() + 20
    while True:  # until the watch has told the channel: 6 calls in a row that do not reach the replica
        before = _unavailable(servers[0])
        assert all(_translate(stub) for _ in range(6))
        if _unavailable(servers[0]) == before:
            break
        assert time.monotonic() < end, "calls still reach a replica that said NOT_SERVING"
    before = _unavailable(servers[0])
    assert all(_translate(stub) for _ in range(12)) and _unavailable(servers[0]) == before


def test_a_call_refused_with_unavailable_is_retried_on_another_replica(replicas):
    """One replica refuses while its health still says SERVING (the moment before the watch tells): each refused
    attempt is sent again, to the other, and every call succeeds."""
    servers, stub = replicas
    _draining(servers[0], True, health=False)
    assert all(_translate(stub) for _ in range(6))
    assert _unavailable(servers[0]) > 0, "no attempt reached the refusing replica: nothing was retried"


def test_a_call_every_replica_refuses_fails_after_max_attempts(replicas):
    from nmtserve.client import SERVICE_CONFIG

    servers, stub = replicas
    for server in servers:
        _draining(server, True, health=False)
    with pytest.raises(grpc.RpcError) as refused:
        _translate(stub)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    attempts = _unavailable(servers[0]) + _unavailable(servers[1])
    assert attempts == SERVICE_CONFIG["methodConfig"][0]["retryPolicy"]["maxAttempts"]


def _client_ports(server_port: int) -> set[int]:
    """Local ports of this host's established TCP connections to server_port (Linux's /proc/net/tcp and tcp6: gRPC
    may connect to 127.0.0.1 from an IPv6 socket)."""
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            local, remote, state = line.split()[1:4]
            if state == "01" and int(remote.split(":")[1], 16) == server_port:
                ports.add(int(local.split(":")[1], 16))
    return ports


def test_a_connection_older_than_max_connection_age_is_replaced_and_no_call_fails(tiny_bundle):
    """--max-connection-age 1: the server asks the connection to go away after about a second; the client connects
    again (where a new replica could be found) and every call of a steady stream succeeds."""
    import time

    server = ServerThread(ServerConfig.from_flags(bundle=str(tiny_bundle), host="127.0.0.1", port=0, metrics_port=-1,
                                                  max_decoding_length=8, max_connection_age=1.0,
                                                  max_connection_age_grace=1.0))
    try:
        seen: set[int] = set()
        with open_channel(f"127.0.0.1:{server.running.port}") as channel:
            stub = pb_grpc.TranslationServiceStub(channel)
            end = time.monotonic() + 4.0
            while time.monotonic() < end:
                assert stub.Translate(pb.TranslateRequest(sentences=["the cat sleeps ."]), timeout=30).translations
                seen |= _client_ports(server.running.port)
        assert len(seen) >= 2, f"one connection all along ({seen}): max_connection_age did not replace it"
    finally:
        server.stop()


def test_the_retry_budget_stops_retries_once_spent(replicas):
    """retryThrottling: with one replica refusing every call it gets, retries go on until about half the budget's
    tokens are spent (a failure takes one, a success gives back 0.1), then stop: from there on the refused calls
    fail instead of doubling the load on the replicas."""
    from nmtserve.client import SERVICE_CONFIG

    servers, stub = replicas
    _draining(servers[0], True, health=False)
    failed = 0
    for _ in range(300):
        try:
            _translate(stub)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE
            failed += 1
    refused = _unavailable(servers[0])
    budget = SERVICE_CONFIG["retryThrottling"]["maxTokens"]
    assert failed > 0, "the refused calls were retried without end"
    assert refused - failed <= budget, "more retries than the budget allows"


def test_translate_cli_prints_the_attention_locally_and_through_a_server(served, tiny_bundle):
    """--return-attention --json: each line's attention (source and target pieces, a row of weights per target
    token), the same with a bundle and through a server, a target prefix's tokens first; without --json it is refused."""
    flags = ["--return-attention", "--json", "--target-prefix", "le", "--beam-size", "2", "--num-hypotheses", "2"]
    lines = {}
    for model in (["--server", served.target], [str(tiny_bundle)]):
        out = run_cli("translate", *flags, *model, "the cat sleeps .", "a dog eats the bread .", timeout=120)
        assert out.returncode == 0, out.stderr
        lines[model[0]] = [json.loads(line) for line in out.stdout.splitlines()]
    for local, remote in zip(lines[str(tiny_bundle)], lines["--server"]):
        a = local["attention"]
        assert a["target_tokens"][0] == "▁le" and len(a["weights"]) == len(a["target_tokens"])
        assert all(len(row) == len(a["source_tokens"]) for row in a["weights"])
        assert remote["attention"]["target_tokens"] == a["target_tokens"]
        assert max(abs(x - y) for r, s in zip(remote["attention"]["weights"], a["weights"], strict=True)
                   for x, y in zip(r, s, strict=True)) <= 2e-4
        assert [h["attention"]["target_tokens"] for h in local["hypotheses"]][0] == a["target_tokens"]
    refused = run_cli("translate", "--return-attention", str(tiny_bundle), "hi")
    assert refused.returncode == 2 and "--return-attention: the attention is printed with --json" in refused.stderr
