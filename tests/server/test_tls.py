"""TLS and mutual TLS on the gRPC port, with certificates made by openssl for the test."""

import subprocess

import grpc
import pytest

from nmtserve.client import TlsFiles, open_channel
from nmtserve.server.config import ServerConfig
from nmtserve.v1 import translation_pb2 as pb
from nmtserve.v1 import translation_pb2_grpc as pb_grpc
from tests.helpers import ServerThread, run_cli, system_tool


def _openssl(*args: str, cwd) -> None:
    subprocess.run([system_tool("openssl"), *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a server certificate for localhost/127.0.0.1 and a client certificate, all signed by the CA."""
    d = tmp_path_factory.mktemp("pki")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=nmtserve-test-ca", cwd=d)
    (d / "server.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    (d / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for name in ("server", "client"):
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=d)
    return d


SENTENCE = "The cat sleeps."


def _translate(target: str, tls: TlsFiles | None) -> str:
    with open_channel(target, tls) as channel:
        response = pb_grpc.TranslationServiceStub(channel).Translate(
            pb.TranslateRequest(sentences=[SENTENCE], options=pb.DecodingOptions(max_decoding_length=4)), timeout=10)
    return response.translations[0].text


@pytest.fixture(scope="module")
def plaintext(tiny_bundle) -> str:
    """What a server without TLS answers for SENTENCE: the reference for the TLS servers' answers."""
    server = ServerThread(ServerConfig.from_flags(bundle=str(tiny_bundle), host="127.0.0.1", port=0, metrics_port=-1))
    try:
        text = _translate(server.target, None)
    finally:
        server.stop()
    assert text  # an empty answer would match anything that failed to decode
    return text


def _config(bundle, pki, **tls) -> ServerConfig:
    return ServerConfig.from_flags(bundle=str(bundle), host="127.0.0.1", port=0, metrics_port=-1,
                        tls_cert=str(pki / "server.pem"), tls_key=str(pki / "server.key"), **tls)


def test_tls_serves_clients_that_trust_the_ca_and_refuses_plaintext(tiny_bundle, pki, plaintext):
    server = ServerThread(_config(tiny_bundle, pki))
    try:
        assert _translate(server.target, TlsFiles(ca=str(pki / "ca.pem"))) == plaintext
        with pytest.raises(grpc.RpcError) as err:
            _translate(server.target, None)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop()


def test_mutual_tls_requires_a_client_certificate_signed_by_the_client_ca(tiny_bundle, pki, plaintext):
    server = ServerThread(_config(tiny_bundle, pki, tls_client_ca=str(pki / "ca.pem")))
    try:
        with_cert = TlsFiles(ca=str(pki / "ca.pem"), cert=str(pki / "client.pem"), key=str(pki / "client.key"))
        assert _translate(server.target, with_cert) == plaintext
        with pytest.raises(grpc.RpcError) as err:
            _translate(server.target, TlsFiles(ca=str(pki / "ca.pem")))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        # and the CLI client speaks mutual TLS too
        out = run_cli("translate", "--server", server.target, "--tls-ca", str(pki / "ca.pem"), "--tls-cert",
                      str(pki / "client.pem"), "--tls-key", str(pki / "client.key"), "--max-decoding-length", "4", SENTENCE)
        assert out.returncode == 0 and out.stdout.strip() == plaintext, out.stderr
    finally:
        server.stop()


def test_bad_certificate_paths_are_one_line_naming_the_flag(tiny_bundle, pki, tmp_path):
    out = run_cli("serve", str(tiny_bundle), "--port", "0", "--tls-cert", str(tmp_path / "missing.pem"),
                  "--tls-key", str(pki / "server.key"))
    assert out.returncode == 2 and "--tls-cert" in out.stderr and "missing.pem" in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    out = run_cli("serve", str(tiny_bundle), "--port", "0", "--tls-cert", str(pki / "server.pem"))
    assert out.returncode == 2 and "--tls-key" in out.stderr
    (tmp_path / "junk.pem").write_text("not a certificate")
    out = run_cli("translate", "--server", "localhost:1", "--tls-ca", str(tmp_path / "junk.pem"), "hello")
    assert out.returncode == 2 and "--tls-ca" in out.stderr and "not a PEM file" in out.stderr
