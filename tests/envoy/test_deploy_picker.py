"""deploy/k8s/picker and deploy/envoy agree with the picker they ship, offline.

The Kubernetes objects pass kubernetes-validate's bundled schemas; the InferencePool (a CRD: no
bundled schema) is checked field by field against the base's vLLM Service and discovery; the
Deployment's command line parses as ``taogate pick``'s; Envoy validates the bootstrap itself.
"""

from __future__ import annotations

import importlib.util
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml

from taogate.cli import app
from tests.conftest import missing
from tests.envoy.stack import BOOTSTRAP, envoy_binary

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
PICKER = K8S / "picker"


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _manifests() -> dict[str, dict[str, Any]]:
    kustomization = yaml.safe_load((PICKER / "kustomization.yaml").read_text())
    files = sorted(kustomization["resources"])
    assert files == sorted(p.name for p in PICKER.glob("*.yaml") if p.name != "kustomization.yaml")
    return {f"{d['kind']}/{d['metadata']['name']}": d for name in files for d in _docs(PICKER / name)}


def test_pool_picker_and_service_agree_with_the_base() -> None:
    m = _manifests()
    pool = m["InferencePool/taogate"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    spec = pool["spec"]
    assert set(spec) == {"selector", "targetPorts", "endpointPickerRef"}
    (vllm,) = _docs(K8S / "vllm-headless.yaml")
    assert spec["selector"]["matchLabels"] == vllm["spec"]["selector"]
    (cm,) = _docs(K8S / "configmap.yaml")
    discovery = tomllib.loads(cm["data"]["config.toml"])["discovery"]
    assert [p["number"] for p in spec["targetPorts"]] == [discovery["port"]]
    ref = spec["endpointPickerRef"]
    assert ref["failureMode"] in ("FailOpen", "FailClose")
    svc = m[f"Service/{ref['name']}"]
    (grpc_port,) = [p for p in svc["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    assert grpc_port["appProtocol"] == "kubernetes.io/h2c"
    deploy = m["Deployment/taogate-picker"]
    pod = deploy["spec"]["template"]
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert deploy["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports[grpc_port["targetPort"]] == ref["port"]["number"]
    # The command is taogate pick's own, on the ports the Service targets, with the base's config.
    command = container["command"]
    assert command[:2] == ["taogate", "pick"]
    pick = typer.main.get_command(app).commands["pick"]  # type: ignore[attr-defined]
    parsed = pick.make_context("pick", list(command[2:])).params
    assert (parsed["port"], parsed["http_port"]) == (ports["grpc"], ports["http"])
    (volume,) = [v for v in pod["spec"]["volumes"] if "configMap" in v]
    assert volume["configMap"]["name"] == cm["metadata"]["name"]
    assert str(parsed["config"]).startswith(
        next(v["mountPath"] for v in container["volumeMounts"] if v["name"] == volume["name"])
    )
    assert {p["grpc"]["service"] for p in (container["readinessProbe"], container["livenessProbe"])} == {
        "readiness",
        "liveness",
    }
    # Picking goes on while the gateway in front stops sending streams, then they get the drain.
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    drain = tomllib.loads(cm["data"]["config.toml"])["gateway"]["shutdown_timeout"]
    assert pod["spec"]["terminationGracePeriodSeconds"] > drain + float(pre_stop[1])
    startup = container["startupProbe"]  # serving starts after the warm-ups' wait (60 s by default)
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 80
    account = m[f"ServiceAccount/{pod['spec']['serviceAccountName']}"]
    assert account["automountServiceAccountToken"] is False
    assert pod["spec"]["automountServiceAccountToken"] is False
    # The image the manifests run carries the picker's packages.
    assert ".[picker]" in (ROOT / "deploy" / "Dockerfile").read_text()


@pytest.mark.parametrize("version", ["1.28", "1.37"])
def test_picker_k8s_schemas(version: str) -> None:
    if importlib.util.find_spec("kubernetes_validate") is None:
        missing("kubernetes-validate", hint="pip install kubernetes-validate")
    import kubernetes_validate

    checked = []
    for key, doc in _manifests().items():
        if doc["apiVersion"].startswith("inference.networking.k8s.io/"):
            continue  # a CRD: checked field by field above
        kubernetes_validate.validate(doc, version, strict=True)
        checked.append(key)
    assert sorted(checked) == [
        "Deployment/taogate-picker",
        "Service/taogate-picker",
        "ServiceAccount/taogate-picker",
    ]


def test_envoy_validates_the_bootstrap() -> None:
    done = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(BOOTSTRAP)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    doc = yaml.safe_load(BOOTSTRAP.read_text())
    hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    ext_proc = hcm["http_filters"][0]["typed_config"]
    assert ext_proc["processing_mode"]["request_body_mode"] == "FULL_DUPLEX_STREAMED"
    assert ext_proc["failure_mode_allow"] is False
    (cluster,) = [c for c in doc["static_resources"]["clusters"] if c["type"] == "ORIGINAL_DST"]
    assert cluster["original_dst_lb_config"]["http_header_name"] == "x-gateway-destination-endpoint"
