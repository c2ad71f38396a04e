"""deploy/k8s rendered offline (`kubectl kustomize`), and what the tests ask of the objects:
workloads, their containers' effective environment, the files their Secrets provide."""

from __future__ import annotations

import base64
import functools
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

K8S_DIR = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
WORKLOAD_KINDS = ("Deployment", "StatefulSet")
# The label a StatefulSet's controller puts on each pod: its ordinal (Kubernetes >= 1.28).
POD_INDEX = "metadata.labels['apps.kubernetes.io/pod-index']"

Obj = dict[str, Any]


def render(directory: Path) -> list[Obj]:
    """Every object `kubectl kustomize` renders for a kustomization directory."""
    # A set-up requirement of the suite (make k8s-check), not optional: absent, it fails.
    assert shutil.which("kubectl") is not None, (
        "kubectl is not installed: the manifests cannot be rendered (install the kubectl "
        "client; no cluster is needed)")
    return list(_render(str(directory)))


@functools.cache
def _render(directory: str) -> tuple[Obj, ...]:
    done = subprocess.run(["kubectl", "kustomize", directory], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, f"kubectl kustomize {directory} failed:\n{done.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(done.stdout) if doc)


@dataclass(frozen=True, slots=True)
class Container:
    workload: Obj
    spec: Obj  # the container itself

    @property
    def pod(self) -> Obj:
        return self.workload["spec"]["template"]["spec"]

    @property
    def service(self) -> str:
        """The module it runs: `python -m <service>`."""
        command = [*self.spec.get("command", []), *self.spec.get("args", [])]
        assert command[:2] == ["python", "-m"], f"{self.spec['name']}: runs {command}"
        return command[2]

    def ports(self) -> dict[str, int]:
        return {p.get("name", str(p["containerPort"])): p["containerPort"]
                for p in self.spec.get("ports", [])}


@dataclass(frozen=True, slots=True)
class Rendered:
    name: str
    objects: list[Obj]

    def of_kind(self, kind: str) -> list[Obj]:
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, name: str) -> Obj:
        found = [o for o in self.of_kind(kind) if o["metadata"]["name"] == name]
        assert len(found) == 1, f"{self.name}: expected one {kind} {name}, found {len(found)}"
        return found[0]

    def workload(self, name: str) -> Obj:
        found = [o for o in self.objects
                 if o["kind"] in WORKLOAD_KINDS and o["metadata"]["name"] == name]
        assert len(found) == 1, f"{self.name}: expected one workload {name}"
        return found[0]

    def containers(self) -> Iterator[Container]:
        for kind in WORKLOAD_KINDS:
            for workload in self.of_kind(kind):
                for spec in workload["spec"]["template"]["spec"]["containers"]:
                    yield Container(workload, spec)

    def container(self, workload: str) -> Container:
        return next(c for c in self.containers() if c.workload["metadata"]["name"] == workload)

    @property
    def namespace(self) -> str:
        (namespace,) = {o["metadata"].get("namespace") for o in self.objects
                        if o["kind"] != "Namespace"}
        return namespace

    def env(self, container: Container, ordinal: int = 0) -> dict[str, str]:
        """The container's environment as the pod sees it: its ConfigMaps (envFrom, in
        order), then its own entries (literals; the downward API as a StatefulSet's pod
        `ordinal`, <name>-<ordinal>, would read it)."""
        env: dict[str, str] = {}
        for source in container.spec.get("envFrom", []):
            assert "configMapRef" in source, f"envFrom {source}: only ConfigMaps expected"
            config_map = self.get("ConfigMap", source["configMapRef"]["name"])
            env.update(config_map.get("data", {}))
        for entry in container.spec.get("env", []):
            env[entry["name"]] = self._value(container.workload, entry, ordinal)
        return env

    @staticmethod
    def _value(workload: Obj, entry: Obj, ordinal: int) -> str:
        if "value" in entry:
            return str(entry["value"])
        source = entry["valueFrom"]
        if "fieldRef" in source:
            # A pod's name and ordinal are stable only in a StatefulSet.
            assert workload["kind"] == "StatefulSet", f"{entry['name']}: from a fieldRef"
            fields = {"metadata.name": f"{workload['metadata']['name']}-{ordinal}",
                      POD_INDEX: str(ordinal)}
            return fields[source["fieldRef"]["fieldPath"]]
        if "resourceFieldRef" in source:
            return "1"
        raise AssertionError(f"{entry['name']}: unexpected env source {source}")

    def secret_file(self, container: Container, path: str) -> tuple[str, str] | None:
        """(Secret name, key) behind the file `path` in this container, or None when no
        Secret volume provides it."""
        mount_dir, _, file_name = path.rpartition("/")
        volumes = {v["name"]: v for v in container.pod.get("volumes", [])}
        for mount in container.spec.get("volumeMounts", []):
            if mount["mountPath"].rstrip("/") != mount_dir or "subPath" in mount:
                continue
            volume = volumes[mount["name"]]
            sources = ([{"secret": {"name": volume["secret"]["secretName"],
                                    "items": volume["secret"].get("items")}}]
                       if "secret" in volume else volume.get("projected", {}).get("sources", []))
            for source in sources:
                secret = source.get("secret")
                if secret is None:
                    continue
                items = secret.get("items") or [{"key": k, "path": k}
                                                for k in self.secret_data(secret["name"])]
                for item in items:
                    if item["path"] == file_name:
                        return secret["name"], item["key"]
        return None

    def secret_data(self, name: str) -> dict[str, bytes]:
        data = self.get("Secret", name).get("data") or {}
        return {key: base64.b64decode(value) for key, value in data.items()}


def overlay(name: str) -> Rendered:
    """deploy/k8s/overlays/<name>, rendered."""
    return Rendered(name, render(K8S_DIR / "overlays" / name))


def labels_of(workload: Obj) -> dict[str, str]:
    """The labels of a workload's pods."""
    return workload["spec"]["template"]["metadata"]["labels"]
