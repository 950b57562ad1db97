"""HAProxy as the limiter in front of one server, started with the deployment's own configuration
(deploy/kubernetes/overlays/limiter/haproxy.cfg), for the benchmarks and tests that call through it.
It never edits the configuration: it fills the variables the file names, as the Kubernetes overlay does."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

from nmtserve.errors import ConfigError
from nmtserve.loadtests.workload import free_port, metric_families


class Limiter:
    """`haproxy -f CONFIG` on 127.0.0.1 in front of a server's gRPC and HTTP ports: `.target` (gRPC),
    `.http_url` and `.metrics_url` (HAProxy's own Prometheus page), once it accepts connections. Every client's
    ceiling is `calls_per_second` but the keys' own in the map file `ceilings` (default: ceilings.map beside CONFIG)."""

    def __init__(self, config: str | Path, grpc_target: str, http_target: str, calls_per_second: int,
                 log: str | Path | None = None, start_timeout: float = 30, ceilings: str | Path | None = None):
        haproxy = shutil.which("haproxy")
        if haproxy is None:
            raise ConfigError("haproxy is not installed: `make tools` installs Debian's haproxy package")
        if not Path(config).is_file():
            raise ConfigError(f"limiter config {config}: no such file (the deployment's is "
                              "deploy/kubernetes/overlays/limiter/haproxy.cfg)")
        grpc_port, http_port, metrics_port = free_port(), free_port(), free_port()
        self.target = f"127.0.0.1:{grpc_port}"
        self.http_url, self.metrics_url = f"http://127.0.0.1:{http_port}", f"http://127.0.0.1:{metrics_port}/metrics"
        env = {"NMTSERVE_LIMITER_GRPC": self.target, "NMTSERVE_LIMITER_HTTP": f"127.0.0.1:{http_port}",
               "NMTSERVE_LIMITER_METRICS": f"127.0.0.1:{metrics_port}", "NMTSERVE_GRPC": grpc_target,
               "NMTSERVE_HTTP": http_target, "NMTSERVE_CALLS_PER_SECOND": str(calls_per_second),
               "NMTSERVE_LIMITER_CEILINGS": str(ceilings or Path(config).with_name("ceilings.map"))}
        self.log = open(log, "w") if log else subprocess.DEVNULL
        self.proc = subprocess.Popen([haproxy, "-db", "-f", str(config)], env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + start_timeout
        while not _accepts(grpc_port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise ConfigError(f"haproxy -f {config} did not start (exit {self.proc.returncode}; its log: {log})")
            time.sleep(0.05)

    def refused(self, *proxies: str) -> float:
        """The calls the named fronts ("grpc", "http") have refused so far, from HAProxy's Prometheus page."""
        return sum(s.value for family in metric_families(self.metrics_url) for s in family.samples
                   if s.name == "haproxy_frontend_intercepted_requests_total" and s.labels["proxy"] in proxies)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)
        if self.log is not subprocess.DEVNULL:
            self.log.close()

    def __enter__(self) -> Limiter:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False
