"""Every overlay renders with `kubectl kustomize`, validates against the Kubernetes schemas, and
agrees with the server's real flags, defaults and drain timing."""

import shutil
import subprocess

import kubernetes_validate
import pytest
import yaml

from nmtserve.server.app import SERVICE_NAME
from nmtserve.server.config import ServerConfig, env_name, flag_fields
from tests.helpers import ROOT, system_tool

KUBE = ROOT / "deploy" / "kubernetes"
OVERLAYS = ("cpu", "gpu", "multi-model", "api-keys", "tls", "gateway", "models-volume", "limiter")
CRD_GROUPS = {"ServiceMonitor": "monitoring.coreos.com/v1", "PrometheusRule": "monitoring.coreos.com/v1",
              "GRPCRoute": "gateway.networking.k8s.io/v1", "HTTPRoute": "gateway.networking.k8s.io/v1"}
KUBERNETES_VERSION = "1.30.0"  # the oldest release with the preStop `sleep` action (beta, on by default)


def documents(overlay: str) -> list[dict]:
    """Every object `kubectl kustomize` renders for the overlay."""
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl (with kustomize) is needed to render the manifests"
    out = subprocess.run([kubectl, "kustomize", str(KUBE / "overlays" / overlay)], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    return list(yaml.safe_load_all(out))


def render(overlay: str) -> dict[str, dict]:
    """One object per kind; of the ConfigMaps, the NMTSERVE_* variables (multi-model's models.toml and the limiter's
    haproxy.cfg have tests of their own)."""
    return {doc["kind"]: doc for doc in documents(overlay)
            if doc["kind"] != "ConfigMap" or any(key.startswith("NMTSERVE_") for key in doc["data"])}


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request):
    return request.param, render(request.param)


def test_every_object_validates_against_the_kubernetes_schema(rendered):
    _, docs = rendered
    assert {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget", "HorizontalPodAutoscaler",
            "NetworkPolicy", "ServiceMonitor", "PrometheusRule"} <= set(docs)
    for kind, doc in docs.items():
        if kind in CRD_GROUPS:  # the Prometheus Operator's and the Gateway API's: no schema here
            assert doc["apiVersion"] == CRD_GROUPS[kind]
            continue
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_ports_probes_and_env_agree_with_the_server(rendered):
    overlay, docs = rendered
    defaults = ServerConfig().flat()
    config = docs["ConfigMap"]["data"]
    known = {env_name(f.name) for _, f in flag_fields()}
    assert set(config) <= known, set(config) - known
    grpc_port, metrics_port = int(config.get("NMTSERVE_PORT", defaults["port"])), int(config.get("NMTSERVE_METRICS_PORT", defaults["metrics_port"]))
    http_port = int(config.get("NMTSERVE_HTTP_PORT", defaults["http_port"]))
    containers = {c["name"]: c for c in docs["Deployment"]["spec"]["template"]["spec"]["containers"]}
    container = containers["nmtserve"]
    ports = {p["name"]: p["containerPort"] for c in containers.values() for p in c["ports"]}
    public, own = {"grpc": grpc_port, "http": http_port}, {}  # the ports callers reach; the limiter's metrics
    if overlay == "limiter":  # HAProxy takes them and passes each call on to the server's own ports
        limiter = {e["name"]: e["value"] for e in containers["limiter"]["env"]}
        assert limiter["NMTSERVE_GRPC"] == f"127.0.0.1:{grpc_port}" and limiter["NMTSERVE_HTTP"] == f"127.0.0.1:{http_port}"
        public = {name: int(limiter[f"NMTSERVE_LIMITER_{name.upper()}"].rsplit(":", 1)[1]) for name in public}
        own = {"limiter-metrics": int(limiter["NMTSERVE_LIMITER_METRICS"].rsplit(":", 1)[1])}
        assert not set(public.values()) & {grpc_port, http_port}
        # it takes calls as long as the server does before the drain: the same preStop sleep
        assert containers["limiter"]["lifecycle"] == container["lifecycle"]
    assert ports == {**public, "metrics": metrics_port, **own}
    for probe in ("startupProbe", "readinessProbe"):  # kubelet's gRPC probe speaks no TLS: then the HTTP front's
        if overlay == "tls":
            assert container[probe]["httpGet"] == {"path": "/readyz", "port": http_port} and "grpc" not in container[probe]
        else:
            assert container[probe]["grpc"]["port"] == grpc_port
    if overlay != "tls":
        assert container["readinessProbe"]["grpc"]["service"] == SERVICE_NAME
    assert container["livenessProbe"]["httpGet"] == {"path": "/livez", "port": http_port}  # a route of server/http.py
    allowed = {p["port"] for rule in docs["NetworkPolicy"]["spec"]["ingress"] for p in rule["ports"]}
    assert allowed == {*public.values(), metrics_port, *own.values()}
    service_ports = {p["name"]: p["targetPort"] for p in docs["Service"]["spec"]["ports"]}
    assert set(service_ports.values()) <= set(ports) and docs["Service"]["spec"]["clusterIP"] == "None"
    assert docs["ServiceMonitor"]["spec"]["endpoints"][0]["port"] in service_ports
    # the drain fits in the grace period: preStop sleep + drain timeout < terminationGracePeriodSeconds
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    drain = float(config.get("NMTSERVE_DRAIN_TIMEOUT", defaults["drain_timeout"]))
    assert container["lifecycle"]["preStop"]["sleep"]["seconds"] + drain < pod["terminationGracePeriodSeconds"]
    hpa_metric = docs["HorizontalPodAutoscaler"]["spec"]["metrics"][0]["pods"]["metric"]["name"]
    assert hpa_metric == "nmtserve_requests_waiting"
    gpus = container["resources"]["limits"].get("nvidia.com/gpu")
    assert (gpus == 1 and config["NMTSERVE_DEVICE"] == "cuda") if overlay == "gpu" else (gpus is None and config["NMTSERVE_DEVICE"] == "cpu")


