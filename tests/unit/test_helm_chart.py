"""The Helm chart (deploy/helm/kv-conductor), rendered and checked without a cluster.

Rendering uses Helm's own Go SDK (the ``helm-python-sdk`` wheel: Helm v4's engine,
no helm binary), for the default values (embedded engine) and values-vllm.yaml (a
vLLM engine container beside each agent). The rendered objects are then checked:

* ``helm lint`` (strict) is clean;
* every built-in object validates against the official Kubernetes JSON schema
  (``kubernetes-validate``, strict: unknown fields are errors);
* every kvc command line (conductor and agent args) parses and validates against the
  real CLI and settings; probes are kubelet's own (HTTP for conductors, gRPC health for
  agents); values.schema.json declares every value and refuses wrong ones; the Redis URL,
  bearer keys and tenants file come from existing Secrets;
* the pieces fit: the conductors' static agent list names exactly the StatefulSet
  pods on their headless Services, each agent advertises its own DNS name, the HPA and
  PDBs select the right pods, the ServiceMonitor reaches both metrics ports with the
  job names the alert rules expect, the PrometheusRule carries deploy/prometheus/alerts.yml;
* checkov finds nothing beyond the two checks skipped below, with the reason.

What this cannot check (no cluster, no GPU, no image registry here): that the images
pull and start, that probes pass at run time, DNS and NetworkPolicy enforcement, GPU
scheduling, the ServiceMonitor and PrometheusRule against the Prometheus Operator's
CRD schemas (only their shape is checked), and the vLLM image's own flags.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from kvc.models import DEFAULT_MODEL_DIR
from tests.tooling import require_tool, run_tool
from tests.unit.test_deploy_files import flag, validate_command

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy/helm/kv-conductor"
RELEASE, NAMESPACE = "kvc", "serving"
KUBE_VERSION = "1.30"
PROFILES = {"default": None, "vllm": CHART / "values-vllm.yaml"}
CRDS = {"ServiceMonitor", "PrometheusRule"}
# checkov checks left out, and why.
CHECKOV_SKIPS = {
    "CKV_K8S_15": "pull policy IfNotPresent with immutable version tags; set "
    "image.pullPolicy=Always for mutable tags",
    "CKV_K8S_43": "digests are the operator's choice: image.tag accepts 'v1.2.3@sha256:…'",
    "CKV_K8S_35": "the settings read the Redis URL and bearer keys from the environment "
    "only (KVC_*); Secrets reach them as env through secretKeyRef",
}
# Values with every secret from an existing Secret (Redis URL, bearer keys, tenants file).
SECRETS = {
    "redis": {"existingSecret": "kvc-redis"},
    "auth": {"existingSecret": "kvc-auth", "tenantsFileKey": "tenants.json"},
}

Manifest = dict[str, Any]
TLS_MOUNT = "/etc/kvc/tls/"


# Offline rendering knows no cluster APIs: render the Prometheus Operator objects anyway.
ASSUME_CRDS = {"serviceMonitor": {"assumeCrds": True}, "prometheusRule": {"assumeCrds": True}}


def render(values_file: Path | None, assume_crds: bool = True) -> dict[str, str]:
    values = yaml.safe_load(values_file.read_text()) if values_file else {}
    return render_values(values, assume_crds)


def render_values(values: dict[str, Any], assume_crds: bool = True) -> dict[str, str]:
    if assume_crds:
        values = {**values, **{k: {**values.get(k, {}), **v} for k, v in ASSUME_CRDS.items()}}
    with helm.Chart.load(str(CHART)) as chart:
        rendered: dict[str, str] = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    return rendered


@pytest.fixture(scope="module", params=sorted(PROFILES))
def profile(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture(scope="module")
def manifests(profile: str) -> list[Manifest]:
    docs: list[Manifest] = []
    for path, text in render(PROFILES[profile]).items():
        if path.endswith(".yaml"):
            docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


def of_kind(docs: list[Manifest], kind: str) -> list[Manifest]:
    return [d for d in docs if d["kind"] == kind]


def containers(docs: list[Manifest]) -> Iterator[tuple[Manifest, Manifest]]:
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            for c in d["spec"]["template"]["spec"]["containers"]:
                yield d, c


def kvc_args(container: Manifest) -> list[str]:
    return [str(a) for a in container["args"]]


def validate_kvc(args: list[str], container: Manifest, tls_bundle: Path) -> None:
    """``validate_command`` with the container's environment; a model folder that exists
    only on the cluster's volume is replaced by the packaged one (the settings check
    that the folder exists), and the mounted TLS files by a real bundle."""
    model = flag(args, "--model")
    if model is not None and not Path(model).is_dir():
        args = list(args)
        args[args.index("--model") + 1] = str(DEFAULT_MODEL_DIR)
    env = {}
    for e in container.get("env", []):
        value = e.get("value")
        if isinstance(value, str) and value.startswith(TLS_MOUNT):
            value = str(tls_bundle / value.removeprefix(TLS_MOUNT))
        if value is not None and e["name"].startswith("KVC_"):
            env[e["name"]] = value
    validate_command(args, env)


def test_helm_lint_is_clean() -> None:
    for values_file in PROFILES.values():
        values = yaml.safe_load(values_file.read_text()) if values_file else None
        report = helm.lint(str(CHART), values, strict=True, namespace=NAMESPACE)
        problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
        assert not problems, problems


def test_chart_renders_every_object(manifests: list[Manifest]) -> None:
    kinds = sorted(d["kind"] for d in manifests)
    for kind, count in [
        ("Deployment", 1),
        ("HorizontalPodAutoscaler", 1),
        ("StatefulSet", 2),
        ("Service", 3),
        ("PodDisruptionBudget", 3),
        ("ServiceMonitor", 1),
        ("PrometheusRule", 1),
        ("NetworkPolicy", 2),
        ("ServiceAccount", 1),
    ]:
        assert kinds.count(kind) == count, (kind, kinds)
    for d in manifests:
        assert d["metadata"]["namespace"] == NAMESPACE, d["metadata"]["name"]


def test_objects_match_the_kubernetes_schemas(manifests: list[Manifest]) -> None:
    for d in manifests:
        if d["kind"] in CRDS:
            continue
        kubernetes_validate.validate(d, KUBE_VERSION, strict=True)


def test_conductor_command_and_probes_are_valid(
    manifests: list[Manifest], tls_bundle: Path
) -> None:
    (deployment,) = of_kind(manifests, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    args = kvc_args(container)
    assert args[0] == "conductor"
    validate_kvc(args, container, tls_bundle)
    port = int(flag(args, "--port") or 0)
    assert container["ports"][0]["containerPort"] == port
    # kubelet's own HTTP probes: no process per probe in the container.
    for probe, path in (("startupProbe", "/health"), ("livenessProbe", "/health"),
                        ("readinessProbe", "/ready")):  # fmt: skip
        assert container[probe]["httpGet"] == {"path": path, "port": "http"}, probe
    assert container["image"].startswith("kv-conductor:")


def test_agent_commands_and_probes_are_valid(manifests: list[Manifest], tls_bundle: Path) -> None:
    agents = [(sts, c) for sts, c in containers(manifests) if c["name"] == "agent"]
    assert len(agents) == 2
    roles = set()
    for sts, container in agents:
        args = kvc_args(container)
        assert args[0] == "agent"
        roles.add(flag(args, "--role"))
        grpc_port = int(flag(args, "--port") or 0)
        metrics_port = int(flag(args, "--metrics-port") or 0)
        stream_port = int(flag(args, "--stream-port") or 0)  # the token stream (Generate)
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports == {"grpc": grpc_port, "stream": stream_port, "metrics": metrics_port}
        assert stream_port not in (0, grpc_port, metrics_port)
        # Each pod advertises its own stable DNS name on the pool's headless Service.
        service = sts["spec"]["serviceName"]
        assert flag(args, "--advertise-address") == (
            f"$(POD_NAME).{service}.{NAMESPACE}.svc:{grpc_port}"
        )
        assert flag(args, "--node-id") == "$(POD_NAME)"
        env = {e["name"]: e for e in container["env"]}
        assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        # kubelet's HTTP probes on the metrics port (its gRPC probe cannot do mTLS): a
        # draining agent is not ready (/ready 503) but alive (/health 200).
        for probe, path in (("startupProbe", "/ready"), ("readinessProbe", "/ready"),
                            ("livenessProbe", "/health")):  # fmt: skip
            assert container[probe]["httpGet"] == {"path": path, "port": "metrics"}, probe
        assert container["image"].startswith("kv-conductor-agent:")
        validate_kvc(args, container, tls_bundle)
    assert roles == {"prefill", "decode"}


def test_vllm_profile_runs_the_engine_beside_the_agent(manifests: list[Manifest]) -> None:
    for sts in of_kind(manifests, "StatefulSet"):
        pod = sts["spec"]["template"]["spec"]
        by_name = {c["name"]: c for c in pod["containers"]}
        agent = kvc_args(by_name["agent"])
        if "engine" not in by_name:
            assert list(by_name) == ["agent"]
            assert flag(agent, "--engine") == "embedded"
            continue
        assert list(by_name) == ["agent", "engine"]
        engine = by_name["engine"]
        assert engine["image"].startswith("vllm/vllm-openai:")
        args = [str(a) for a in engine["args"]]
        # The agent attaches to this engine over the pod's loopback only.
        assert flag(args, "--host") == "127.0.0.1"
        assert flag(agent, "--engine") == "vllm"
        assert flag(agent, "--vllm-url") == f"http://127.0.0.1:{flag(args, '--port')}"
        # One ledger: the agent's pool is the engine's cache (vLLM keeps a null block).
        assert flag(agent, "--block-size") == flag(args, "--block-size")
        assert int(flag(args, "--num-gpu-blocks-override") or 0) == (
            int(flag(agent, "--capacity-blocks") or 0) + 1
        )
        assert "--enable-prefix-caching" in args
        events = json.loads(flag(args, "--kv-events-config") or "{}")
        assert events["enable_kv_cache_events"] is True
        for setting, key in [
            ("--kv-events-endpoint", "endpoint"),
            ("--kv-events-replay-endpoint", "replay_endpoint"),
        ]:  # vLLM binds tcp://*:P, the agent connects to tcp://127.0.0.1:P
            port = events[key].removeprefix("tcp://*:")
            assert flag(agent, setting) == f"tcp://127.0.0.1:{port}"
        if flag(agent, "--pd-connector") == "nixl":
            transfer = json.loads(flag(args, "--kv-transfer-config") or "{}")
            assert transfer["kv_connector"] == "NixlConnector"
        assert engine["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert "/dev/shm" in {m["mountPath"] for m in engine["volumeMounts"]}


def test_conductors_reach_every_agent_pod(manifests: list[Manifest]) -> None:
    (deployment,) = of_kind(manifests, "Deployment")
    args = kvc_args(deployment["spec"]["template"]["spec"]["containers"][0])
    expected = set()
    for sts in of_kind(manifests, "StatefulSet"):
        service = sts["spec"]["serviceName"]
        (svc,) = [s for s in of_kind(manifests, "Service") if s["metadata"]["name"] == service]
        assert svc["spec"]["clusterIP"] == "None"  # headless: one DNS name per pod
        pod_labels = sts["spec"]["template"]["metadata"]["labels"]
        assert svc["spec"]["selector"].items() <= pod_labels.items()
        port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "grpc")
        for i in range(sts["spec"]["replicas"]):
            expected.add(f"{sts['metadata']['name']}-{i}.{service}.{NAMESPACE}.svc:{port}")
    static = flag(args, "--agents")
    if static is None:  # discovery through the Redis registry the agents write to
        redis_url = flag(args, "--redis-url")
        assert redis_url
        for _sts, c in containers(of_kind(manifests, "StatefulSet")):
            if c["name"] == "agent":
                assert flag(kvc_args(c), "--redis-url") == redis_url
    else:
        assert set(static.split(",")) == expected
    # Kvc pods may reach the agents' gRPC port and their token stream port (Generate).
    agent_ports = set()
    for _sts, c in containers(of_kind(manifests, "StatefulSet")):
        if c["name"] == "agent":
            agent_ports |= {p["containerPort"] for p in c["ports"] if p["name"] != "metrics"}
    (nodes_policy,) = [
        p
        for p in of_kind(manifests, "NetworkPolicy")
        if p["spec"]["podSelector"]["matchLabels"].get("app.kubernetes.io/component") == "node"
    ]
    from_kvc = nodes_policy["spec"]["ingress"][0]
    assert {p["port"] for p in from_kvc["ports"]} == agent_ports


def test_hpa_and_disruption_budgets_select_the_right_pods(manifests: list[Manifest]) -> None:
    (deployment,) = of_kind(manifests, "Deployment")
    (hpa,) = of_kind(manifests, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": deployment["metadata"]["name"],
    }
    assert "replicas" not in deployment["spec"]  # the HPA owns the replica count
    assert hpa["spec"]["minReplicas"] >= 2
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    workloads = [deployment, *of_kind(manifests, "StatefulSet")]
    for pdb in of_kind(manifests, "PodDisruptionBudget"):
        selector = pdb["spec"]["selector"]["matchLabels"].items()
        matched = [w for w in workloads if selector <= w["spec"]["template"]["metadata"][
            "labels"].items()]  # fmt: skip
        assert len(matched) == 1, pdb["metadata"]["name"]


def test_service_monitor_scrapes_conductors_and_agents(manifests: list[Manifest]) -> None:
    (monitor,) = of_kind(manifests, "ServiceMonitor")
    spec = monitor["spec"]
    job_label = spec["jobLabel"]
    selected = [
        s
        for s in of_kind(manifests, "Service")
        if spec["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()
        and s["metadata"]["labels"].get(job_label)
        in spec["selector"]["matchExpressions"][0]["values"]
    ]
    jobs = {s["metadata"]["labels"][job_label] for s in selected}
    assert jobs == {"kvc-conductor", "kvc-agent"}  # the job names alerts.yml uses
    endpoint_ports = {e["port"] for e in spec["endpoints"]}
    for service in selected:
        names = {p["name"] for p in service["spec"]["ports"]}
        assert names & endpoint_ports, service["metadata"]["name"]
    assert all(e["path"] == "/metrics" for e in spec["endpoints"])
    assert spec["namespaceSelector"]["matchNames"] == [NAMESPACE]


def test_prometheus_rule_carries_the_alert_rules(manifests: list[Manifest]) -> None:
    source = (ROOT / "deploy/prometheus/alerts.yml").read_text()
    assert (CHART / "files/alerts.yml").read_text() == source, (
        "deploy/helm/kv-conductor/files/alerts.yml must be a copy of deploy/prometheus/alerts.yml"
    )
    (rule,) = of_kind(manifests, "PrometheusRule")
    assert rule["spec"]["groups"] == yaml.safe_load(source)["groups"]


def test_pods_run_locked_down(manifests: list[Manifest]) -> None:
    for workload, container in containers(manifests):
        pod = workload["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False
        sc = container["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"]["drop"] == ["ALL"]
        assert "limits" in container["resources"]
        if container["name"] != "engine":  # the vLLM image runs as root
            assert sc["readOnlyRootFilesystem"] is True
            non_root = sc.get("runAsNonRoot", pod["securityContext"].get("runAsNonRoot"))
            assert non_root is True, container["name"]


def test_rendered_chart_passes_checkov(tmp_path: Path) -> None:
    checkov = require_tool("checkov")
    renders = {profile: render(values_file) for profile, values_file in PROFILES.items()}
    renders["secrets"] = render_values(SECRETS)
    for profile, rendered in renders.items():
        for path, text in rendered.items():
            if path.endswith(".yaml") and text.strip():
                (tmp_path / f"{profile}-{Path(path).name}").write_text(text)
    output = run_tool(
        [checkov, "--quiet", "--compact", "--skip-download", "--framework", "kubernetes",
         "--skip-check", ",".join(sorted(CHECKOV_SKIPS)), "-d", str(tmp_path)],
        timeout_s=300,
    )  # fmt: skip
    assert "Failed checks: 0" in output, output


def test_an_engine_container_needs_the_vllm_adapter() -> None:
    with helm.Chart.load(str(CHART)) as chart, pytest.raises(helm.HelmError, match="vllm"):
        chart.render({"engine": {"enabled": True}}, name=RELEASE, namespace=NAMESPACE)


def test_prometheus_operator_objects_need_their_api() -> None:
    docs = [d for p, text in render(None, assume_crds=False).items() if p.endswith(".yaml")
            for d in yaml.safe_load_all(text) if d]  # fmt: skip
    assert not {d["kind"] for d in docs} & CRDS


# Objects passed through to Kubernetes as they are (their schema is Kubernetes's own).
KUBERNETES_OBJECTS = {
    "resources", "affinity", "podSecurityContext", "securityContext", "env", "tolerations",
    "imagePullSecrets",
}  # fmt: skip


def test_values_schema_declares_every_value() -> None:
    """Every object of ours is closed (a typo in a key is refused, not ignored)."""
    schema = json.loads((CHART / "values.schema.json").read_text())

    def walk(node: dict[str, Any], path: str) -> None:
        if node.get("type") == "object" and "properties" in node:
            assert node.get("additionalProperties") is False, path
            for key, child in node["properties"].items():
                walk(child, f"{path}.{key}")
        elif (
            node.get("type") == "object"
            and path.rsplit(".", 1)[-1].removesuffix("[]") not in KUBERNETES_OBJECTS
        ):
            assert node.get("additionalProperties") == {"type": "string"}, path  # labels
        if "items" in node:
            walk(node["items"], f"{path}[]")

    walk(schema, "values")


@pytest.mark.parametrize(
    "values",
    [
        {"serviceMonitor": {"enabled": "yes"}},
        {"agent": {"engine": "sglang"}},
        {"nodes": [{"name": "prefill", "role": "prefil"}]},
        {"redisUrll": "redis://redis:6379/0"},
        {"conductor": {"replica": 3}},
        {"kv": {"blockSize": 0}},
        {"engine": {"image": {"tag": 11}}},
        {"model": {"volume": {"mountPath": "models"}}},
    ],
)
def test_values_schema_refuses_wrong_values(values: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmValuesError, match="schema"):
        render_values(values)


def test_redis_url_from_an_existing_secret() -> None:
    values = {"redis": {"existingSecret": "kvc-redis", "existingSecretKey": "url"}}
    docs = [d for p, text in render_values(values).items() if p.endswith(".yaml")
            for d in yaml.safe_load_all(text) if d]  # fmt: skip
    seen = set()
    for _, container in containers(docs):
        if container["name"] not in ("conductor", "agent"):
            continue
        assert not any("redis" in str(a) for a in container["args"]), container["name"]
        (env,) = [e for e in container["env"] if e["name"].endswith("_REDIS_URL")]
        assert env["valueFrom"]["secretKeyRef"] == {"name": "kvc-redis", "key": "url"}
        seen.add(env["name"])
    assert seen == {"KVC_CONDUCTOR_REDIS_URL", "KVC_AGENT_REDIS_URL"}
    with pytest.raises(helm.HelmError, match="not both"):
        render_values({**values, "redisUrl": "redis://redis:6379/0"})


def test_bearer_keys_and_tenants_file_from_an_existing_secret() -> None:
    docs = [d for p, text in render_values(SECRETS).items() if p.endswith(".yaml")
            for d in yaml.safe_load_all(text) if d]  # fmt: skip
    (deployment,) = of_kind(docs, "Deployment")
    kubernetes_validate.validate(deployment, KUBE_VERSION, strict=True)
    pod = deployment["spec"]["template"]["spec"]
    (conductor,) = pod["containers"]
    env = {e["name"]: e for e in conductor["env"]}
    for name, key in (("KVC_CONDUCTOR_API_KEYS", "api-keys"),
                      ("KVC_CONDUCTOR_ADMIN_KEYS", "admin-keys")):  # fmt: skip
        # A key the Secret lacks leaves the setting empty instead of blocking the pod.
        assert env[name]["valueFrom"]["secretKeyRef"] == {
            "name": "kvc-auth", "key": key, "optional": True,
        }  # fmt: skip
    tenants_file = Path(env["KVC_CONDUCTOR_TENANTS_FILE"]["value"])
    (mount,) = [m for m in conductor["volumeMounts"] if m["name"] == "tenants"]
    assert tenants_file.parent == Path(mount["mountPath"])
    assert mount["readOnly"] is True
    (volume,) = [v for v in pod["volumes"] if v["name"] == "tenants"]
    assert volume["secret"] == {
        "secretName": "kvc-auth", "items": [{"key": "tenants.json", "path": tenants_file.name}],
    }  # fmt: skip
    assert not any("key" in str(a) or "tenants" in str(a) for a in conductor["args"])
    for _, container in containers(of_kind(docs, "StatefulSet")):
        assert not any("KVC_CONDUCTOR" in e["name"] for e in container.get("env", []))
    with pytest.raises(helm.HelmError, match=r"needs auth\.existingSecret"):
        render_values({"auth": {"tenantsFileKey": "tenants.json"}})


def rendered_docs(values: dict[str, Any]) -> list[Manifest]:
    return [d for p, text in render_values(values).items() if p.endswith(".yaml")
            for d in yaml.safe_load_all(text) if d]  # fmt: skip


def tls_volume(pod: Manifest) -> Manifest | None:
    return next((v for v in pod["volumes"] if v["name"] == "tls"), None)


def test_mtls_by_default_with_certificates_the_chart_makes() -> None:
    """Each pod mounts its role's certificate and key and the CA, nothing else (the
    CA's key is never in the cluster); the certificates verify against the CA."""
    from cryptography import x509

    docs = rendered_docs({})
    (secret,) = [d for d in of_kind(docs, "Secret") if d["metadata"]["name"].endswith("-tls")]
    data = {k: base64.b64decode(v) for k, v in secret["data"].items()}
    assert set(data) == {"ca.pem", "conductor.pem", "conductor-key.pem", "agent.pem",
                         "agent-key.pem"}  # fmt: skip
    ca = x509.load_pem_x509_certificate(data["ca.pem"])
    for role in ("conductor", "agent"):
        cert = x509.load_pem_x509_certificate(data[f"{role}.pem"])
        cert.verify_directly_issued_by(ca)
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert sans.get_values_for_type(x509.DNSName) == [f"kvc-{role}"]
    for workload, container in containers(docs):
        if container["name"] not in ("conductor", "agent"):
            continue
        role = container["name"]
        pod = workload["spec"]["template"]["spec"]
        volume = tls_volume(pod)
        assert volume is not None
        assert volume["secret"]["secretName"] == secret["metadata"]["name"]
        assert {i["key"] for i in volume["secret"]["items"]} == {
            "ca.pem", f"{role}.pem", f"{role}-key.pem"
        }  # fmt: skip
        env = {e["name"]: e.get("value") for e in container["env"]}
        prefix = f"KVC_{role.upper()}_"
        assert env[prefix + "TLS_CERT_FILE"] == f"{TLS_MOUNT}{role}.pem"
        assert prefix + "GRPC_PLAINTEXT" not in env


