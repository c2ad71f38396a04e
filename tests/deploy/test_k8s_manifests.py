"""deploy/k8s: every overlay renders offline (`kubectl kustomize`), every object is valid
against the Kubernetes 1.30 schemas (strict: no unknown field), and the invariants the
deployment needs hold: only flags the services accept, Services that select pods, probes on
declared ports, Secrets where the flags point, gateways replicated, one allocator pod per shard
and every shard listed to the gateways, GPUs on the GPU overlay. The network paths:
test_k8s_network_policies.py."""

from __future__ import annotations

import argparse
import copy
import importlib
import os
import re
import secrets
from pathlib import Path

import kubernetes_validate as kv  # a dev dependency (pyproject)
import pytest

from allocator_svc.settings import parse_settings as parse_allocator_settings
from common.config import env_name
from common.credentials import CredentialsError, load_internal_auth, read_token, token_digest
from common.sharding import shard_of
from executor_svc.settings import parse_bytes
from gateway.api.tenants import load_api_keys
from tests.deploy.kube_objects import K8S_DIR, POD_INDEX, Rendered, labels_of, overlay, render
from tests.deploy.network_policy import selects
from tools.make_secret import make_role_credentials, make_secret

K8S_VERSION = "1.30"
OVERLAYS = ("cpu", "gpu", "cpu-sharded")
REPO = K8S_DIR.parents[1]
# Variables a container may set that are no flag: HOME (the root filesystem is read-only; it
# points at /tmp) and torch's thread count.
NON_FLAG_ENV = {"HOME", "OMP_NUM_THREADS"}
SECRET_FILE_FLAGS = ("--role-token-file", "--caller-digests-file", "--api-keys-file",
                     "--salt-secret-file",
                     "--tls-cert", "--tls-key", "--tls-ca", "--public-tls-cert",
                     "--public-tls-key")
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
# (probe, handler, port, path): gRPC health inside; the gateway's HTTP /health for readiness
# (503 without an executor) but not for liveness (a restart would not bring one back).
EXPECTED_PROBES = {
    "allocator": [("readinessProbe", "grpc", 50052, None), ("livenessProbe", "grpc", 50052, None)],
    "executor": [("readinessProbe", "grpc", 50053, None), ("livenessProbe", "grpc", 50053, None)],
    "gateway": [("readinessProbe", "httpGet", 8000, "/health"),
                ("livenessProbe", "httpGet", 8000, "/live")],
}


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request: pytest.FixtureRequest) -> Rendered:
    return overlay(request.param)


def build_parser(service: str) -> argparse.ArgumentParser:
    return importlib.import_module(f"{service}.settings").build_parser()


def test_manifests_valid_against_kubernetes_schemas(rendered: Rendered) -> None:
    # Every object of the overlay against the 1.30 API's JSON schema, offline.
    for obj in rendered.objects:
        try:
            kv.validate(obj, K8S_VERSION, strict=True)
        except kv.ValidationError as exc:
            pytest.fail(f"{rendered.name}: {obj['kind']} {obj['metadata']['name']}: "
                        f"{exc.message} at {'.'.join(map(str, exc.absolute_path))}")