def test_pod_security_is_restricted(rendered):
    _, docs = rendered
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    for container in pod["containers"]:
        context = container["securityContext"]
        assert context["allowPrivilegeEscalation"] is False and context["readOnlyRootFilesystem"] is True
        assert context["capabilities"]["drop"] == ["ALL"]
    selector = docs["Deployment"]["spec"]["selector"]["matchLabels"]
    assert docs["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"] == selector
    assert docs["NetworkPolicy"]["spec"]["podSelector"]["matchLabels"] == selector


def test_the_multi_model_overlay_mounts_the_models_file_the_server_reads():
    import tomllib
    from pathlib import PurePosixPath

    from nmtserve.server.models import SPEC_KEYS

    docs = documents("multi-model")
    env = next(d["data"] for d in docs if d["kind"] == "ConfigMap" and "NMTSERVE_MODELS" in d["data"])
    models = next(d for d in docs if d["kind"] == "ConfigMap" and "models.toml" in d["data"])
    pod = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "models-file")
    volume = next(v for v in pod["volumes"] if v["name"] == "models-file")
    assert str(PurePosixPath(mount["mountPath"]) / "models.toml") == env["NMTSERVE_MODELS"]
    assert volume["configMap"]["name"] == models["metadata"]["name"]
    entries = tomllib.loads(models["data"]["models.toml"])["models"]
    assert len(entries) == 2 and all(set(e) <= set(SPEC_KEYS) and "bundle" in e for e in entries)


def test_the_api_keys_overlay_mounts_a_key_file_the_server_reads(tmp_path):
    import base64
    from pathlib import PurePosixPath

    from nmtserve.server.auth import read_clients

    docs = render("api-keys")
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "api-keys")
    volume = next(v for v in pod["volumes"] if v["name"] == "api-keys")
    secret = docs["Secret"]
    assert volume["secret"]["secretName"] == secret["metadata"]["name"] and mount["readOnly"] is True
    [(name, data)] = secret["data"].items()
    assert str(PurePosixPath(mount["mountPath"]) / name) == docs["ConfigMap"]["data"]["NMTSERVE_API_KEYS"]
    (tmp_path / name).write_bytes(base64.b64decode(data))
    assert read_clients(tmp_path / name)  # the file parses as the server parses it


def test_the_tls_overlay_mounts_the_certificate_where_the_server_reads_it():
    from pathlib import PurePosixPath

    docs = render("tls")
    config = docs["ConfigMap"]["data"]
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "tls")
    volume = next(v for v in pod["volumes"] if v["name"] == "tls")
    assert volume["secret"]["secretName"] and mount["readOnly"] is True
    for key, name in (("NMTSERVE_TLS_CERT", "tls.crt"), ("NMTSERVE_TLS_KEY", "tls.key")):  # kubernetes.io/tls keys
        assert config[key] == str(PurePosixPath(mount["mountPath"]) / name)


def test_replicas_spread_over_nodes_and_zones_without_blocking_a_schedule(rendered):
    _, docs = rendered
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    selector = docs["Deployment"]["spec"]["selector"]["matchLabels"]
    spread = {c["topologyKey"]: c for c in pod["topologySpreadConstraints"]}
    assert set(spread) == {"topology.kubernetes.io/zone", "kubernetes.io/hostname"}
    assert all(c["whenUnsatisfiable"] == "ScheduleAnyway" and c["labelSelector"]["matchLabels"].items() >= selector.items()
               for c in spread.values())
    [term] = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["labelSelector"]["matchLabels"].items() >= selector.items()


