"""`nmtserve loadtest --scenario replicas` end to end: real server processes, each on its own address in a network
namespace of the run's making, behind one name in its hosts file; a client of nmtserve.client at steady load
through dns:///replicas. The four checks must hold: the calls spread within 20%, a new replica gets a fifth of
them within max-connection-age + 10 s, a drained replica fails no call, a killed one only those in flight."""

import json

from tests.helpers import run_cli


def test_replicas_spread_a_new_one_gets_calls_and_draining_or_killing_one_loses_nothing(tiny_bundle, tmp_path):
    out = tmp_path / "replicas"
    result = run_cli("loadtest", str(tiny_bundle), "--scenario", "replicas", "--peak-users", "8", "--seconds", "30",
                     "--out", str(out), timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((out / "replicas.json").read_text())
    assert set(report["checks"]) == {"steady spread", "new replica's share", "SIGTERM failures", "SIGKILL failures"}
    assert all(check["held"] for check in report["checks"].values())
    assert set(report["answered"]) == {"r1", "r2", "r3", "r4"} and all(report["answered"].values())
    assert report["calls"] > 1000
    assert (out / "replicas.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result.stdout.count("held: ") == 4