def test_schema_validation_refuses_a_misspelled_field() -> None:
    # The negative control: strict validation does reject what the API server would.
    gateway = copy.deepcopy(overlay("cpu").workload("gateway"))
    container = gateway["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    with pytest.raises(kv.ValidationError):
        kv.validate(gateway, K8S_VERSION, strict=True)


def test_container_env_names_only_flags_of_its_service(rendered: Rendered,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # Every PAGEDKV_* variable and argument is a flag of that service's own parser, and the
    # parser takes its value (a typo or a flag of another service fails here, not in a pod).
    for container in rendered.containers():
        env = rendered.env(container)
        parser = build_parser(container.service)
        flags = {env_name(option) for action in parser._actions
                 if not isinstance(action, argparse._HelpAction)
                 for option in action.option_strings if option.startswith("--")}
        unknown = sorted(set(env) - flags - NON_FLAG_ENV)
        assert not unknown, f"{rendered.name}: {container.service} takes no {unknown}"
        _use_pagedkv_env(monkeypatch, env)
        try:
            build_parser(container.service).parse_args(container.spec.get("args", []))
        except SystemExit:
            pytest.fail(f"{rendered.name}: {container.service} refuses its configuration "
                        f"(stderr above): {env}")


def test_declared_ports_are_the_ports_the_services_bind(rendered: Rendered) -> None:
    # Container ports, the flags that bind them, and every interface of the pod.
    flags = {"grpc": "PAGEDKV_PORT", "metrics": "PAGEDKV_METRICS_PORT",
             "http": "PAGEDKV_HTTP_PORT"}
    for container in rendered.containers():
        env = rendered.env(container)
        assert env["PAGEDKV_HOST"] == "0.0.0.0"
        for name, port in container.ports().items():
            assert int(env[flags[name]]) == port, f"{container.service} {name}"


def test_every_service_and_budget_selects_pods(rendered: Rendered) -> None:
    # Services and PodDisruptionBudgets select a workload's pods; a Service's target ports are
    # declared by those pods, with the same number (the NetworkPolicies name pod ports).
    workloads = [c.workload for c in rendered.containers()]
    for workload in workloads:
        assert selects(workload["spec"]["selector"], labels_of(workload))
    for budget in rendered.of_kind("PodDisruptionBudget"):
        assert any(selects(budget["spec"]["selector"], labels_of(w)) for w in workloads)
    for service in rendered.of_kind("Service"):
        selector = {"matchLabels": service["spec"]["selector"]}
        pods = [c for c in rendered.containers() if selects(selector, labels_of(c.workload))]
        assert pods, f"{rendered.name}: Service {service['metadata']['name']} selects no pod"
        for port in service["spec"]["ports"]:
            for container in pods:
                declared = container.ports()
                target = port.get("targetPort", port["port"])
                assert declared.get(target, target) == port["port"], (service, port)


def test_probes_target_declared_container_ports(rendered: Rendered) -> None:
    # Startup, readiness and liveness on every container, each on a port it declares; gRPC
    # health inside, HTTP on the gateway (EXPECTED_PROBES).
    for container in rendered.containers():
        ports = container.ports()
        for kind in PROBES:
            probe = container.spec[kind]
            (handler,) = {"grpc", "httpGet", "tcpSocket"} & probe.keys()
            port = probe[handler]["port"]
            assert port in ports.values() or port in ports, f"{container.service} {kind}"
        for kind, handler, port, path in EXPECTED_PROBES[container.workload["metadata"]["name"]]:
            probe = container.spec[kind]
            assert probe[handler]["port"] == port and probe[handler].get("path") == path


def test_gateway_startup_probe_outlasts_its_connect_timeout(rendered: Rendered) -> None:
    # Nothing listens until the allocator and a first executor answer: the startup probe must
    # not kill a gateway that is still, legitimately, waiting.
    gateway = rendered.container("gateway")
    probe = gateway.spec["startupProbe"]
    window = probe.get("initialDelaySeconds", 0) + probe["periodSeconds"] * probe[
        "failureThreshold"]
    assert window > float(rendered.env(gateway)["PAGEDKV_CONNECT_TIMEOUT_S"])


def test_secret_files_are_mounted_where_the_flags_point(rendered: Rendered) -> None:
    # Every credential file a flag names is a key of a Secret mounted at that path; each
    # service holds its own role's token and no other's (three Secrets, one each), the
    # allocator and executors the callers' digests, and none runs --insecure.
    token_secrets = {}
    for container in rendered.containers():
        env = rendered.env(container)
        assert env.get("PAGEDKV_ROLE_TOKEN_FILE") and "PAGEDKV_INSECURE" not in env
        assert "PAGEDKV_INTERNAL_TOKEN_FILE" not in env
        assert bool(env.get("PAGEDKV_CALLER_DIGESTS_FILE")) == (container.service != "gateway")
        mounted = {name for name in ("pagedkv-gateway-token", "pagedkv-allocator-token",
                                     "pagedkv-executor-token")
                   if any(name in str(v) for v in container.pod["volumes"])}
        assert len(mounted) == 1, (container.service, mounted)
        for flag in SECRET_FILE_FLAGS:
            path = env.get(env_name(flag))
            if not path:
                continue
            found = rendered.secret_file(container, path)
            assert found, f"{rendered.name}: {container.service} {flag} {path}: no Secret there"
            name, key = found
            assert key in rendered.secret_data(name)
            if flag == "--role-token-file":
                token_secrets[container.workload["metadata"]["name"]] = name.rsplit("-", 1)[0]
    assert sorted(token_secrets.values()) == ["pagedkv-allocator-token",
                                              "pagedkv-executor-token", "pagedkv-gateway-token"]
    assert all(name == f"pagedkv-{workload}-token" for workload, name in token_secrets.items())


def test_gateways_replicated_with_shared_keys_and_salt(rendered: Rendered) -> None:
    # Two or more gateways, each reading the API keys and the tenant salt from the same
    # Secrets (one pod template), so every replica derives the same cache salts.
    assert rendered.workload("gateway")["spec"]["replicas"] >= 2
    gateway = rendered.container("gateway")
    env = rendered.env(gateway)
    for flag in ("--api-keys-file", "--salt-secret-file"):
        assert rendered.secret_file(gateway, env[env_name(flag)]) is not None


def _use_pagedkv_env(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    """The process environment holds exactly `env`'s PAGEDKV_* variables (and its others)."""
    for name in [n for n in os.environ if n.startswith("PAGEDKV_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def test_allocator_one_pod_per_shard_never_two(rendered: Rendered) -> None:
    # One process per shard: a StatefulSet (never two pods of one ordinal) of
    # PAGEDKV_NUM_SHARDS replicas, started together and rolled one shard at a time; a pod's
    # shard is its ordinal; no voluntary disruption of any shard.
    allocator, container = rendered.workload("allocator"), rendered.container("allocator")
    spec = allocator["spec"]
    assert allocator["kind"] == "StatefulSet"
    assert spec["replicas"] == int(rendered.env(container)["PAGEDKV_NUM_SHARDS"])
    assert spec["podManagementPolicy"] == "Parallel"
    assert spec["updateStrategy"]["type"] == "RollingUpdate"
    (index,) = [e for e in container.spec["env"] if e["name"] == "PAGEDKV_SHARD_INDEX"]
    assert index["valueFrom"]["fieldRef"]["fieldPath"] == POD_INDEX
    (budget,) = [b for b in rendered.of_kind("PodDisruptionBudget")
                 if selects(b["spec"]["selector"], labels_of(allocator))]
    assert budget["spec"]["maxUnavailable"] == 0 and "minAvailable" not in budget["spec"]
    assert budget["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


def test_allocator_pods_start_as_their_own_shard(rendered: Rendered, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # Pod allocator-i's environment, read by the allocator's own settings: shard i of
    # replicas; one pod more (the StatefulSet scaled without PAGEDKV_NUM_SHARDS) stops at
    # start.
    container = rendered.container("allocator")
    num_shards = container.workload["spec"]["replicas"]
    make_role_credentials(tmp_path)
    files = {"PAGEDKV_ROLE_TOKEN_FILE": str(tmp_path / "allocator" / "role-token"),
             "PAGEDKV_CALLER_DIGESTS_FILE": str(tmp_path / "allocator" / "caller-digests")}
    for ordinal in range(num_shards + 1):
        env = rendered.env(container, ordinal)
        _use_pagedkv_env(monkeypatch, {**env, **files})
        if ordinal == num_shards:
            with pytest.raises(SystemExit):
                parse_allocator_settings(container.spec.get("args", []))
            continue
        settings = parse_allocator_settings(container.spec.get("args", []))
        assert (settings.shard_index, settings.num_shards) == (ordinal, num_shards)


def test_gateway_finds_the_executors_and_allocator_of_its_namespace(rendered: Rendered) -> None:
    # Executors: a StatefulSet whose pod names are their pool names, behind a headless Service
    # that lists only ready pods; the gateway asks that Service's DNS name (or, without
    # discovery, lists every pod's). Allocator shards: every pod's own DNS name under its
    # headless Service, in shard order 0..N-1.
    namespace, executors = rendered.namespace, rendered.workload("executor")
    assert executors["kind"] == "StatefulSet"
    headless = rendered.get("Service", executors["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is False
    executor = rendered.container("executor")
    (pool_name,) = [e for e in executor.spec["env"] if e["name"] == "PAGEDKV_POOL_NAME"]
    assert pool_name["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    env, port = rendered.env(rendered.container("gateway")), executor.ports()["grpc"]
    service = headless["metadata"]["name"]
    if "PAGEDKV_EXECUTOR_DNS" in env:
        assert env["PAGEDKV_EXECUTOR_DNS"] == f"{service}.{namespace}.svc:{port}"
    else:
        pods = range(executors["spec"]["replicas"])
        assert env["PAGEDKV_EXECUTOR_ADDRS"] == ",".join(
            f"{service}-{i}.{service}.{namespace}.svc:{port}" for i in pods)
    allocators = rendered.workload("allocator")
    shards = rendered.get("Service", allocators["spec"]["serviceName"])
    assert shards["spec"]["clusterIP"] == "None"
    (grpc,) = [p["port"] for p in shards["spec"]["ports"] if p["name"] == "grpc"]
    pod, service = allocators["metadata"]["name"], shards["metadata"]["name"]
    assert env["PAGEDKV_ALLOCATOR_ADDR"] == ",".join(
        f"{pod}-{i}.{service}.{namespace}.svc:{grpc}"
        for i in range(allocators["spec"]["replicas"]))


def test_pods_are_restricted_with_a_read_only_root(rendered: Rendered) -> None:
    # The restricted Pod Security Standard, a read-only root with /tmp as HOME, no service
    # account token, no docker-link variables (a Service named pagedkv would inject
    # PAGEDKV_PORT=tcp://...), the repository's image, resources everywhere.
    volume_types = {"configMap", "secret", "projected", "emptyDir", "persistentVolumeClaim"}
    for container in rendered.containers():
        pod, name = container.pod, container.workload["metadata"]["name"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        assert pod["enableServiceLinks"] is False and pod["automountServiceAccountToken"] is False
        assert all((volume.keys() - {"name"}) <= volume_types for volume in pod["volumes"])
        for spec in [*pod.get("initContainers", []), container.spec]:
            security = spec["securityContext"]
            assert security["readOnlyRootFilesystem"] is True, name
            assert security["allowPrivilegeEscalation"] is False, name
            assert security["capabilities"] == {"drop": ["ALL"]}, name
            assert spec["image"] == "pagedkv:latest", name
            assert {"cpu", "memory"} <= spec["resources"]["requests"].keys(), name
            assert "memory" in spec["resources"]["limits"], name
        mounts = {m["mountPath"]: m["name"] for m in container.spec["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert "emptyDir" in volumes[mounts["/tmp"]] and rendered.env(container)["HOME"] == "/tmp"
    # The executor's kernels: the image's build directory, copied into a writable emptyDir
    # (torch takes a lock file there even when nothing is built).
    executor = rendered.container("executor")
    (init,) = executor.pod["initContainers"]
    (build,) = [m for m in executor.spec["volumeMounts"] if m["mountPath"] == "/app/build"]
    (copy_to,) = [m["mountPath"] for m in init["volumeMounts"] if m["name"] == build["name"]]
    assert init["command"] == ["cp", "-a", "/app/build/.", f"{copy_to}/"]


def test_placeholder_secrets_are_refused_by_the_services(tmp_path: Path) -> None:
    # The committed placeholders are no credentials: each service's own loader refuses them.
    rendered = overlay("cpu")
    gateway = rendered.container("gateway")
    env = rendered.env(gateway)
    files = {}
    for flag in ("--role-token-file", "--api-keys-file", "--salt-secret-file"):
        name, key = rendered.secret_file(gateway, env[env_name(flag)]) or ("", "")
        files[flag] = tmp_path / key
        files[flag].write_bytes(rendered.secret_data(name)[key])
    with pytest.raises(CredentialsError, match="at least 16"):
        load_internal_auth(str(files["--role-token-file"]), "", "", "", False, serves=False)
    for service in ("allocator", "executor"):
        container = rendered.container(service)
        path = rendered.env(container)["PAGEDKV_ROLE_TOKEN_FILE"]
        name, key = rendered.secret_file(container, path) or ("", "")
        (tmp_path / service).write_bytes(rendered.secret_data(name)[key])
        with pytest.raises(CredentialsError, match="at least 16"):
            load_internal_auth(str(tmp_path / service), "", "", "", False)
        path = rendered.env(container)["PAGEDKV_CALLER_DIGESTS_FILE"]
        name, key = rendered.secret_file(container, path) or ("", "")
        (tmp_path / "digests").write_bytes(rendered.secret_data(name)[key])
        with pytest.raises(CredentialsError, match="no digests"):
            load_internal_auth("", "", "", "", False, str(tmp_path / "digests"))
    with pytest.raises(CredentialsError, match="no keys"):
        load_api_keys(str(files["--api-keys-file"]))
    with pytest.raises(CredentialsError, match="empty"):
        read_token(str(files["--salt-secret-file"]), "--salt-secret-file")


LOCAL_OVERLAY = """\
resources: [{overlay}]
secretGenerator:
  - {{name: pagedkv-gateway-token, behavior: replace, files: [role-token=gateway/role-token]}}
  - {{name: pagedkv-allocator-token, behavior: replace,
     files: [role-token=allocator/role-token]}}
  - {{name: pagedkv-executor-token, behavior: replace,
     files: [role-token=executor/role-token]}}
  - {{name: pagedkv-caller-digests, behavior: replace,
     files: [caller-digests=allocator/caller-digests]}}
  - {{name: pagedkv-api-keys, behavior: replace, files: [api-keys]}}
  - {{name: pagedkv-salt-secret, behavior: replace, files: [salt-secret]}}
"""


@pytest.mark.parametrize("base", ["cpu", "cpu-sharded"])
def test_local_overlay_replaces_every_placeholder(tmp_path: Path, base: str) -> None:
    # The README's recipe: generated secrets in an overlay of one's own over overlays/cpu
    # (or cpu-sharded); every pod then reads them, and the services accept them.
    make_role_credentials(tmp_path)
    make_secret(tmp_path / "salt-secret")
    (tmp_path / "api-keys").write_text(f"{secrets.token_urlsafe(24)} team-a\n")
    target = os.path.relpath(K8S_DIR / "overlays" / base, tmp_path)
    (tmp_path / "kustomization.yaml").write_text(LOCAL_OVERLAY.format(overlay=target))
    rendered = Rendered("local", render(tmp_path))
    assert len(rendered.of_kind("Secret")) == 6
    for container in rendered.containers():
        env, role = rendered.env(container), container.workload["metadata"]["name"]
        sources = {"--role-token-file": tmp_path / role / "role-token",
                   "--caller-digests-file": tmp_path / "allocator" / "caller-digests",
                   "--api-keys-file": tmp_path / "api-keys",
                   "--salt-secret-file": tmp_path / "salt-secret"}
        for flag, source in sources.items():
            if env_name(flag) in env:
                name, key = rendered.secret_file(container, env[env_name(flag)]) or ("", "")
                assert rendered.secret_data(name)[key] == source.read_bytes(), (role, flag)
        auth = load_internal_auth(str(sources["--role-token-file"]), "", "", "", False,
                                  str(sources["--caller-digests-file"]))
        assert (token_digest(auth.token), role) in auth.callers
    assert load_api_keys(str(tmp_path / "api-keys"))


SHARDS_RECIPE = """\
resources: [{overlay}]
replicas:
  - {{name: allocator, count: 2}}
configMapGenerator:
  - {{name: pagedkv-allocator, behavior: merge, literals: [PAGEDKV_NUM_SHARDS=2]}}
  - name: pagedkv-gateway
    behavior: merge
    literals:
      - PAGEDKV_ALLOCATOR_ADDR={addrs}
"""


def test_shards_recipe_renders_the_sharded_overlay(tmp_path: Path) -> None:
    # The README's recipe for two shards, in an overlay of one's own over overlays/cpu:
    # exactly what overlays/cpu-sharded renders.
    target = os.path.relpath(K8S_DIR / "overlays" / "cpu", tmp_path)
    addrs = ",".join(f"allocator-{i}.allocator.pagedkv.svc:50052" for i in range(2))
    (tmp_path / "kustomization.yaml").write_text(SHARDS_RECIPE.format(overlay=target,
                                                                      addrs=addrs))
    assert render(tmp_path) == overlay("cpu-sharded").objects


def _bytes(quantity: str) -> int:
    """A Kubernetes memory quantity in binary units ("3Gi")."""
    match = re.fullmatch(r"(\d+)(Ki|Mi|Gi)?", quantity)
    assert match, f"unexpected quantity {quantity}"
    return int(match[1]) << {"Ki": 10, "Mi": 20, "Gi": 30, None: 0}[match[2]]


def test_cpu_overlay_serves_the_embedded_model() -> None:
    # Two executors on the model baked into the image (WORKDIR /app), C++ kernels, with
    # Guaranteed resources whose memory covers the KV cache, the swap blocks and the 1.7 GiB
    # measured besides (weights and their packed copies, interpreter, a step's activations).
    rendered = overlay("cpu")
    assert rendered.workload("executor")["spec"]["replicas"] == 2
    dockerfile = (REPO / "Dockerfile").read_text()
    assert "WORKDIR /app" in dockerfile and "--out models/smollm2-135m-instruct" in dockerfile
    for name in ("executor", "gateway"):
        model = rendered.env(rendered.container(name))["PAGEDKV_MODEL"]
        assert model == "/app/models/smollm2-135m-instruct"
    executor = rendered.container("executor")
    env, resources = rendered.env(executor), executor.spec["resources"]
    assert env["PAGEDKV_DEVICE"] == "cpu" and env["PAGEDKV_BACKEND"] == "cpu"
    assert resources["requests"] == resources["limits"]
    kv_and_swap = parse_bytes(env["PAGEDKV_KV_CACHE_MEMORY"]) + float(
        env["PAGEDKV_SWAP_SPACE"]) * 2**30
    assert _bytes(resources["limits"]["memory"]) >= kv_and_swap + 1.75 * 2**30


def test_sharded_overlay_is_the_cpu_overlay_with_two_shards() -> None:
    # overlays/cpu-sharded: two allocator shards, each owning one of the two executors' pools
    # (common/sharding.py); the executors as in overlays/cpu, and of the configuration only
    # the shard count and the gateways' list of shards changed.
    sharded, cpu = overlay("cpu-sharded"), overlay("cpu")
    assert sharded.workload("allocator")["spec"]["replicas"] == 2
    executor = sharded.container("executor")
    pools = [sharded.env(executor, i)["PAGEDKV_POOL_NAME"]
             for i in range(executor.workload["spec"]["replicas"])]
    assert sorted({shard_of(pool, 2) for pool in pools}) == [0, 1], pools
    assert sharded.workload("executor") == cpu.workload("executor")
    for name in ("allocator", "gateway"):
        changed = {k for k, v in sharded.env(sharded.container(name)).items()
                   if cpu.env(cpu.container(name)).get(k) != v}
        assert changed == {"allocator": {"PAGEDKV_NUM_SHARDS"},
                           "gateway": {"PAGEDKV_ALLOCATOR_ADDR"}}[name]


def test_gpu_overlay_runs_one_executor_per_gpu_on_a_model_volume() -> None:
    # nvidia.com/gpu: 1 per executor on GPU nodes, CUDA and FlashInfer, the model (and the
    # gateway's tokenizer) from one PersistentVolumeClaim mounted read-only at /models.
    rendered = overlay("gpu")
    executor = rendered.container("executor")
    assert executor.spec["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert executor.pod["nodeSelector"] and executor.pod["tolerations"]
    env = rendered.env(executor)
    assert (env["PAGEDKV_DEVICE"], env["PAGEDKV_BACKEND"]) == ("cuda", "flashinfer")
    claims = {c["metadata"]["name"] for c in rendered.of_kind("PersistentVolumeClaim")}
    for container in (executor, rendered.container("gateway")):
        model = rendered.env(container)["PAGEDKV_MODEL"]
        (mount,) = [m for m in container.spec["volumeMounts"] if m["mountPath"] == "/models"]
        assert model.startswith("/models/") and mount["readOnly"] is True
        (volume,) = [v for v in container.pod["volumes"] if v["name"] == mount["name"]]
        assert volume["persistentVolumeClaim"]["claimName"] in claims
        assert volume["persistentVolumeClaim"]["readOnly"] is True


def test_every_container_runs_a_known_service(rendered: Rendered) -> None:
    # One container per workload, each `python -m` one of the three services.
    assert sorted(c.service for c in rendered.containers()) == [
        "allocator_svc", "executor_svc", "gateway"]
