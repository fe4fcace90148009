"""deploy/ checked offline: every Kubernetes manifest against the Kubernetes schemas
(`kubernetes-validate`) or, for the custom resources, the schemas of their CRDs vendored in
tests/schemas/; the compose files against the Compose Specification's schema; the alert rules
with `promtool` when it is installed; every PromQL expression (dashboard, alerts, autoscalers)
against the metric names the broker exports; the Dockerfiles against the Makefile's install;
and the invariants of the layout that docs/deploy.md explains (what must be shared for
shared memory to work, which Service publishes what, what the autoscalers scale).

Images are not built and nothing is applied to a cluster here (docs/deploy.md says what that
leaves unverified).

    python -m tests.test_deploy prometheusrule      rewrite deploy/k8s/monitoring/prometheusrule.yaml
                                                    from deploy/prometheus/alerts.yaml
    python -m tests.test_deploy crd FILE.yaml...    rewrite tests/schemas/ from upstream CRDs
    python -m tests.test_deploy compose-spec FILE   rewrite tests/schemas/compose-spec.json
"""
from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
jsonschema = pytest.importorskip("jsonschema")

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
ALERTS = DEPLOY / "prometheus" / "alerts.yaml"
PROMETHEUSRULE = K8S / "monitoring" / "prometheusrule.yaml"
DASHBOARD = DEPLOY / "grafana" / "zmq-infer.json"

# Oldest Kubernetes the manifests are written for (native sidecars, restartPolicy: Always on an
# init container, are on by default from 1.29); they are checked against the newest schemas too.
K8S_MIN_VERSION = "1.30"
NAMESPACE = "zmq-infer"

# ---------------------------------------------------------------------------- the metrics contract
# What the broker exports (docs/deploy.md, "Metrics used here"); everything under deploy/ may
# use these names only.
COUNTERS = {"zmq_infer_requests_total", "zmq_infer_keep_warm_runs_total", "zmq_infer_recalled_total"}
GAUGES = {"zmq_infer_queue_depth", "zmq_infer_in_flight", "zmq_infer_workers",
          "zmq_infer_shm_pool_used_bytes", "zmq_infer_shm_pool_capacity_bytes"}
HISTOGRAMS = {"zmq_infer_queue_wait_seconds", "zmq_infer_request_seconds", "zmq_infer_compute_seconds",
              "zmq_infer_input_seconds", "zmq_infer_output_seconds", "zmq_infer_batch_size"}
SERIES = COUNTERS | GAUGES | {h + s for h in HISTOGRAMS for s in ("_bucket", "_sum", "_count")}
OUTCOMES = {"ok", "cancelled", "deadline_exceeded", "queue_full", "invalid_input", "protocol_error",
            "not_local", "forbidden", "internal", "worker_failed", "service_unavailable"}
METRIC_LABELS = {"service", "outcome", "priority", "host", "worker", "le"}
# Labels a scrape adds to every series: Prometheus itself job and instance; the Prometheus
# Operator's PodMonitor namespace, pod, container and endpoint; a ServiceMonitor those and
# `service` (the Kubernetes Service's name), as the prometheus chart's kubernetes-service-endpoints
# job does.  That `service` collides with the broker's own: with honorLabels false (the default)
# the broker's is renamed exported_service and every query by service finds nothing, so a scrape
# that adds it must honour the target's labels (test_scrapes_keep_the_brokers_labels).
POD_MONITOR_LABELS = {"namespace", "pod", "container", "endpoint", "job", "instance"}
SERVICE_MONITOR_LABELS = POD_MONITOR_LABELS | {"service"}
# `layout` (base or colocated): the PodMonitor's relabeling, which tells the two layouts' brokers
# apart (test_the_two_layouts_are_told_apart).
LAYOUTS = {"zmq-infer-broker": "base", "zmq-infer-colocated": "colocated"}
TARGET_LABELS = SERVICE_MONITOR_LABELS | {"layout"}


def family(series: str) -> str:
    for s in ("_bucket", "_sum", "_count"):
        if series.endswith(s) and series[: -len(s)] in HISTOGRAMS:
            return series[: -len(s)]
    return series


def test_the_broker_exports_the_contract_metrics():
    """The names above are the ones broker/metrics.py writes (a counter family is exported with
    _total), so a renamed metric fails here rather than as an empty panel."""
    source = (ROOT / "broker" / "metrics.py").read_text()
    declared = set(re.findall(r'"(zmq_infer_\w+)"', source))
    missing = sorted(f for f in COUNTERS | GAUGES | HISTOGRAMS
                     if f not in declared and not (f.endswith("_total") and f[: -len("_total")] in declared))
    assert not missing, f"deploy/ uses metrics that broker/metrics.py does not export: {missing}"


def _argparse_flags(module: str) -> set[str]:
    return set(re.findall(r'add_argument\(\s*"(--[\w-]+)"', (ROOT / module / "__main__.py").read_text()))


def test_deploy_files_use_only_flags_the_processes_take():
    broker, worker = _argparse_flags("broker"), _argparse_flags("gpu_worker")
    used = []  # (process, flag, where)
    for path, d in manifests():
        if d["kind"] != "Deployment":
            continue
        for c in all_containers(d["spec"]["template"]["spec"]):
            if c["name"] in ("keys", "app"):
                continue
            proc = "gpu_worker" if c.get("command", [])[-1:] == ["gpu_worker"] else "broker"
            used += [(proc, f, f"{path.name} {c['name']}") for f in flags(c)]
    for name in ("compose.yaml", "compose.cuda.yaml"):
        for svc, v in compose(name)["services"].items():
            proc = {"zmq-infer": "broker", "workers": "gpu_worker"}.get(svc)
            if proc:
                used += [(proc, a, f"{name} {svc}") for a in v.get("command", []) if a.startswith("--")]
    assert used
    for proc, flag, where in used:
        assert flag in (broker if proc == "broker" else worker), f"{where}: python -m {proc} has no {flag}"


# ------------------------------------------------------------------------------------- PromQL
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
             "unless", "offset", "inf", "nan"}
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_MATCHERS = re.compile(r"\{([^}]*)\}")
_MATCHER = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')


def _untemplated(expr: str) -> str:
    """PromQL with Grafana variables and prometheus-adapter templates made neutral."""
    expr = re.sub(r"<<\.LabelMatchers>>", 'namespace="x"', expr)
    expr = re.sub(r"<<\.Series>>", "zmq_infer_queue_wait_seconds_bucket", expr)
    expr = re.sub(r"<<\.GroupBy>>", "namespace", expr)
    expr = expr.replace("$__rate_interval", "1m").replace("$__interval", "1m").replace("$__range", "1h")
    return re.sub(r"\$\{?(\w+)\}?", r"\1", expr)