def test_the_gateway_routes_send_the_service_and_the_http_front_to_their_ports():
    docs = render("gateway")
    ports = {p["name"]: p["port"] for p in docs["Service"]["spec"]["ports"]}
    [grpc_rule] = docs["GRPCRoute"]["spec"]["rules"]
    assert grpc_rule["matches"] == [{"method": {"service": SERVICE_NAME}}]
    assert grpc_rule["backendRefs"] == [{"name": docs["Service"]["metadata"]["name"], "port": ports["grpc"]}]
    [http_rule] = docs["HTTPRoute"]["spec"]["rules"]
    assert http_rule["backendRefs"] == [{"name": docs["Service"]["metadata"]["name"], "port": ports["http"]}]
    routes = {m["path"]["value"] for m in http_rule["matches"]}
    from nmtserve.server.openapi import openapi_document

    documented = set(openapi_document()["paths"])  # every route sent on is one of the HTTP front's
    assert all(any(path == r or (r.endswith("/") and path.startswith(r)) for path in documented) for r in routes)


def test_the_models_volume_overlay_serves_a_bundle_from_the_claim():
    from pathlib import PurePosixPath

    docs = render("models-volume")
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "models")
    volume = next(v for v in pod["volumes"] if v["name"] == "models")
    assert volume["persistentVolumeClaim"]["claimName"] == docs["PersistentVolumeClaim"]["metadata"]["name"]
    assert mount["readOnly"] is True and volume["persistentVolumeClaim"]["readOnly"] is True
    assert PurePosixPath(docs["ConfigMap"]["data"]["NMTSERVE_BUNDLE"]).is_relative_to(mount["mountPath"])


def test_the_envoy_example_balances_both_ports_over_the_service_with_health_checks():
    """Envoy is not run here: its file's clusters must reach the Service's ports and check health as the server
    answers it (grpc.health.v1 for the service, the HTTP front's /readyz)."""
    config = yaml.safe_load((ROOT / "deploy" / "envoy" / "envoy.yaml").read_text())["static_resources"]
    service = render("cpu")["Service"]
    ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    clusters = {c["name"]: c for c in config["clusters"]}
    routed = {l["name"]: l["filter_chains"][0]["filters"][0]["typed_config"]["route_config"]["virtual_hosts"][0]
              ["routes"][0]["route"]["cluster"] for l in config["listeners"]}
    assert set(routed.values()) == set(clusters)
    for name, port_name in (("nmtserve_grpc", "grpc"), ("nmtserve_http", "http")):
        cluster = clusters[name]
        assert cluster["type"] == "STRICT_DNS" and cluster["lb_policy"] == "ROUND_ROBIN"
        [endpoint] = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
        address = endpoint["endpoint"]["address"]["socket_address"]
        assert address["address"].startswith(service["metadata"]["name"] + ".") and address["port_value"] == ports[port_name]
    assert clusters["nmtserve_grpc"]["health_checks"][0]["grpc_health_check"] == {"service_name": SERVICE_NAME}
    assert clusters["nmtserve_http"]["health_checks"][0]["http_health_check"] == {"path": "/readyz"}


def test_the_limiter_overlay_runs_the_haproxy_configuration_the_tests_run():
    """The ConfigMap holds deploy's haproxy.cfg and ceilings.map as they are (tests/deploy/test_limiter.py runs those
    files), mounted where the container reads them, and HAProxy accepts them with the container's environment."""
    from pathlib import PurePosixPath

    docs = documents("limiter")
    pod = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    limiter = next(c for c in pod["containers"] if c["name"] == "limiter")
    mount = next(m for m in limiter["volumeMounts"] if m["name"] == "limiter-config")
    volume = next(v for v in pod["volumes"] if v["name"] == "limiter-config")
    config = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == volume["configMap"]["name"])
    source, ceilings = (KUBE / "overlays" / "limiter" / name for name in ("haproxy.cfg", "ceilings.map"))
    assert config["data"] == {"haproxy.cfg": source.read_text(), "ceilings.map": ceilings.read_text()}
    assert limiter["args"] == ["-f", str(PurePosixPath(mount["mountPath"]) / "haproxy.cfg")]
    env = {e["name"]: e["value"] for e in limiter["env"]}
    assert env["NMTSERVE_LIMITER_CEILINGS"] == str(PurePosixPath(mount["mountPath"]) / "ceilings.map")
    env["NMTSERVE_LIMITER_CEILINGS"] = str(ceilings)  # where this checkout has it
    checked = subprocess.run([system_tool("haproxy"), "-c", "-f", str(source)], env=env, capture_output=True, text=True,
                             timeout=60)
    assert checked.returncode == 0 and "Warnings were found" not in checked.stdout + checked.stderr, checked.stderr
