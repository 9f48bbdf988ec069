"""The Kubernetes manifests: kustomize renders the base and every overlay (``kubectl kustomize``), every
resource validates against the Kubernetes API schema (``kubernetes-validate``, strict: no unknown
fields), the ConfigMap's TOML and the DaemonSet's flags are ones ``kvstored`` accepts, and the
Service, ServiceMonitor and probes point at ports and commands that exist.

The ServiceMonitor is a Prometheus Operator custom resource, whose schema is not in the Kubernetes API
and could not be fetched here: it is checked for what it must agree with (the Service's labels and
port), not against the operator's CRD schema."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvstore.config import add_arguments, build_config
from tests.conftest import REPO_ROOT

KUBERNETES = REPO_ROOT / "deploy" / "kubernetes"
TARGETS = ["base", "overlays/host-network", "overlays/cpu"]
SCHEMA_VERSION = "1.32.0"  # the kubectl on the CI machine's; the manifests use nothing newer


def _render(target: str) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl is not installed: the manifests cannot be rendered")
    done = subprocess.run([kubectl, "kustomize", str(KUBERNETES / target)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def _one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


@pytest.mark.parametrize("target", TARGETS)
def test_every_resource_validates_against_the_api_schema(target: str) -> None:
    docs = _render(target)
    assert {d["kind"] for d in docs} == {"Namespace", "ServiceAccount", "ConfigMap", "DaemonSet", "Service",
                                         "ServiceMonitor"}
    for doc in docs:
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a custom resource (module doc)
        kubernetes_validate.validate(doc, SCHEMA_VERSION, strict=True)


def test_a_resource_with_a_mistake_fails_the_check() -> None:
    daemonset = _one(_render("base"), "DaemonSet")
    daemonset["spec"]["template"]["spec"]["containers"][0]["portz"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(daemonset, SCHEMA_VERSION, strict=True)


@pytest.mark.parametrize("target", TARGETS)
def test_the_node_accepts_its_configuration_and_flags(target: str, tmp_path: Path) -> None:
    docs = _render(target)
    toml_text = _one(docs, "ConfigMap")["data"]["kvstored.toml"]
    (tmp_path / "kvstored.toml").write_text(toml_text)
    container = _one(docs, "DaemonSet")["spec"]["template"]["spec"]["containers"][0]
    env = {"POD_IP": "10.1.2.3", "NODE_NAME": "gpu-node-7"}
    args = []
    for arg in container["args"]:
        for name, value in env.items():
            arg = arg.replace(f"$({name})", value)
        args.append(arg.replace("/etc/kvstored/kvstored.toml", str(tmp_path / "kvstored.toml")))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = build_config(parser.parse_args(args), environ={})
    assert config.listen == "10.1.2.3:7400" and config.node_id == "gpu-node-7"
    assert config.tls_ca and config.token_file and config.cluster_secret_file  # secured off loopback
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert (ports["data"], ports["metrics"], ports["transport"]) == (config.data_port, config.metrics_port,
                                                                     config.transport_port)
    mounted = {m["mountPath"] for m in container["volumeMounts"]}
    assert Path(config.tls_ca).parent.as_posix() in mounted and config.shm_dir in mounted
    if target == "overlays/cpu":
        assert (config.device, config.transport) == ("cpu", "tcp")
    assert tomllib.loads(toml_text)  # plain TOML too


def test_the_service_monitor_and_probes_point_at_what_exists() -> None:
    docs = _render("base")
    service, monitor = _one(docs, "Service"), _one(docs, "ServiceMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}
    pod = _one(docs, "DaemonSet")["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    probe = pod["spec"]["containers"][0]["readinessProbe"]["exec"]["command"]
    assert probe[:2] == ["sh", "-c"] and probe[2].startswith("exec kvctl health ")
    kvctl = Path(sys.executable).with_name("kvctl")
    words = probe[2].split()[3:]  # the flags after "exec kvctl health"
    help_text = subprocess.run([str(kvctl), "health", "--help"], capture_output=True, text=True, timeout=60).stdout
    for word in words:
        assert word.split("=", 1)[0] in help_text, word
