"""The README's quickstarts, followed as a newcomer would: every command of every "Quickstart" section is
extracted from README.md and run on the tiny test models, so the README cannot drift from the code.

What changes between the README and this run, and nothing else: the built-in bundle is the tiny test bundle, the
OPUS-MT folder a tiny random Marian folder built here, the corpus the tiny test corpus, the ports free ones, and
the sizes small (a few training steps, seconds of load). Two things cannot run on this machine, and their lines are
checked as far as they can be: `docker build` and `kubectl apply` (no Docker engine, no cluster: the same
manifests pass `kubectl kustomize`, which runs, and tests/deploy), and grpcurl (not packaged for Debian: its
request body must parse as the method's request message, and the method must exist)."""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf.json_format import Parse

from nmtserve.v1 import translation_pb2 as pb
from tests.helpers import NMTSERVE, ServerThread, run_cli

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def quickstarts() -> dict[str, list[tuple[str, str]]]:
    """Each "## Quickstart: …" section's fenced code blocks, as (language, text), in order."""
    sections = re.split(r"^## ", README.read_text(encoding="utf-8"), flags=re.M)
    found = {}
    for section in sections:
        title, _, body = section.partition("\n")
        if title.startswith("Quickstart: "):
            found[title.removeprefix("Quickstart: ")] = re.findall(r"^```(\w+)\n(.*?)^```", body, flags=re.M | re.S)
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_bash(script: str, cwd: Path, substitutions: dict[str, str], timeout: float = 600,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The block as one bash script (errors stop it) with `nmtserve` this environment's, after the substitutions."""
    for old, new in substitutions.items():
        assert old in script, f"the README no longer says {old!r}: update this test's substitutions"
        script = script.replace(old, new)
    env = {**os.environ, **(env or {}), "PATH": f"{Path(NMTSERVE).parent}:{os.environ['PATH']}"}
    return subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_the_readme_has_the_quickstarts_the_issue_asks_for():
    assert list(quickstarts()) == ["serve the built-in model", "serve your own OPUS-MT, M2M100 or NLLB folder", "call it",
                                   "deploy on Kubernetes", "load-test it", "train on your own corpus"]
    assert len(README.read_text().splitlines()) <= 300


def test_serve_the_built_in_model(tiny_bundle, tmp_path):
    from nmtserve.export.runtime.translator import OnnxTranslator

    [(language, script)] = quickstarts()["serve the built-in model"]
    port = str(free_port())
    done = run_bash(script, tmp_path, {"bundles/default": str(tiny_bundle), "50051": port})
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if not line.startswith("nmtserve: serving on port")]
    assert len(lines) == 2 + 1 + 1, done.stdout  # two translations, one JSON line, one model
    expected = OnnxTranslator(tiny_bundle, shared_cross=False).translate_batch(
        ["The cat sleeps.", "Did the dogs eat the apples?"])
    assert lines[:2] == [t.text for t in expected]
    assert json.loads(lines[2])["source"] == "The cat sleeps." and len(json.loads(lines[2])["hypotheses"]) == 2
    assert lines[3].startswith("en-fr\ten→fr\tfp32 on cpu"), lines[3]


def test_serve_your_own_folder(tmp_path):
    from nmtserve.loadtests.marian_model import build_marian_dir

    [(language, script)] = quickstarts()["serve your own OPUS-MT, M2M100 or NLLB folder"]
    folder = build_marian_dir(tmp_path / "opus-mt-en-fr", activation="swish", scale_embedding=True, encoder_layers=2,
                              decoder_layers=2, seed=0)
    cache = {"NMTSERVE_CACHE": str(tmp_path / "cache")}
    done = run_bash(script, tmp_path, {"~/models/opus-mt-en-fr": str(folder), "50052": str(free_port())}, env=cache)
    assert done.returncode == 0, done.stdout + done.stderr
    # the served translation is the one the same cached bundle gives offline, under the model's decoding defaults
    offline = run_cli("translate", str(folder), "--variant", "int8", "The weather is nice today.", env=cache)
    assert offline.returncode == 0 and done.stdout.splitlines()[-1] == offline.stdout.strip(), offline.stderr
    assert "the bundle made from it before" in offline.stderr, offline.stderr