def promql_metric_names(expr: str) -> set[str]:
    """The metric names an expression selects (not functions, keywords, labels or durations)."""
    e = _STRINGS.sub('""', _untemplated(expr))
    e = _MATCHERS.sub("", e)
    e = re.sub(r"\[[^\]]*\]", "", e)
    e = _GROUPING.sub("", e)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", e):
        word, before = m.group(0), e[m.start() - 1] if m.start() else " "
        if before.isdigit() or before == ".":
            continue  # the exponent of 1e3, a duration's unit
        if e[m.end():].lstrip().startswith("(") or word.lower() in _KEYWORDS:
            continue
        names.add(word)
    return names


def promql_labels(expr: str) -> dict[str, set[str]]:
    """Label names an expression matches on or groups by, each with the literal values it matches
    (alternatives of a regular expression split at |)."""
    e = _untemplated(expr)
    out: dict[str, set[str]] = {}
    for body in _MATCHERS.findall(e):
        for name, _op, value in _MATCHER.findall(body):
            out.setdefault(name, set()).update(v for v in value.split("|") if v)
    for _kw, names in _GROUPING.findall(_STRINGS.sub('""', e)):
        for n in names.split(","):
            if n.strip():
                out.setdefault(n.strip(), set())
    return out


def check_promql(expr: str, where: str) -> None:
    names = promql_metric_names(expr)
    assert names, f"{where}: no metric in {expr!r}"
    unknown = names - SERIES - {"up"}
    assert not unknown, f"{where}: {sorted(unknown)} are not metrics the broker exports: {expr!r}"
    for label, values in promql_labels(expr).items():
        assert label in METRIC_LABELS | TARGET_LABELS, f"{where}: unknown label {label!r} in {expr!r}"
        if label == "outcome":
            assert values <= OUTCOMES, f"{where}: outcomes {sorted(values - OUTCOMES)} do not exist"


def test_the_promql_checker_can_fail():
    assert promql_metric_names(
        'histogram_quantile(0.99, sum by (service, le) (rate(zmq_infer_queue_wait_seconds_bucket'
        '{service=~"$service"}[$__rate_interval]))) > 1e-3 or vector(0)') == {"zmq_infer_queue_wait_seconds_bucket"}
    with pytest.raises(AssertionError, match="zmq_infer_queue_wait_bucket"):
        check_promql("rate(zmq_infer_queue_wait_bucket[5m])", "test")
    with pytest.raises(AssertionError, match="do not exist"):
        check_promql('rate(zmq_infer_requests_total{outcome="timeout"}[5m])', "test")
    with pytest.raises(AssertionError, match="unknown label"):
        check_promql("sum by (model) (zmq_infer_in_flight)", "test")


