"""The Kubernetes manifests in config/kubernetes/: parsed, and their fields checked against each other
and against the onebitd config they carry.  No cluster is at hand, so this is what is checked:
that a rolling update drains before it stops, waits long enough, and probes the right thing."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from supervisor import config as configuration
from supervisor.config import Config

MANIFESTS = Path(__file__).parents[3] / "config" / "kubernetes"
# What preStop waits before draining, for the endpoint removal to reach every node (deployment.yaml).
ENDPOINTS_S = 5


def load_all() -> dict[str, dict[str, Any]]:
    """Every document of every manifest, by kind; each kind once."""
    found: dict[str, dict[str, Any]] = {}
    for path in sorted(MANIFESTS.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            assert document["kind"] not in found, f"{path}: a second {document['kind']}"
            found[document["kind"]] = document
    return found


@pytest.fixture(scope="module")
def manifests() -> dict[str, dict[str, Any]]:
    return load_all()


def container(manifests: dict[str, dict[str, Any]]) -> dict[str, Any]:
    (only,) = manifests["Deployment"]["spec"]["template"]["spec"]["containers"]
    result: dict[str, Any] = only
    return result


def onebit_config(manifests: dict[str, dict[str, Any]]) -> Config:
    return configuration.loads(manifests["ConfigMap"]["data"]["onebit.toml"], "configmap.yaml:onebit.toml")


def test_every_manifest_parses_and_names_its_kind(manifests: dict[str, dict[str, Any]]) -> None:
    assert set(manifests) == {"ConfigMap", "Deployment", "Service", "Ingress"}
    for document in manifests.values():
        assert document["apiVersion"]
        assert document["metadata"]["name"] == "onebit"


def test_the_configmap_holds_a_config_onebitd_accepts_serving_on_every_interface(
    manifests: dict[str, dict[str, Any]],
) -> None:
    config = onebit_config(manifests)
    assert config.server.host == ("0.0.0.0",)  # the kubelet and the Service reach the pod's own address
    mounts = {m["name"]: m["mountPath"] for m in container(manifests)["volumeMounts"]}
    assert config.server.runtime_dir == mounts["runtime"]
    assert container(manifests)["command"] == ["onebitd", "--config", f"{mounts['config']}/onebit.toml"]


def test_readiness_probes_health_on_the_port_onebitd_serves_and_no_liveness_probe_kills_a_drain(
    manifests: dict[str, dict[str, Any]],
) -> None:
    pod = container(manifests)
    ports = {p["name"]: p["containerPort"] for p in pod["ports"]}
    probe = pod["readinessProbe"]["httpGet"]
    assert probe["path"] == "/health"
    assert ports[probe["port"]] == onebit_config(manifests).server.port
    # /health answers 503 while loading and draining: a liveness probe on it would kill the pod.
    assert "livenessProbe" not in pod


def test_prestop_drains_and_the_grace_period_covers_the_drain_and_the_stop(
    manifests: dict[str, dict[str, Any]],
) -> None:
    pod = container(manifests)
    config = onebit_config(manifests)
    command = pod["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["/bin/sh", "-c"]
    words = shlex.split(command[2])
    assert words[:4] == ["sleep", str(ENDPOINTS_S), "&&", "exec"]
    ctl = words[4:]
    assert ctl[:3] == ["onebitctl", "--config", pod["command"][2]]  # the same config, so the same admin socket
    assert ctl[3:5] == ["drain", "--timeout"]
    drain_timeout = float(ctl[5])
    grace = manifests["Deployment"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    # preStop's wait and drain, then SIGTERM: whatever a timed-out drain left gets
    # server.shutdown_grace_s, then the decoder its own stop grace.
    needed = ENDPOINTS_S + drain_timeout + config.server.shutdown_grace_s + config.decoder.health.stop_grace_s
    assert grace > needed


def test_a_rolling_update_starts_the_new_pod_before_it_takes_an_old_one_out(
    manifests: dict[str, dict[str, Any]],
) -> None:
    rolling = manifests["Deployment"]["spec"]["strategy"]["rollingUpdate"]
    assert rolling["maxUnavailable"] == 0
    assert rolling["maxSurge"] >= 1
    assert manifests["Deployment"]["spec"]["replicas"] >= 2


def test_the_service_and_the_ingress_reach_the_pods_on_the_named_port(manifests: dict[str, dict[str, Any]]) -> None:
    labels = manifests["Deployment"]["spec"]["template"]["metadata"]["labels"]
    service = manifests["Service"]["spec"]
    assert service["selector"].items() <= labels.items()
    assert manifests["Deployment"]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (port,) = service["ports"]
    assert port["targetPort"] in {p["name"] for p in container(manifests)["ports"]}
    (rule,) = manifests["Ingress"]["spec"]["rules"]
    (path,) = rule["http"]["paths"]
    assert path["backend"]["service"] == {"name": "onebit", "port": {"name": port["name"]}}


def test_the_ingress_hashes_on_the_conversation_headers_with_bounded_load_and_retries_a_refusal(
    manifests: dict[str, dict[str, Any]],
) -> None:
    annotations = manifests["Ingress"]["metadata"]["annotations"]
    prefix = "nginx.ingress.kubernetes.io/"
    # The two headers config/haproxy.cfg and config/nginx.conf also read (the body is out of its reach).
    assert annotations[prefix + "upstream-hash-by"] == "$http_x_conversation_id$http_x_session_id"
    # Set at all, it selects the bounded-load hash, which spreads an empty key round-robin.
    assert float(annotations[prefix + "upstream-hash-by-balance-factor"]) > 1
    assert set(annotations[prefix + "proxy-next-upstream"].split()) == {"error", "http_503", "non_idempotent"}
    assert annotations[prefix + "proxy-buffering"] == "off"
