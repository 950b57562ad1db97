"""API keys (server/auth.py) on a real server, on both fronts: no key or an unknown one is UNAUTHENTICATED (401), a model
the client may not use PERMISSION_DENIED (403); health stays open; the file is read again when it changes, and a
broken one keeps the keys in force; the CLI sends its key; keys never reach the log."""

import logging
import os

import grpc
import pytest
import requests
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nmtserve.errors import ConfigError
from nmtserve.logs import json_formatter
from nmtserve.server import auth
from nmtserve.server.app import start_server
from nmtserve.server.auth import client_entry
from nmtserve.server.config import ServerConfig
from nmtserve.v1 import translation_pb2 as pb
from nmtserve.v1 import translation_pb2_grpc as pb_grpc
from tests.helpers import ServerThread, run_cli

WEB, NARROW, LATER = "key-of-the-web-front-end", "key-of-a-client-of-fr-en-only", "a-key-added-while-serving"


@pytest.fixture(scope="module")
def keyed(tiny_bundle, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.toml"
    keys.write_text(client_entry("web", WEB) + client_entry("narrow", NARROW, ["fr-en"]))
    server = ServerThread(ServerConfig.from_flags(bundle=str(tiny_bundle), host="127.0.0.1", port=0, metrics_port=-1,
                                                  http_port=0, api_keys=str(keys), max_decoding_length=32,
                                                  access_log="on"))
    server.keys, server.url = keys, f"http://127.0.0.1:{server.running.http_port}"
    yield server
    server.stop()


def _translate(server, key: str | None):
    metadata = None if key is None else [("authorization", f"Bearer {key}")]
    with server.channel() as channel:
        return pb_grpc.TranslationServiceStub(channel).Translate(pb.TranslateRequest(sentences=["the cat"]),
                                                                 metadata=metadata, timeout=30)


def _refused(server, key: str | None) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as refused:
        _translate(server, key)
    return refused.value


def test_grpc_calls_need_a_clients_key_for_the_model_and_health_stays_open(keyed, caplog):
    caplog.set_level(logging.INFO, logger="nmtserve")
    assert _translate(keyed, WEB).translations[0].text
    assert _refused(keyed, None).code() == grpc.StatusCode.UNAUTHENTICATED
    assert _refused(keyed, "not-a-key").code() == grpc.StatusCode.UNAUTHENTICATED
    denied = _refused(keyed, NARROW)
    assert denied.code() == grpc.StatusCode.PERMISSION_DENIED
    assert denied.details() == "model 'en-fr': client narrow may use fr-en"
    with keyed.channel() as channel:
        with pytest.raises(grpc.RpcError) as listed:
            pb_grpc.TranslationServiceStub(channel).ListModels(pb.ListModelsRequest(), timeout=30)
        assert listed.value.code() == grpc.StatusCode.UNAUTHENTICATED
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert any(r.name == "nmtserve.access" and r.client == "web" for r in caplog.records)
    logged = "\n".join(json_formatter().format(r) for r in caplog.records)  # every field, as the server writes it
    assert '"client": "web"' in logged and not any(k in logged for k in (WEB, NARROW))


def test_http_calls_need_a_key_in_the_header_or_libretranslates_api_key(keyed):
    body = {"sentences": ["the cat"]}
    assert requests.post(f"{keyed.url}/v1/translate", json=body, timeout=30).status_code == 401
    wrong = requests.post(f"{keyed.url}/v1/translate", json=body, headers={"authorization": "Bearer x"}, timeout=30)
    assert wrong.status_code == 401 and wrong.json()["error"]["status"] == "UNAUTHENTICATED"
    denied = requests.post(f"{keyed.url}/v1/translate", json=body, headers={"authorization": f"Bearer {NARROW}"},
                           timeout=30)
    assert denied.status_code == 403 and denied.json()["error"]["status"] == "PERMISSION_DENIED"
    ok = requests.post(f"{keyed.url}/v1/translate", json=body, headers={"authorization": f"Bearer {WEB}"}, timeout=30)
    assert ok.status_code == 200 and ok.json()["translations"][0]["text"] == _translate(keyed, WEB).translations[0].text
    libre = {"q": "the cat", "target": "fr"}
    assert requests.post(f"{keyed.url}/translate", json={**libre, "api_key": WEB}, timeout=30).status_code == 200
    refused = requests.post(f"{keyed.url}/translate", json={**libre, "api_key": "x"}, timeout=30)
    assert refused.status_code == 401 and "not known" in refused.json()["error"]
    assert requests.get(f"{keyed.url}/v1/models", timeout=30).status_code == 401
    assert requests.get(f"{keyed.url}/openapi.json", timeout=30).status_code == 200  # the document stays open


def test_the_key_file_is_read_again_when_it_changes_and_a_broken_one_keeps_the_keys(keyed, monkeypatch):
    monkeypatch.setattr(auth, "RECHECK_SECONDS", 0.0)
    assert _refused(keyed, LATER).code() == grpc.StatusCode.UNAUTHENTICATED
    before = keyed.keys.read_text()
    try:
        keyed.keys.write_text(before + client_entry("later", LATER))
        os.utime(keyed.keys, ns=(1, 1))  # a stamp of its own, whatever the file system's clock
        assert _translate(keyed, LATER).translations  # no restart
        keyed.keys.write_text(before + '[[client]]\nname = "broken"\n')
        os.utime(keyed.keys, ns=(2, 2))
        assert _translate(keyed, LATER).translations and _translate(keyed, WEB).translations  # the keys in force stay
    finally:
        keyed.keys.write_text(before)
        os.utime(keyed.keys, ns=(3, 3))
    assert _refused(keyed, LATER).code() == grpc.StatusCode.UNAUTHENTICATED


def test_the_cli_sends_its_key(keyed):
    done = run_cli("translate", "--server", keyed.target, "--api-key", WEB, "the cat")
    assert done.returncode == 0 and done.stdout.strip() == _translate(keyed, WEB).translations[0].text
    refused = run_cli("translate", "--server", keyed.target, "the cat", env={"NMTSERVE_API_KEY": "x"})
    assert refused.returncode != 0 and "UNAUTHENTICATED" in refused.stderr


@pytest.mark.parametrize("text, message", [
    ('[[client]]\nname = "a"\nsha256 = "abc"\n', "sha256 must be 64 hexadecimal digits"),
    ('[[client]]\nsha256 = "' + "0" * 64 + '"\n', "name None"),
    ('[[client]]\nname = "a"\nsha256 = "' + "0" * 64 + '"\nkey = "in clear"\n', "unknown fields ['key']"),
    ('[[client]]\nname = "a"\nsha256 = "' + "0" * 64 + '"\nmax_concurrent = 0\n', "max_concurrent 0 must be a whole"),
    ('[[client]]\nname = "a"\nsha256 = "' + "0" * 64 + '"\nchars_per_minute = 1.5\n', "chars_per_minute 1.5 must"),
    ("not toml [", "--api-keys"),
])
def test_a_bad_key_file_stops_the_start_naming_the_problem(tiny_bundle, tmp_path, text, message):
    import asyncio

    keys = tmp_path / "keys.toml"
    keys.write_text(text)
    config = ServerConfig.from_flags(bundle=str(tiny_bundle), host="127.0.0.1", port=0, metrics_port=-1,
                                     api_keys=str(keys))
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        asyncio.run(start_server(config))


def test_the_api_key_command_prints_the_key_once_and_a_file_entry_with_only_its_digest(tmp_path):
    done = run_cli("api-key", "web", "--model", "en-fr", "--chars-per-minute", "600")
    assert done.returncode == 0, done.stderr
    key = done.stderr.strip().rsplit(" ", 1)[-1]
    assert key.startswith("nmt-") and key not in done.stdout
    (tmp_path / "keys.toml").write_text(done.stdout)
    [client] = auth.read_clients(tmp_path / "keys.toml")
    assert (client.name, client.digest, client.models, client.chars_per_minute, client.max_concurrent) == (
        "web", auth.digest_of(key), frozenset({"en-fr"}), 600, None)
