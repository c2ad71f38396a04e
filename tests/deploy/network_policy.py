"""A small NetworkPolicy evaluator (ingress only): may this source open a TCP connection to
this pod's port, under these policies? Kubernetes' semantics, reduced to what pagedkv's
manifests use:

- A pod no ingress policy selects is open to everyone; once one selects it, only what some
  rule of some selecting policy admits gets in (rules add up, never subtract).
- A rule without `ports` admits every port; without `from`, every source (also outside the
  cluster).
- A `from` peer with only `podSelector` means pods of the policy's own namespace; only
  `namespaceSelector`, every pod of the namespaces it selects; both in one peer, pods that
  match both (AND); two peers in one list are alternatives (OR).

`ipBlock` peers and named ports are not modelled: they raise, rather than be misjudged.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

Labels = Mapping[str, str]


@dataclass(frozen=True, slots=True)
class Source:
    """Who connects: a pod (its namespace, that namespace's labels, its own labels), or,
    with `namespace` None, a client outside the cluster."""

    name: str
    namespace: str | None
    namespace_labels: Labels = field(default_factory=dict)
    labels: Labels = field(default_factory=dict)


def selects(selector: Mapping[str, Any] | None, labels: Labels) -> bool:
    """A label selector (matchLabels and matchExpressions); an empty one selects all."""
    selector = selector or {}
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expression in selector.get("matchExpressions") or []:
        key, operator = expression["key"], expression["operator"]
        values = expression.get("values") or []
        present = key in labels
        if operator == "In" and not (present and labels[key] in values):
            return False
        if operator == "NotIn" and present and labels[key] in values:
            return False
        if operator == "Exists" and not present:
            return False
        if operator == "DoesNotExist" and present:
            return False
    return True


def allows(policies: Iterable[Mapping[str, Any]], source: Source, namespace: str,
           labels: Labels, port: int) -> bool:
    """May `source` reach TCP `port` of a pod labelled `labels` in `namespace`?"""
    selecting = [
        p for p in policies
        if p["metadata"]["namespace"] == namespace
        and "Ingress" in (p["spec"].get("policyTypes") or ["Ingress"])
        and selects(p["spec"].get("podSelector"), labels)
    ]
    if not selecting:
        return True
    return any(
        _admits_port(rule.get("ports"), port)
        and _admits_source(rule.get("from"), p["metadata"]["namespace"], source)
        for p in selecting
        for rule in p["spec"].get("ingress") or []
    )


def _admits_port(ports: list[Mapping[str, Any]] | None, port: int) -> bool:
    if not ports:
        return True
    for entry in ports:
        if entry.get("protocol", "TCP") != "TCP":
            continue
        number = entry.get("port")
        if number is None:
            return True
        if not isinstance(number, int):
            raise NotImplementedError(f"named port {number!r}: use numbers in the policies")
        if number <= port <= entry.get("endPort", number):
            return True
    return False


def _admits_source(peers: list[Mapping[str, Any]] | None, policy_namespace: str,
                   source: Source) -> bool:
    if not peers:
        return True
    for peer in peers:
        if "ipBlock" in peer:
            raise NotImplementedError("ipBlock peers are not modelled")
        if source.namespace is None:  # outside the cluster: only ipBlocks could admit it
            continue
        if "namespaceSelector" in peer:
            namespace_ok = selects(peer["namespaceSelector"], source.namespace_labels)
        else:
            namespace_ok = source.namespace == policy_namespace
        pod_ok = "podSelector" not in peer or selects(peer["podSelector"], source.labels)
        if namespace_ok and pod_ok:
            return True
    return False