# ------------------------------------------------------------------------------ YAML and schemas
def load_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def manifest_files() -> list[Path]:
    return sorted(p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml")


def manifests() -> list[tuple[Path, dict]]:
    return [(p, d) for p in manifest_files() for d in load_docs(p)]


def objects(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for _p, d in manifests() if d["kind"] == kind}


def crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> JSON schema, for every vendored CRD schema."""
    out = {}
    for p in sorted(SCHEMAS.glob("crd-*.json")):
        s = json.loads(p.read_text())
        out[(s["properties"]["apiVersion"]["const"], s["properties"]["kind"]["const"])] = s
    return out


def validate_manifest(doc: dict, version: str = K8S_MIN_VERSION) -> None:
    """Raise if `doc` is not a valid object: its CRD's schema, or Kubernetes' own (strict: an
    unknown field is an error, as with kubectl's server-side strict field validation)."""
    crd = crd_schemas().get((doc.get("apiVersion"), doc.get("kind")))
    if crd is not None:
        jsonschema.Draft202012Validator(crd).validate(doc)
        return
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (the dev extra)")
    kv.validate(doc, version, strict=True)


@pytest.fixture(scope="module")
def k8s_versions():
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (the dev extra)")
    from kubernetes_validate.utils import latest_version

    return sorted({K8S_MIN_VERSION, latest_version()})


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: str(p.relative_to(K8S)))
def test_every_manifest_validates(path, k8s_versions):
    docs = load_docs(path)
    assert docs, f"{path}: no object"
    for doc in docs:
        for version in k8s_versions:
            try:
                validate_manifest(doc, version)
            except Exception as e:  # name the object and the field
                pytest.fail(f"{path.relative_to(ROOT)}: {doc['kind']}/{doc['metadata'].get('name')} "
                            f"(Kubernetes {version}): {getattr(e, 'message', e)} at "
                            f"{'.'.join(map(str, getattr(e, 'absolute_path', [])))}")
        assert doc["metadata"].get("namespace") == NAMESPACE or doc["kind"] == "Namespace", \
            f"{path}: {doc['kind']}/{doc['metadata']['name']} is not in the namespace {NAMESPACE}"


def test_the_validators_reject_broken_manifests():
    deployment = copy.deepcopy(objects("Deployment")["zmq-infer-workers"])
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(Exception, match="imagePullPolicyy"):
        validate_manifest(deployment)
    so = copy.deepcopy(objects("ScaledObject")["zmq-infer-workers"])
    so["spec"]["minReplicas"] = 1  # KEDA's field is minReplicaCount
    with pytest.raises(jsonschema.ValidationError, match="minReplicas"):
        validate_manifest(so)
    del so["spec"]["minReplicas"]
    so["spec"]["triggers"][0]["metadataa"] = so["spec"]["triggers"][0].pop("metadata")
    with pytest.raises(jsonschema.ValidationError, match="metadata"):
        validate_manifest(so)
    pm = copy.deepcopy(objects("PodMonitor")["zmq-infer"])
    pm["spec"]["podMetricsEndpoints"][0]["prot"] = "http"
    with pytest.raises(jsonschema.ValidationError, match="prot"):
        validate_manifest(pm)
    sm = copy.deepcopy(objects("ServiceMonitor")["zmq-infer"])
    sm["spec"]["endpoints"][0]["honourLabels"] = True
    with pytest.raises(jsonschema.ValidationError, match="honourLabels"):
        validate_manifest(sm)
    rule = copy.deepcopy(objects("PrometheusRule")["zmq-infer"])
    rule["spec"]["groups"][0]["rules"][0]["for"] = "ten minutes"
    with pytest.raises(jsonschema.ValidationError, match="ten minutes"):
        validate_manifest(rule)


def _prom_label(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", name)


def scrape_added_labels(doc: dict) -> list[tuple[dict, set[str]]]:
    """(endpoint, the labels a scrape through it adds to every series) for a PodMonitor or a
    ServiceMonitor: the operator's own, its relabelings' targets, and the pod's (and the
    Service's) labels it copies (podTargetLabels, targetLabels)."""
    spec = doc["spec"]
    kind = doc["kind"]
    base = SERVICE_MONITOR_LABELS if kind == "ServiceMonitor" else POD_MONITOR_LABELS
    copied = {_prom_label(n) for n in spec.get("podTargetLabels", []) + spec.get("targetLabels", [])}
    endpoints = spec["endpoints"] if kind == "ServiceMonitor" else spec["podMetricsEndpoints"]
    out = []
    for e in endpoints:
        relabelled = {r["targetLabel"] for r in e.get("relabelings", []) if "targetLabel" in r}
        out.append((e, base | copied | relabelled))
    return out


def check_scrape_keeps_labels(doc: dict) -> None:
    for e, added in scrape_added_labels(doc):
        clash = added & METRIC_LABELS
        assert not clash or e.get("honorLabels") is True, (
            f"{doc['kind']}/{doc['metadata']['name']}: the scrape adds {sorted(clash)}, labels the broker writes "
            f"itself; without honorLabels: true Prometheus renames the broker's (exported_{sorted(clash)[0]})")


def test_scrapes_keep_the_brokers_labels():
    """A shipped PodMonitor or ServiceMonitor either adds no label the broker writes, or honours
    the broker's (honorLabels: true).  A PodMonitor adds no `service`; a ServiceMonitor does."""
    monitors = [d for _p, d in manifests() if d["kind"] in ("PodMonitor", "ServiceMonitor")]
    assert monitors
    for d in monitors:
        check_scrape_keeps_labels(d)
    sm = {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor", "metadata": {"name": "zmq-infer"},
          "spec": {"selector": {"matchLabels": {"app.kubernetes.io/component": "metrics"}},
                   "endpoints": [{"port": "http", "path": "/metrics"}]}}
    with pytest.raises(AssertionError, match="exported_service"):
        check_scrape_keeps_labels(sm)
    sm["spec"]["endpoints"][0]["honorLabels"] = True
    check_scrape_keeps_labels(sm)
    pm = copy.deepcopy(objects("PodMonitor")["zmq-infer"])
    pm["spec"]["podTargetLabels"] = ["service"]  # a pod label named `service`, copied: the same clash
    with pytest.raises(AssertionError, match="exported_service"):
        check_scrape_keeps_labels(pm)
    docs = (ROOT / "docs" / "deploy.md").read_text()
    assert "honorLabels: true" in docs and "honor_labels: true" in docs
    metrics_service = (K8S / "base" / "zmq-infer.yaml").read_text()
    assert "honorLabels: true" in metrics_service and "honor_labels: true" in metrics_service


def test_every_custom_resource_has_a_vendored_schema():
    core = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (the dev extra)")
    crds = crd_schemas()
    assert {k for _v, k in crds} == {"ScaledObject", "PodMonitor", "ServiceMonitor", "PrometheusRule"}
    for path, doc in manifests():
        if (doc["apiVersion"], doc["kind"]) in crds:
            continue
        core.validate(doc, K8S_MIN_VERSION)  # SchemaNotFoundError for a custom resource without one


def kustomization(directory: Path) -> dict:
    return yaml.safe_load((directory / "kustomization.yaml").read_text())


def test_every_manifest_is_in_a_kustomization():
    listed = set()
    for k in K8S.rglob("kustomization.yaml"):
        for r in kustomization(k.parent).get("resources", []):
            target = (k.parent / r).resolve()
            assert target.exists(), f"{k}: {r} does not exist"
            listed.add(target)
            if target.is_dir():
                assert (target / "kustomization.yaml").exists(), f"{k}: {r} is not a kustomization"
    assert {p.resolve() for p in manifest_files()} <= listed
    assert kustomization(K8S)["resources"] == ["base", "monitoring", "keda"]  # never keda and hpa together


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not on PATH (kubectl kustomize builds the overlays)")
@pytest.mark.parametrize("overlay", [".", "base", "monitoring", "servicemonitor", "keda", "hpa", "colocated"])
def test_kustomize_builds(overlay):
    out = subprocess.run(["kubectl", "kustomize", str(K8S / overlay)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert docs
    for d in docs:
        validate_manifest(d)
        assert d["metadata"].get("namespace", NAMESPACE) == NAMESPACE
    # the PodMonitor or the ServiceMonitor, never both: every series would be scraped twice
    assert not {"PodMonitor", "ServiceMonitor"} <= {d["kind"] for d in docs}, overlay


# ------------------------------------------------------------------------------ the pod layout
def pod_spec(deployment: str) -> dict:
    return objects("Deployment")[deployment]["spec"]["template"]["spec"]


def all_containers(spec: dict) -> list[dict]:
    return spec.get("initContainers", []) + spec["containers"]


def container(spec: dict, name: str) -> dict:
    return next(c for c in all_containers(spec) if c["name"] == name)


def flags(c: dict) -> dict[str, str]:
    """The --name=value arguments of a container."""
    out = {}
    for a in c.get("args", []):
        if a.startswith("--"):
            k, _, v = a.partition("=")
            out[k] = v
    return out


def mounts(c: dict, spec: dict) -> dict[str, dict]:
    vols = {v["name"]: v for v in spec.get("volumes", [])}
    return {m["mountPath"]: vols[m["name"]] for m in c.get("volumeMounts", [])}


def env(c: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in c.get("env", [])}


def test_colocated_pod_shares_what_shared_memory_needs():
    spec = pod_spec("zmq-infer-colocated")
    assert spec.get("shareProcessNamespace") is True
    assert not (spec.get("hostPID") or spec.get("hostIPC") or spec.get("hostNetwork"))
    cs = all_containers(spec)
    assert {c["name"] for c in cs} == {"broker", "worker", "app"}
    uid = spec["securityContext"]["runAsUser"]
    for c in cs:
        m = mounts(c, spec)
        for path in ("/dev/shm", "/run/zmq-infer"):
            assert m[path]["emptyDir"]["medium"] == "Memory", f"{c['name']}: {path}"
        assert m["/dev/shm"]["name"] == mounts(cs[0], spec)["/dev/shm"]["name"], "one /dev/shm for all"
        assert env(c)["XDG_RUNTIME_DIR"] == "/run/zmq-infer", f"{c['name']}: the runtime directory"
        assert c.get("securityContext", {}).get("runAsUser", uid) == uid, f"{c['name']}: one uid for all"
    broker, worker = flags(container(spec, "broker")), flags(container(spec, "worker"))
    assert broker["--frontend"].startswith("ipc:///run/zmq-infer/")
    assert worker["--broker"] == broker["--backend"].strip() and broker["--backend"].startswith("ipc:///run/zmq-infer/")
    assert broker["--frontend"] in container(spec, "app")["args"][0]
    # the sidecars start broker first, then the worker, then the application
    assert [c["name"] for c in spec["initContainers"]] == ["broker", "worker"]
    assert all(c.get("restartPolicy") == "Always" for c in spec["initContainers"])


def test_network_layout_broker_workers_and_services():
    broker_spec, worker_spec = pod_spec("zmq-infer-broker"), pod_spec("zmq-infer-workers")
    broker, worker = container(broker_spec, "broker"), container(worker_spec, "worker")
    bf, wf = flags(broker), flags(worker)
    services = objects("Service")
    deployments = objects("Deployment")
    # workers reach the broker through the backend Service, which must publish a broker that
    # is not ready yet: it becomes ready only once a worker registered through it.
    host, port = re.fullmatch(r"tcp://([\w.-]+):(\d+)", wf["--broker"]).groups()
    backend = services[host.split(".")[0]]
    assert backend["spec"].get("publishNotReadyAddresses") is True
    assert int(port) in {p["port"] for p in backend["spec"]["ports"]}
    assert not services["zmq-infer-frontend"]["spec"].get("publishNotReadyAddresses")
    assert bf["--frontend"].startswith("tcp://0.0.0.0:") and bf["--backend"].startswith("tcp://0.0.0.0:")
    assert {"--curve-secret", "--client-keys", "--worker-keys"} <= set(bf), "tcp endpoints need CurveZMQ"
    assert {"--server-key", "--worker-key"} <= set(wf)
    assert "--insecure" not in bf and "--insecure" not in wf
    # every Service selects a pod template and targets one of its named ports
    for name, svc in services.items():
        sel = svc["spec"]["selector"]
        pods = [d for d in deployments.values()
                if sel.items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert pods, f"Service {name} selects no pod"
        for p in svc["spec"]["ports"]:
            names = {cp["name"]: cp["containerPort"] for d in pods for c in all_containers(d["spec"]["template"]["spec"])
                     for cp in c.get("ports", [])}
            assert p["targetPort"] in names, f"Service {name}: no container port {p['targetPort']}"
    http = {cp["name"]: cp["containerPort"] for cp in broker["ports"]}
    assert bf["--http"] == f"0.0.0.0:{http['http']}"
    assert bf["--frontend"].endswith(f":{http['frontend']}") and bf["--backend"].endswith(f":{http['backend']}")
    # the scaled Deployment holds workers only, and no replica count the autoscaler would fight
    assert [c["name"] for c in worker_spec["containers"]] == ["worker"]
    assert "replicas" not in deployments["zmq-infer-workers"]["spec"]
    assert deployments["zmq-infer-broker"]["spec"]["replicas"] == 1
    assert deployments["zmq-infer-broker"]["spec"]["strategy"]["type"] == "Recreate"
    assert deployments["zmq-infer-workers"]["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def test_probes_use_the_health_paths():
    for name in ("zmq-infer-broker", "zmq-infer-workers", "zmq-infer-colocated"):
        spec = pod_spec(name)
        for c in all_containers(spec):
            if c["name"] in ("keys", "app"):
                continue
            ports = {p["name"]: p["containerPort"] for p in c["ports"]}
            role = "broker" if c["name"] == "broker" else "worker"
            assert c["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
            if role == "broker":
                assert c["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
                assert flags(c)["--http"] == f"0.0.0.0:{ports[c['livenessProbe']['httpGet']['port']]}"
            else:
                assert flags(c)["--health-port"] == f"0.0.0.0:{ports[c['livenessProbe']['httpGet']['port']]}"
                assert c["startupProbe"]["httpGet"]["path"] == "/v2/health/live"
                assert c["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"


def test_pods_meet_the_restricted_pod_security_standard():
    ns = objects("Namespace")[NAMESPACE]
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for name, d in objects("Deployment").items():
        spec = d["spec"]["template"]["spec"]
        psc = spec["securityContext"]
        assert psc["runAsNonRoot"] is True and psc["runAsUser"] != 0, name
        assert psc["seccompProfile"]["type"] == "RuntimeDefault", name
        assert not (spec.get("hostPID") or spec.get("hostIPC") or spec.get("hostNetwork")), name
        for v in spec["volumes"]:
            assert set(v) - {"name"} <= {"emptyDir", "secret", "configMap", "projected"}, f"{name}: {v}"
        for c in all_containers(spec):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"], c["name"]
            assert not sc.get("capabilities", {}).get("add"), c["name"]
            r = c["resources"]
            assert {"cpu", "memory"} <= set(r["requests"]) and {"cpu", "memory"} <= set(r["limits"]), c["name"]


def test_the_autoscalers_scale_the_workers_alike():
    so = objects("ScaledObject")["zmq-infer-workers"]["spec"]
    hpa = objects("HorizontalPodAutoscaler")["zmq-infer-workers"]["spec"]
    target = {"apiVersion": "apps/v1", "kind": "Deployment", "name": "zmq-infer-workers"}
    assert so["scaleTargetRef"] == target and hpa["scaleTargetRef"] == target
    assert so["minReplicaCount"] == hpa["minReplicas"] >= 1
    assert so["maxReplicaCount"] == hpa["maxReplicas"]
    assert so["advanced"]["horizontalPodAutoscalerConfig"]["behavior"] == hpa["behavior"]
    model = flags(container(pod_spec("zmq-infer-workers"), "worker"))["--model"]
    triggers = {t["name"]: t for t in so["triggers"]}
    assert set(triggers) == {"load", "queue-wait"}
    for t in triggers.values():
        assert t["type"] == "prometheus"
        q = t["metadata"]["query"]
        check_promql(q, f"ScaledObject trigger {t['name']}")
        labels = promql_labels(q)
        assert labels["service"] == {model} and labels["namespace"] == {NAMESPACE}, q
        assert labels["layout"] == {LAYOUTS["zmq-infer-broker"]}, f"{q}: not scoped to the base broker's layout"
    assert "zmq_infer_queue_wait_seconds_bucket" in promql_metric_names(triggers["queue-wait"]["metadata"]["query"])
    metrics = {m["external"]["metric"]["name"]: m["external"] for m in hpa["metrics"]}
    assert set(metrics) == {"zmq_infer_load", "zmq_infer_queue_wait_p99_seconds"}
    for m in metrics.values():
        assert m["metric"]["selector"]["matchLabels"] == {"service": model, "layout": LAYOUTS["zmq-infer-broker"]}
    # the same targets: KEDA's threshold is the HPA's target
    assert triggers["load"]["metricType"] == metrics["zmq_infer_load"]["target"]["type"] == "AverageValue"
    assert float(triggers["load"]["metadata"]["threshold"]) == float(metrics["zmq_infer_load"]["target"]["averageValue"])
    wait = metrics["zmq_infer_queue_wait_p99_seconds"]["target"]
    assert triggers["queue-wait"]["metricType"] == wait["type"] == "Value"
    assert float(triggers["queue-wait"]["metadata"]["threshold"]) == _quantity(wait["value"])
    # the adapter serves exactly the HPA's metrics, from contract metrics
    adapter = yaml.safe_load((DEPLOY / "prometheus" / "adapter-rules.yaml").read_text())["rules"]["external"]
    assert {r["name"]["as"] for r in adapter} == set(metrics)
    for r in adapter:
        check_promql(r["metricsQuery"], f"adapter rule {r['name']['as']}")
        assert promql_metric_names(r["seriesQuery"]) <= SERIES


def _quantity(q: str) -> float:
    m = re.fullmatch(r"([0-9.]+)(m|k|M|G)?", str(q))
    assert m, q
    return float(m.group(1)) * {None: 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9}[m.group(2)]


def test_the_podmonitor_scrapes_every_broker():
    pm = objects("PodMonitor")["zmq-infer"]["spec"]
    sel = pm["selector"]
    endpoints = pm["podMetricsEndpoints"]
    assert [e["path"] for e in endpoints] == ["/metrics"]
    scraped = []
    for name, d in objects("Deployment").items():
        labels = d["spec"]["template"]["metadata"]["labels"]
        match = sel["matchLabels"].items() <= labels.items() and all(
            labels.get(e["key"]) in e["values"] for e in sel.get("matchExpressions", []))
        has_broker = any(c["name"] == "broker" for c in all_containers(d["spec"]["template"]["spec"]))
        assert match == has_broker, f"{name}: scraped={match}, runs a broker={has_broker}"
        if match:
            broker = container(d["spec"]["template"]["spec"], "broker")
            assert endpoints[0]["port"] in {p["name"] for p in broker["ports"]}
            scraped.append(name)
    assert sorted(scraped) == ["zmq-infer-broker", "zmq-infer-colocated"]


def test_the_servicemonitor_scrapes_the_base_broker_through_its_service():
    """deploy/k8s/servicemonitor (docs/deploy.md, "Scraping through a Service"): the
    alternative to the PodMonitor for a Prometheus that selects ServiceMonitors.  It selects
    the zmq-infer-metrics Service alone, which selects the base broker's pod and names the
    port it scrapes; it keeps the broker's labels (honorLabels) and labels the series
    `layout: base`; it is applied on its own, never with the PodMonitor; the docs show it."""
    sm = objects("ServiceMonitor")["zmq-infer"]
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics" and endpoint.get("honorLabels") is True
    services = objects("Service")
    selected = [name for name, svc in services.items()
                if sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"].get("labels", {}).items()]
    assert selected == ["zmq-infer-metrics"], selected
    svc = services["zmq-infer-metrics"]["spec"]
    assert endpoint["port"] in {p["name"] for p in svc["ports"]}
    pods = {name: d["spec"]["template"]["metadata"]["labels"] for name, d in objects("Deployment").items()}
    assert [name for name, labels in pods.items() if svc["selector"].items() <= labels.items()] == ["zmq-infer-broker"]
    assert LAYOUTS["zmq-infer-broker"] == "base"
    layout = [r for r in endpoint["relabelings"] if r.get("targetLabel") == "layout"]
    assert layout == [{"targetLabel": "layout", "replacement": "base"}], layout  # no source: always base
    # applied alone: in no kustomization with the PodMonitor (test_kustomize_builds builds them)
    assert "servicemonitor" not in kustomization(K8S)["resources"]
    assert kustomization(K8S / "servicemonitor")["resources"] == ["servicemonitor.yaml"]
    # the docs' copy is the shipped one
    doc = (ROOT / "docs" / "deploy.md").read_text()
    section = doc.split("### Scraping through a Service", 1)[1].split("\n## ", 1)[0]
    (shown,) = [d for d in (yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", section, re.S))
                if d.get("kind") == "ServiceMonitor"]
    assert shown["spec"] == sm["spec"], "docs/deploy.md shows another ServiceMonitor than deploy/k8s/servicemonitor"


def relabelled_layout(pod_labels: dict) -> str | None:
    """The `layout` label the PodMonitor's relabelings give a pod with these labels (rules of
    action replace, one source label: what the shipped rules are)."""
    (endpoint,) = objects("PodMonitor")["zmq-infer"]["spec"]["podMetricsEndpoints"]
    out = None
    for r in endpoint.get("relabelings", []):
        if r.get("targetLabel") != "layout":
            continue
        assert r.get("action", "replace") == "replace" and len(r["sourceLabels"]) == 1, r
        source = r["sourceLabels"][0]
        prefix = "__meta_kubernetes_pod_label_"
        assert source.startswith(prefix), r
        value = next((v for k, v in pod_labels.items() if _prom_label(k) == source[len(prefix):]), "")
        m = re.fullmatch(r.get("regex", "(.*)"), value)
        if m:
            out = m.expand(r.get("replacement", "$1").replace("$", "\\"))
    return out


def test_the_two_layouts_are_told_apart():
    """base/ and colocated/ serve the same service in one namespace, and the PodMonitor scrapes
    both kinds of broker: each gets its own `layout`, and everything that sums by service
    (the autoscalers of the base workers, the adapter's series, every alert, the dashboard)
    keeps the two apart.  Summed together, the colocated pods' load scaled the base workers,
    which cannot relieve it, and one layout's live workers hid the other's dead ones."""
    deployments = objects("Deployment")
    got = {name: relabelled_layout(deployments[name]["spec"]["template"]["metadata"]["labels"]) for name in LAYOUTS}
    assert got == LAYOUTS
    assert relabelled_layout(deployments["zmq-infer-workers"]["spec"]["template"]["metadata"]["labels"]) is None
    # the scaled workers serve the broker the backend Service selects: the base layout's
    backend = objects("Service")["zmq-infer-backend"]["spec"]["selector"]
    assert backend.items() <= deployments["zmq-infer-broker"]["spec"]["template"]["metadata"]["labels"].items()
    adapter = yaml.safe_load((DEPLOY / "prometheus" / "adapter-rules.yaml").read_text())["rules"]["external"]
    for r in adapter:
        assert "layout" in promql_labels(r["seriesQuery"]), r["seriesQuery"]
    # every alert groups by layout wherever it groups: by service, or by broker (`pod`, which
    # ZmqInferNoLiveWorker joins with `up`: each colocated replica is a broker of its own)
    for g in alert_groups():
        for r in g["rules"]:
            groupings = _GROUPING.findall(_STRINGS.sub('""', r["expr"]))
            assert groupings, r["alert"]
            for _kw, names in groupings:
                names = {n.strip() for n in names.split(",")}
                assert {"namespace", "layout"} <= names and names & {"service", "pod"}, (r["alert"], names)
    no_worker = next(r["expr"] for g in alert_groups() for r in g["rules"] if r["alert"] == "ZmqInferNoLiveWorker")
    assert "sum by (namespace, layout, pod, service) (zmq_infer_workers) == 0" in no_worker
    # the promtool cases include one with both layouts in one namespace, and one with a dead
    # worker in one colocated replica among live ones
    cases = (DEPLOY / "prometheus" / "alerts.test.yaml").read_text()
    assert 'layout="colocated"' in cases and "layout: base" in cases
    assert "layout: colocated, pod: zmq-infer-colocated-1" in cases
    # the dashboard: a layout variable, and every query filtered by it
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    assert variables["layout"]["query"]["query"] == "label_values(zmq_infer_requests_total, layout)"
    assert variables["layout"]["allValue"] == ".*"  # All also matches series without the label
    for p in dashboard_panels():
        for t in p.get("targets", []):
            assert t["expr"].count('layout=~"$layout"') == t["expr"].count('service=~"$service"'), p["title"]
    assert "Two layouts in one namespace" in (ROOT / "docs" / "deploy.md").read_text()


# ---------------------------------------------------------------------------------- alert rules
def alert_groups() -> list[dict]:
    return yaml.safe_load(ALERTS.read_text())["groups"]


def test_alert_rules_use_contract_metrics_and_say_what_to_do():
    rules = {r["alert"]: r for g in alert_groups() for r in g["rules"]}
    assert set(rules) == {"ZmqInferQueueWaitHigh", "ZmqInferNoLiveWorker", "ZmqInferErrorRateHigh"}
    headings = {m.strip() for doc in ("operations.md", "deploy.md", "security.md")
                for m in re.findall(r"^#+ (.+)$", (ROOT / "docs" / doc).read_text(), re.M)}
    for name, r in rules.items():
        check_promql(r["expr"], name)
        assert re.fullmatch(r"\d+[smh]", r["for"]), name
        assert r["labels"]["severity"] in {"warning", "critical"}
        a = r["annotations"]
        assert {"summary", "description", "runbook"} <= set(a), name
        assert "docs/operations.md" in a["runbook"], name
        for section in re.findall(r'"([^"]+)"', a["runbook"]):
            assert section in headings, f"{name}: the runbook names a section {section!r} that docs/ lacks"


def test_the_prometheusrule_holds_the_alert_rules():
    rule = objects("PrometheusRule")["zmq-infer"]
    assert rule["spec"]["groups"] == alert_groups(), \
        "deploy/k8s/monitoring/prometheusrule.yaml is out of date: run python -m tests.test_deploy prometheusrule"


PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not on PATH (Debian: apt-get install prometheus); the rules' metric "
                             "names are still checked by test_alert_rules_use_contract_metrics_and_say_what_to_do")


@needs_promtool
def test_promtool_check_rules():
    out = subprocess.run([PROMTOOL, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stdout + out.stderr


@needs_promtool
def test_promtool_unit_tests_of_the_alerts(tmp_path):
    """deploy/prometheus/alerts.test.yaml: what fires and what does not.  promtool compares
    annotations too, which these cases do not pin, so they run against a copy without them."""
    groups = copy.deepcopy(alert_groups())
    for g in groups:
        for r in g["rules"]:
            r.pop("annotations", None)
    (tmp_path / "alerts.yaml").write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    shutil.copy(DEPLOY / "prometheus" / "alerts.test.yaml", tmp_path / "alerts.test.yaml")
    out = subprocess.run([PROMTOOL, "test", "rules", "alerts.test.yaml"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def every_promql() -> list[tuple[str, str]]:
    out = [(f"alert {r['alert']}", r["expr"]) for g in alert_groups() for r in g["rules"]]
    out += [(f"KEDA {t['name']}", t["metadata"]["query"]) for t in objects("ScaledObject")["zmq-infer-workers"]["spec"]["triggers"]]
    out += [(f"adapter {r['name']['as']}", r["metricsQuery"])
            for r in yaml.safe_load((DEPLOY / "prometheus" / "adapter-rules.yaml").read_text())["rules"]["external"]]
    out += [(f"panel {p['title']!r}", t["expr"]) for p in dashboard_panels() for t in p.get("targets", [])]
    return out


@needs_promtool
def test_every_promql_expression_parses(tmp_path):
    """Dashboard, autoscaler and adapter queries (variables and templates filled in) parse: as
    recording rules, `promtool check rules` parses each one."""
    rules = [{"record": f"zmq_infer:check:{i}", "expr": _untemplated(e)} for i, (_w, e) in enumerate(every_promql())]
    f = tmp_path / "all.yaml"
    f.write_text(yaml.safe_dump({"groups": [{"name": "parse", "rules": rules}]}))
    out = subprocess.run([PROMTOOL, "check", "rules", str(f)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stdout + out.stderr


# ------------------------------------------------------------------------------------ dashboard
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_panels() -> list[dict]:
    out = []
    for p in dashboard()["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def test_dashboard_variables_and_queries():
    d = dashboard()
    assert d["schemaVersion"] >= 39 and d["uid"] == "zmq-infer"
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    svc = variables["service"]
    assert svc["type"] == "query" and svc["datasource"]["uid"] == "${datasource}"
    assert re.fullmatch(r"label_values\((\w+), service\)", svc["query"]["query"]).group(1) in SERIES
    families = set()
    ids = set()
    for p in dashboard_panels():
        assert p["id"] not in ids, f"panel id {p['id']} twice"
        ids.add(p["id"])
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            check_promql(t["expr"], f"panel {p['title']!r}")
            assert 'service=~"$service"' in t["expr"], f"panel {p['title']!r}: not filtered by $service"
            families |= {family(n) for n in promql_metric_names(t["expr"])}
    assert families == COUNTERS | GAUGES | HISTOGRAMS, f"metrics without a panel: {sorted(COUNTERS | GAUGES | HISTOGRAMS - families)}"
    titles = " | ".join(p["title"] for p in dashboard_panels()).lower()
    for want in ("latency", "queue wait", "queue depth", "in flight", "batch size", "outcome", "error rate",
                 "compute", "workers", "shared-memory"):
        assert want in titles, f"no panel about {want}"
    quantiles = {m for p in dashboard_panels() for t in p.get("targets", [])
                 for m in re.findall(r"histogram_quantile\((0\.\d+),.*?rate\((zmq_infer_(?:request|queue_wait)_seconds)_bucket", t["expr"])}
    assert {(q, m) for q in ("0.5", "0.9", "0.99") for m in ("zmq_infer_request_seconds", "zmq_infer_queue_wait_seconds")} <= quantiles


# ------------------------------------------------------------------------------- images and compose
def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _makefile_install() -> tuple[set[str], str]:
    text = (ROOT / "Makefile").read_text()
    m = re.search(r"pip install\b[^\n]*?'?\.\[([\w,]+)\]'?", text)
    assert m, "the Makefile's `pip install -e '.[...]'` line"
    return set(m.group(1).split(",")), text


def dockerfile(name: str) -> str:
    # one logical line per instruction: join continuations
    return re.sub(r"\\\n", " ", (DEPLOY / name).read_text())


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_dockerfiles_install_as_the_makefile_does(name):
    text = dockerfile(name)
    project = pyproject()
    torch_pin = next(r for r in project["project"]["optional-dependencies"]["torch"] if r.startswith("torch"))
    make_extras, make_text = _makefile_install()
    # the Makefile's steps: upgrade pip, then the project with its extras (the image: no dev/bench)
    assert re.search(r"pip install -q --upgrade pip", make_text) and re.search(r"pip install -q --upgrade pip", text)
    install = re.search(r"pip install\b[^\n]*?(\S*\.\[([^\]]+)\]\S*)([^\n]*)", text)
    assert install, f"{name}: no `pip install .[...]` of the project"
    # both take their extras as a build argument (torch by default; torch,otel for traces:
    # docs/deploy.md, "Images"), and more packages (an OTLP exporter) as another
    extras = set(_arg(text, "EXTRAS").split(","))
    assert install.group(2) == "$EXTRAS" and "$EXTRA_PACKAGES" in install.group(3)
    assert extras == {"torch"} and extras <= set(project["project"]["optional-dependencies"])
    assert "otel" in project["project"]["optional-dependencies"], "the extra docs/deploy.md builds traces with"
    assert "EXTRAS=torch,otel" in (DEPLOY / name).read_text(), f"{name}: its comment says how to build with traces"
    assert "torch" in make_extras, "the Makefile installs the torch extra"
    # the torch pin is pyproject's: restated nowhere else (or restated equal)
    for pin in re.findall(r"torch==[\w.+]+", text + make_text):
        assert pin == torch_pin, f"{pin} differs from pyproject.toml's {torch_pin}"
    assert torch_pin in make_text, "the Makefile's comment names the pin it installs"
    index = _arg(text, "TORCH_INDEX_URL")
    assert "--extra-index-url \"$TORCH_INDEX_URL\"" in text
    for url in re.findall(r"--(?:extra-)?index-url[ =]['\"]?(https?://\S+?)['\"]?\s", make_text):
        assert url == index, f"the Makefile installs torch from {url}, {name} from {index}"
    if name == "Dockerfile":
        assert index == "https://download.pytorch.org/whl/cpu"
        assert re.search(r"^FROM python:3\.12-slim$", text, re.M)
        assert _arg(text, "EXTRA_PACKAGES") == ""
        py = (3, 12)
    else:
        assert re.fullmatch(r"https://download\.pytorch\.org/whl/cu\d{3}", index)
        assert re.match(r"nvidia/cuda:[\d.]+-(cudnn-)?runtime-ubuntu24\.04$", _arg(text, "CUDA_IMAGE"))
        py = (3, 12)  # Ubuntu 24.04's python3
        cuda_python = next(r for r in project["project"]["optional-dependencies"]["gpu"] if r.startswith("cuda-python"))
        assert _arg(text, "EXTRA_PACKAGES") == cuda_python
    low = re.fullmatch(r">=(\d+)\.(\d+)", project["project"]["requires-python"])
    assert py >= (int(low.group(1)), int(low.group(2)))
    # every package setuptools installs, and the readme pyproject names, is copied in
    for pkg in project["tool"]["setuptools"]["packages"]["find"]["include"]:
        assert re.search(rf"^COPY {pkg.rstrip('*')} \./{pkg.rstrip('*')}$", text, re.M), f"{name}: COPY {pkg}"
    assert re.search(rf"^COPY pyproject\.toml {project['project']['readme']} \./$", text, re.M)
    ignore = (DEPLOY / f"{name}.dockerignore").read_text().split()
    for pkg in project["tool"]["setuptools"]["packages"]["find"]["include"]:
        assert f"!{pkg.rstrip('*')}/" in ignore, f"{name}.dockerignore leaves out {pkg}"
    # a non-root user, the broker as entrypoint
    assert re.search(r"^USER 10001:10001$", text, re.M)
    assert re.search(r'^ENTRYPOINT \["python", "-m", "broker"\]$', text, re.M)


def _arg(text: str, name: str) -> str:
    m = re.search(rf"^ARG {name}=(\"[^\"]*\"|\S+)", text, re.M)
    assert m, f"ARG {name}"
    return m.group(1).strip('"')


def compose(name: str = "compose.yaml") -> dict:
    return yaml.safe_load((DEPLOY / name).read_text())


@pytest.mark.parametrize("name", ["compose.yaml", "compose.cuda.yaml"])
def test_compose_files_follow_the_compose_specification(name):
    schema = json.loads((SCHEMAS / "compose-spec.json").read_text())
    jsonschema.Draft7Validator(schema).validate(compose(name))


def test_the_compose_schema_rejects_a_typo():
    schema = json.loads((SCHEMAS / "compose-spec.json").read_text())
    c = compose()
    c["services"]["workers"]["shm-size"] = "1gb"
    with pytest.raises(jsonschema.ValidationError, match="shm-size"):
        jsonschema.Draft7Validator(schema).validate(c)


def _cmd_flag(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def test_compose_shares_what_shared_memory_needs():
    s = compose()["services"]
    owner = s["zmq-infer"]
    assert owner["ipc"] == "shareable" and owner["shm_size"]
    peers = {n: v for n, v in s.items() if n != "zmq-infer"}
    assert set(peers) == {"workers", "client"}
    for n, v in peers.items():
        assert v["ipc"] == "service:zmq-infer" and v["pid"] == "service:zmq-infer", n
    for n, v in s.items():
        assert v["hostname"] == owner["hostname"], f"{n}: local_host_id includes the hostname"
        assert v["user"] == owner["user"] == "10001:10001", n
        assert v["environment"]["XDG_RUNTIME_DIR"] == "/run/zmq-infer", n
        assert "run:/run/zmq-infer" in v["volumes"], n
        for p in v.get("ports", []):
            assert str(p).startswith("127.0.0.1:"), f"{n}: {p} is published beyond loopback"
    backend = _cmd_flag(owner["command"], "--backend")
    assert backend.startswith("ipc:///run/zmq-infer/")
    assert _cmd_flag(s["workers"]["command"], "--broker") == backend
    assert _cmd_flag(owner["command"], "--frontend") in s["client"]["command"][0]
    assert _cmd_flag(owner["command"], "--config") == "/etc/zmq-infer/deploy.toml"
    assert "./deploy.toml:/etc/zmq-infer/deploy.toml:ro" in owner["volumes"]
    http = _cmd_flag(owner["command"], "--http").rpartition(":")[2]
    assert owner["ports"] == [f"127.0.0.1:{http}:{http}"]
    assert f"127.0.0.1:{http}/v2/health/ready" in " ".join(owner["healthcheck"]["test"])
    health = _cmd_flag(s["workers"]["command"], "--health-port")
    assert f"127.0.0.1:{health}/v2/health/ready" in " ".join(s["workers"]["healthcheck"]["test"])
    cuda = compose("compose.cuda.yaml")["services"]
    assert cuda["zmq-infer"]["build"]["dockerfile"] == "deploy/Dockerfile.cuda"
    assert _cmd_flag(cuda["workers"]["command"], "--broker") == backend


def test_the_launcher_config_compose_mounts():
    path = DEPLOY / "deploy.toml"
    if not path.exists():
        pytest.skip("deploy/deploy.toml (the launcher's config) is not there yet")
    cfg = tomllib.loads(path.read_text())
    assert cfg.get("pool"), "deploy.toml has [[pool]] tables"


# --------------------------------------------------------------------------------- regeneration
def _strip_descriptions(node):
    if isinstance(node, dict):
        return {k: _strip_descriptions(v) for k, v in node.items()
                if not (k == "description" and isinstance(v, str))}
    if isinstance(node, list):
        return [_strip_descriptions(v) for v in node]
    return node


def openapi_to_jsonschema(node):
    """A CRD's structural OpenAPI v3 schema as JSON Schema: descriptions, formats and
    x-kubernetes-* extensions dropped (CEL rules cannot be checked here), `nullable` as a
    null type, and unknown fields refused wherever the CRD lists the properties and does not
    preserve unknown fields (what server-side strict field validation does)."""
    if isinstance(node, list):
        return [openapi_to_jsonschema(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for k, v in node.items():
        if k in ("description", "format", "nullable") or k.startswith("x-kubernetes-"):
            continue
        if k == "properties":
            out[k] = {name: openapi_to_jsonschema(s) for name, s in v.items()}
        elif k in ("items", "additionalProperties", "not", "anyOf", "allOf", "oneOf"):
            out[k] = openapi_to_jsonschema(v)
        else:
            out[k] = v
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if ("properties" in node and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def crd_to_jsonschema(crd: dict, source: str) -> tuple[str, dict]:
    group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
    version = next(v for v in crd["spec"]["versions"] if v.get("storage"))
    schema = openapi_to_jsonschema(version["schema"]["openAPIV3Schema"])
    schema["properties"].pop("status", None)
    schema["properties"]["apiVersion"] = {"const": f"{group}/{version['name']}"}
    schema["properties"]["kind"] = {"const": kind}
    schema["properties"]["metadata"] = {
        "type": "object", "required": ["name"],
        "properties": {"name": {"type": "string"}, "namespace": {"type": "string"},
                       "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                       "annotations": {"type": "object", "additionalProperties": {"type": "string"}}}}
    schema["required"] = sorted(set(schema.get("required", [])) | {"apiVersion", "kind", "metadata"})
    head = {"$schema": "https://json-schema.org/draft/2020-12/schema",
            "$comment": f"{kind} ({group}/{version['name']}) from {source} (Apache-2.0), converted by "
                        f"python -m tests.test_deploy crd: descriptions, formats and x-kubernetes-* rules "
                        f"dropped, unknown fields refused where the CRD lists properties."}
    return f"crd-{group}-{kind.lower()}-{version['name']}.json", {**head, **schema}


def _literal_str(dumper, s):
    return dumper.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None)


def render_prometheusrule() -> str:
    class Dumper(yaml.SafeDumper):
        pass

    Dumper.add_representer(str, _literal_str)
    rule = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
            "metadata": {"name": "zmq-infer", "namespace": NAMESPACE, "labels": {"app.kubernetes.io/name": "zmq-infer"}},
            "spec": {"groups": alert_groups()}}
    head = ("# Generated from deploy/prometheus/alerts.yaml by `python -m tests.test_deploy prometheusrule`;\n"
            "# edit that file, then regenerate (tests/test_deploy.py fails while the two differ).\n")
    return head + yaml.dump(rule, Dumper=Dumper, sort_keys=False, width=100)


def main(argv: list[str]) -> int:
    what, *files = argv or [""]
    if what == "prometheusrule":
        PROMETHEUSRULE.write_text(render_prometheusrule())
    elif what == "crd":
        for f in files:  # "path[=source description]"
            path, _, source = f.partition("=")
            for crd in load_docs(Path(path)):
                name, schema = crd_to_jsonschema(crd, source or path)
                (SCHEMAS / name).write_text(json.dumps(schema, indent=1, sort_keys=False) + "\n")
                print(f"wrote tests/schemas/{name}", file=sys.stderr)
    elif what == "compose-spec" and len(files) == 1:
        path, _, source = files[0].partition("=")
        spec = _strip_descriptions(json.loads(Path(path).read_text()))
        spec["$comment"] = (f"The Compose Specification's schema from {source or path} (Apache-2.0), "
                            f"descriptions removed by python -m tests.test_deploy compose-spec.")
        (SCHEMAS / "compose-spec.json").write_text(json.dumps(spec, indent=1) + "\n")
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