def test_mtls_from_an_existing_secret_or_off_behind_a_mesh() -> None:
    docs = rendered_docs({"tls": {"existingSecret": "my-kvc-tls"}})
    assert not [d for d in of_kind(docs, "Secret") if d["metadata"]["name"].endswith("-tls")]
    for workload, container in containers(docs):
        if container["name"] in ("conductor", "agent"):
            volume = tls_volume(workload["spec"]["template"]["spec"])
            assert volume is not None
            assert volume["secret"]["secretName"] == "my-kvc-tls"
    docs = rendered_docs({"tls": {"enabled": False}})
    assert not of_kind(docs, "Secret")
    for workload, container in containers(docs):
        if container["name"] in ("conductor", "agent"):
            assert tls_volume(workload["spec"]["template"]["spec"]) is None
            env = {e["name"]: e.get("value") for e in container["env"]}
            assert env[f"KVC_{container['name'].upper()}_GRPC_PLAINTEXT"] == "any"


def test_kv_tiers_pass_their_flags_and_mount_a_local_disk(tls_bundle: Path) -> None:
    gib = 1 << 30
    values = {"agent": {"kvTiers": {"hostBytes": 8 * gib, "diskBytes": 64 * gib}}}
    docs = [d for p, text in render_values(values).items() if p.endswith(".yaml")
            for d in yaml.safe_load_all(text) if d]  # fmt: skip
    agents = [(sts, c) for sts, c in containers(docs) if c["name"] == "agent"]
    assert len(agents) == 2
    for sts, container in agents:
        kubernetes_validate.validate(sts, KUBE_VERSION, strict=True)
        args = kvc_args(container)
        assert flag(args, "--host-tier-bytes") == str(8 * gib)
        assert flag(args, "--disk-tier-bytes") == str(64 * gib)
        assert flag(args, "--disk-tier-dir") == "/var/cache/kvc-tiers"
        validate_kvc(args, container, tls_bundle)
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert mounts["kv-tiers"] == "/var/cache/kvc-tiers"
        volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
        assert volumes["kv-tiers"]["emptyDir"]["sizeLimit"] == str(64 * gib + 64 * gib // 10)
    vllm = yaml.safe_load((CHART / "values-vllm.yaml").read_text())
    vllm["agent"]["kvTiers"] = values["agent"]["kvTiers"]
    with pytest.raises(helm.HelmError, match="embedded engine"):
        render_values(vllm)
