"""deploy/k8s's NetworkPolicies, evaluated (network_policy.py) for every source a cluster
may hold against every declared port of every pod: the paths open are exactly the intended
ones, in every overlay."""

from __future__ import annotations

import pytest

from tests.deploy.kube_objects import Rendered, labels_of, overlay
from tests.deploy.network_policy import Source, allows

EVERYONE = frozenset({"*"})
# Destination (workload, port) -> the sources (below) that may connect; any other pair: none.
EXPECTED_PATHS = {
    ("gateway", 50051): EVERYONE, ("gateway", 8000): EVERYONE,
    ("allocator", 50052): {"gateway"}, ("allocator", 9092): {"prometheus"},
    ("executor", 50053): {"gateway", "allocator", "executor"}, ("executor", 9093): {"prometheus"},
}


@pytest.fixture(scope="module", params=("cpu", "gpu", "cpu-sharded"))
def rendered(request: pytest.FixtureRequest) -> Rendered:
    return overlay(request.param)


def _sources(rendered: Rendered) -> list[Source]:
    namespace = rendered.namespace
    (ns_object,) = rendered.of_kind("Namespace")
    here = {"kubernetes.io/metadata.name": namespace, **ns_object["metadata"].get("labels", {})}
    default = {"kubernetes.io/metadata.name": "default"}
    monitoring = {"kubernetes.io/metadata.name": "monitoring"}
    prometheus = {"app.kubernetes.io/name": "prometheus"}
    workloads = [c.workload for c in rendered.containers()]
    return [
        *(Source(w["metadata"]["name"], namespace, here, labels_of(w)) for w in workloads),
        Source("another-pod", namespace, here, {"app": "debug"}),
        Source("gateway-lookalike-elsewhere", "default", default,
               labels_of(rendered.workload("gateway"))),
        Source("prometheus", "monitoring", monitoring, prometheus),
        Source("grafana", "monitoring", monitoring, {"app.kubernetes.io/name": "grafana"}),
        Source("prometheus-elsewhere", "default", default, prometheus),
        Source("outside-the-cluster", None),
    ]


def test_network_policies_allow_exactly_the_intended_paths(rendered: Rendered) -> None:
    # Every source against every declared port of every pod: open exactly as EXPECTED_PATHS.
    policies = rendered.of_kind("NetworkPolicy")
    sources = _sources(rendered)
    everyone = {s.name for s in sources}
    for container in rendered.containers():
        target = container.workload["metadata"]["name"]
        for port in [*container.ports().values(), 8080]:  # 8080: a port nobody declared
            allowed = {s.name for s in sources if allows(
                policies, s, rendered.namespace, labels_of(container.workload), port)}
            expected = EXPECTED_PATHS.get((target, port), set())
            assert allowed == (everyone if expected == EVERYONE else expected), (target, port)
    # Any other pod of the namespace (a debugging shell, a sidecar job): closed to all.
    stray = {"app": "debug"}
    assert not [s.name for s in sources if allows(policies, s, rendered.namespace, stray, 80)]


@pytest.mark.parametrize(("source", "target", "port", "allowed"), [
    ("gateway", "allocator", 50052, True),
    ("executor", "allocator", 50052, False),  # an executor cannot reach the allocator
    ("allocator", "executor", 50053, True),  # Describe, to confirm a pool reset
    ("executor", "executor", 50053, True),  # ExportKV, for a KV hand-off
    ("outside-the-cluster", "executor", 50053, False),
    ("gateway-lookalike-elsewhere", "executor", 50053, False),  # another namespace
    ("outside-the-cluster", "gateway", 8000, True),
    ("prometheus", "executor", 9093, True),
    ("prometheus", "allocator", 50052, False),
])
def test_network_policy_paths(source: str, target: str, port: int, allowed: bool) -> None:
    rendered = overlay("cpu")
    (peer,) = [s for s in _sources(rendered) if s.name == source]
    labels = labels_of(rendered.workload(target))
    assert allows(rendered.of_kind("NetworkPolicy"), peer, rendered.namespace, labels,
                  port) is allowed


def test_policy_evaluator_semantics() -> None:
    # Unselected pods are open; a selecting policy admits only its rules; one peer with both
    # selectors needs both (AND), two peers need either (OR).
    pod = Source("p", "ns", {"team": "a"}, {"role": "client"})
    deny = {"metadata": {"namespace": "ns"}, "spec": {"podSelector": {}}}
    both = {"namespaceSelector": {"matchLabels": {"team": "b"}},
            "podSelector": {"matchLabels": {"role": "client"}}}
    rule = {"metadata": {"namespace": "ns"}, "spec": {
        "podSelector": {"matchLabels": {"app": "db"}}, "ingress": [{"from": [both]}]}}
    assert allows([], pod, "ns", {"app": "db"}, 1)
    assert not allows([deny], pod, "ns", {"app": "db"}, 1)
    assert not allows([deny, rule], pod, "ns", {"app": "db"}, 1)
    rule["spec"]["ingress"] = [{"from": [both, {"podSelector": {}}]}]
    assert allows([deny, rule], pod, "ns", {"app": "db"}, 1)
    assert not allows([deny, rule], Source("x", "other", {"team": "c"}), "ns", {"app": "db"}, 1)