def test_call_it(tiny_bundle):
    from nmtserve.server.config import ServerConfig

    blocks = quickstarts()["call it"]
    assert [language for language, _ in blocks] == ["python", "bash", "bash"]
    server = ServerThread(ServerConfig.from_flags(bundle=str(tiny_bundle), host="127.0.0.1", port=0, metrics_port=-1,
                                                  http_port=0))
    try:
        python = blocks[0][1].replace("localhost:50051", server.target)
        done = subprocess.run([sys.executable, "-c", python], capture_output=True, text=True, timeout=120)
        curl = run_bash(blocks[2][1], ROOT, {"localhost:8080": f"127.0.0.1:{server.running.http_port}"}, timeout=120)
        with server.channel() as channel:
            from nmtserve.v1 import translation_pb2_grpc as pb_grpc

            stub = pb_grpc.TranslationServiceStub(channel)
            expected = stub.Translate(pb.TranslateRequest(sentences=["The cat sleeps."], options=pb.DecodingOptions(
                beam_size=4)), timeout=30).translations[0].text
            greedy = stub.Translate(pb.TranslateRequest(sentences=["The cat sleeps."]), timeout=30).translations[0].text
            marked = stub.TranslateText(pb.TranslateTextRequest(texts=["<p>The <b>old</b> cat sleeps.</p>"],
                                                                mime_type="text/html"), timeout=30).translations[0]
    finally:
        server.stop()
    assert done.returncode == 0 and done.stdout == expected + "\n", done.stdout + done.stderr
    # curl: the HTTP front's three answers, one JSON object each
    assert curl.returncode == 0, curl.stderr
    answers = [json.loads(line) for line in curl.stdout.replace("}{", "}\n{").splitlines()]
    assert answers == [{"translations": [{**answers[0]["translations"][0], "text": greedy}]},
                       {"translatedText": greedy, "detectedLanguage": {"confidence": 100.0, "language": "en"}},
                       {"translations": [{"text": marked.text, "sentences": 1, "inputTokens": marked.input_tokens,
                                          "outputTokens": marked.output_tokens}]}]
    assert marked.text.startswith("<p>") and marked.text.count("<b>") == 1
    # grpcurl: the body is the request message of the method it names, in protobuf's JSON mapping
    words = shlex.split(blocks[1][1].strip())
    assert words[0] == "grpcurl" and words[-1] == "nmtserve.v1.TranslationService/Translate"
    body = Parse(words[words.index("-d") + 1], pb.TranslateRequest())
    assert list(body.sentences) == ["The cat sleeps."]
    assert "Translate" in pb.DESCRIPTOR.services_by_name["TranslationService"].methods_by_name


def test_deploy_on_kubernetes(tmp_path):
    [(language, script)] = quickstarts()["deploy on Kubernetes"]
    lines = [line for line in script.splitlines() if line.strip()]
    assert [line.split()[0:2] for line in lines] == [["docker", "build"], ["kubectl", "kustomize"], ["kubectl", "apply"]]
    kustomize = shlex.split(lines[1].split("#")[0])
    done = subprocess.run(kustomize, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "kind: Deployment" in done.stdout, done.stderr
    dockerfile = shlex.split(lines[0].split("#")[0])
    assert (ROOT / dockerfile[dockerfile.index("-f") + 1]).is_file()
    assert (ROOT / shlex.split(lines[2].split("#")[0])[-1]).is_dir()


def test_load_test_it(tiny_bundle, tmp_path):
    [(language, script)] = quickstarts()["load-test it"]
    done = run_bash(script, tmp_path, {"bundles/default": str(tiny_bundle), "--seconds 30": "--seconds 8",
                                       "loadtests/slo.toml": str(ROOT / "loadtests/slo.toml")}, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "p95_latency_ms" in done.stdout and (tmp_path / "runs/loadtest/steady/report.html").is_file()  # exit 0: met


@pytest.mark.filterwarnings("ignore")
def test_train_on_your_own_corpus(tiny_corpus, tmp_path):
    [(language, script)] = quickstarts()["train on your own corpus"]
    done = run_bash(script, tmp_path, {
        "corpus.tsv": str(tiny_corpus / "train.tsv"), "test.tsv": str(tiny_corpus / "test.tsv"),
        "--max-minutes 60": "--max-steps 8 --preset tiny --vocab-size 400 --valid-every 4 --average-last 2"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "BLEU" in done.stdout and (tmp_path / "bundles/mine/manifest.json").is_file()
