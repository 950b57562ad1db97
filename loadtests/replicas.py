"""Several replicas behind one name, on one machine: `nmtserve loadtest --scenario replicas`.

A network namespace of the run's own making (`ip netns`, root) holds one address per replica (10.77.0.11, …) and a
hosts file that names them all `replicas`, as a headless Service's DNS does; inside it, `nmtserve serve` replicas
(--max-connection-age short, so that clients find new ones soon) and a closed-loop client of `nmtserve.client`
(round_robin over health-checked connections, UNAVAILABLE retried) calling `dns:///replicas:50051`. The run, in
this order, `phase` seconds each:
- steady: three replicas; the calls spread over them (each replica's share within 20% of a third);
- scale-up: a fourth replica starts and, once serving (as a pod once ready), joins the hosts file; within
  max-connection-age + 10 s of that it gets at least a fifth of the calls;
- drain: SIGTERM of one replica (and out of the hosts file, as Kubernetes does): no call fails;
- kill: SIGKILL of another: calls fail only at the kill (at most one per client, each client having one call in
  flight), none from 2 s after it.
Each replica's calls/s over time (from its access log) and the client's failures are drawn in OUT/replicas.png;
OUT/replicas.json has the figures and the verdict of each check."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from nmtserve.errors import ConfigError, NmtserveError

NAME, PORT, SUBNET = "replicas", 50051, "10.77.0."


@dataclass
class ReplicasConfig:
    bundle: str
    out: str = "runs/loadtest/replicas"
    clients: int = 8
    phase: float = 8.0  # seconds of each phase (scale-up: max_connection_age + 10)
    max_connection_age: float = 4.0


class Namespace:
    """A network namespace with its own loopback addresses and hosts file (ip netns exec mounts
    /etc/netns/NAME/hosts over /etc/hosts for the processes it starts)."""

    def __init__(self, name: str):
        self.name, self.etc = name, Path("/etc/netns") / name
        self._ip("netns", "add", name)
        self._ip("-n", name, "link", "set", "lo", "up")
        self.etc.mkdir(parents=True, exist_ok=True)
        (self.etc / "host.conf").write_text("multi on\n")  # every line of a name, not the first
        self.hosts({})

    @staticmethod
    def _ip(*args: str) -> None:
        done = subprocess.run(["ip", *args], capture_output=True, text=True)
        if done.returncode:
            raise ConfigError(f"ip {' '.join(args)}: {done.stderr.strip()} (the replicas scenario makes a network "
                              "namespace: it needs root, or CAP_NET_ADMIN)")

    def address(self, address: str) -> None:
        self._ip("-n", self.name, "addr", "add", f"{address}/32", "dev", "lo")

    def hosts(self, addresses: dict[str, str]) -> None:
        """The hosts file: `replicas` for each address (written in place: the running processes see it)."""
        with open(self.etc / "hosts", "w") as f:
            f.write("127.0.0.1 localhost\n" + "".join(f"{a} {NAME}\n" for a in addresses.values()))

    def run(self, cmd: list[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", self.name, *cmd], **kwargs)

    def close(self) -> None:
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)
        for path in self.etc.iterdir():
            path.unlink()
        self.etc.rmdir()


class Replica:
    def __init__(self, ns: Namespace, index: int, cfg: ReplicasConfig, out: Path):
        self.name, self.address, self.log = f"r{index}", f"{SUBNET}{10 + index}", out / f"r{index}.log"
        ns.address(self.address)
        with open(self.log, "w") as log:  # the child keeps its own descriptor
            self.process = ns.run([sys.executable, "-m", "nmtserve.cli", "serve", cfg.bundle, "--host", self.address,
                                   "--port", str(PORT), "--metrics-port", "-1", "--max-connection-age",
                                   str(cfg.max_connection_age), "--max-connection-age-grace", "5",
                                   "--drain-timeout", "5", "--threads", "1", "--access-log", "on"],
                                  stdout=subprocess.PIPE, stderr=log, text=True)
        line = self.process.stdout.readline()
        if "serving on port" not in line:
            raise NmtserveError(f"replica {self.name} did not start: {self.log.read_text()[-500:]}")

    def calls(self) -> list[float]:
        """Epoch seconds at which this replica answered a Translate call OK, from its access log."""
        times = []
        for line in self.log.read_text().splitlines():
            record = json.loads(line)
            if record.get("logger") == "nmtserve.access" and record.get("rpc") == "Translate" and record["code"] == "OK":
                times.append(datetime.fromisoformat(record["time"]).timestamp())
        return times


def client(target: str, clients: int, seconds: float, out: str, resolve_ms: int) -> None:
    """Closed-loop clients through one channel each (the service config of nmtserve.client; the name resolved
    again at most every `resolve_ms`, scaled as the run's connection age is); every call's end as one JSON line:
    epoch seconds and status."""
    import grpc

    from nmtserve.client import open_channel
    from nmtserve.v1 import translation_pb2 as pb
    from nmtserve.v1 import translation_pb2_grpc as pb_grpc

    records, lock, end = [], threading.Lock(), time.time() + seconds

    def loop() -> None:
        with open_channel(target, options=[("grpc.dns_min_time_between_resolutions_ms", resolve_ms)]) as channel:
            stub = pb_grpc.TranslationServiceStub(channel)
            while time.time() < end:
                try:
                    stub.Translate(pb.TranslateRequest(sentences=["the cat sleeps on the mat"]), timeout=10,
                                   wait_for_ready=True)
                    code = "OK"
                except grpc.RpcError as e:
                    code = e.code().name
                with lock:
                    records.append({"t": time.time(), "code": code})

    threads = [threading.Thread(target=loop) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    Path(out).write_text("".join(json.dumps(r) + "\n" for r in records))


def run_replicas(cfg: ReplicasConfig) -> dict:
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    ns = Namespace(f"nmtserve-{os.getpid()}")
    replicas: dict[str, Replica] = {}
    events: list[tuple[float, str]] = []
    scale_up = cfg.max_connection_age + 10
    load = None
    try:
        for i in (1, 2, 3):
            replicas[f"r{i}"] = Replica(ns, i, cfg, out)
        ns.hosts({r.name: r.address for r in replicas.values()})
        seconds = 2 + cfg.phase + scale_up + 2 * cfg.phase + 2
        load = ns.run([sys.executable, "-m", "nmtserve.loadtests.replicas", f"dns:///{NAME}:{PORT}",
                       str(cfg.clients), str(seconds), str(out / "calls.jsonl"),
                       str(int(cfg.max_connection_age * 1000 / 4))],
                      env={**os.environ, "GRPC_DNS_RESOLVER": "native"})
        start = time.time()
        time.sleep(2 + cfg.phase)
        replicas["r4"] = Replica(ns, 4, cfg, out)  # loaded and warm: SERVING, as a pod once ready
        ns.hosts({r.name: r.address for r in replicas.values()})
        events.append((time.time(), "r4 serving"))
        time.sleep(scale_up)
        events.append((time.time(), "SIGTERM r1"))
        ns.hosts({r.name: r.address for r in replicas.values() if r.name != "r1"})
        replicas["r1"].process.send_signal(signal.SIGTERM)
        time.sleep(cfg.phase)
        events.append((time.time(), "SIGKILL r2"))
        ns.hosts({r.name: r.address for r in replicas.values() if r.name not in ("r1", "r2")})
        replicas["r2"].process.kill()
        load.wait(seconds + 60)
        if load.returncode:
            raise NmtserveError(f"the load client exited with {load.returncode}")
    finally:
        if load is not None and load.poll() is None:
            load.kill()
        for r in replicas.values():
            if r.process.poll() is None:
                r.process.send_signal(signal.SIGTERM)
                r.process.wait(30)
        ns.close()
    calls = [json.loads(line) for line in (out / "calls.jsonl").read_text().splitlines()]
    report = verdicts(cfg, start, events, calls, {name: r.calls() for name, r in replicas.items()})
    (out / "replicas.json").write_text(json.dumps(report, indent=2) + "\n")
    draw(report, out / "replicas.png")
    return report


def _share(answered: dict[str, list[float]], name: str, since: float, until: float) -> float:
    counts = {n: sum(since <= t < until for t in times) for n, times in answered.items()}
    return counts[name] / max(1, sum(counts.values()))


def verdicts(cfg: ReplicasConfig, start: float, events: list[tuple[float, str]], calls: list[dict],
             answered: dict[str, list[float]]) -> dict:
    """The four checks, each with its figures and whether it held."""
    (joined, _), (drained, _), (killed, _) = events
    steady = {n: sum(start + 2 <= t < joined for t in answered[n]) for n in ("r1", "r2", "r3")}
    mean = sum(steady.values()) / 3
    spread = max(abs(c - mean) / mean for c in steady.values()) if mean else 1.0
    new_share = _share(answered, "r4", joined + cfg.max_connection_age + 5, joined + cfg.max_connection_age + 10)
    failed_draining = [c for c in calls if drained <= c["t"] < killed and c["code"] != "OK"]
    failed_at_kill = [c for c in calls if killed <= c["t"] < killed + 2 and c["code"] != "OK"]
    failed_after = [c for c in calls if c["t"] >= killed + 2 and c["code"] != "OK"]
    checks = {
        "steady spread": {"calls": steady, "most off the mean": round(spread, 3), "held": spread <= 0.2},
        "new replica's share": {"share": round(new_share, 3), "within_s": cfg.max_connection_age + 10,
                                "held": new_share >= 0.2},
        "SIGTERM failures": {"failed": len(failed_draining), "held": not failed_draining},
        "SIGKILL failures": {"at the kill": len(failed_at_kill), "bound": cfg.clients, "after 2 s": len(failed_after),
                             "held": len(failed_at_kill) <= cfg.clients and not failed_after},
    }
    return {"clients": cfg.clients, "max_connection_age": cfg.max_connection_age, "start": start,
            "events": [{"t": round(t - start, 2), "what": what} for t, what in events],
            "calls": len(calls), "failed": sum(c["code"] != "OK" for c in calls),
            "answered": {n: [round(t - start, 3) for t in times] for n, times in answered.items()},
            "failures": [round(c["t"] - start, 3) for c in calls if c["code"] != "OK"], "checks": checks}


def draw(report: dict, path: Path) -> None:
    """Each replica's calls/s over time (1-s bins), the client's failures, and the events."""
    from nmtserve.loadtests.charts import pyplot, save

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(10, 4.5))
    end = max([t for times in report["answered"].values() for t in times] + [1.0])
    bins = range(int(end) + 2)
    for name, times in report["answered"].items():
        ax.plot(list(bins), [sum(b <= t < b + 1 for t in times) for b in bins], label=name)
    if report["failures"]:
        ax.plot(list(bins), [sum(b <= t < b + 1 for t in report["failures"]) for b in bins], "k:", label="failed")
    for event in report["events"]:
        ax.axvline(event["t"], color="grey", linewidth=0.8)
        ax.annotate(event["what"], (event["t"], ax.get_ylim()[1] * 0.95), rotation=90, fontsize=8, va="top")
    ax.set_xlabel("seconds")
    ax.set_ylabel("calls answered / s")
    ax.set_title(f"{report['clients']} clients through dns:///{NAME}, max-connection-age {report['max_connection_age']:g} s")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    save(fig, path)


if __name__ == "__main__":  # the client, inside the namespace: TARGET CLIENTS SECONDS OUT RESOLVE_MS
    client(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], int(sys.argv[5]))
