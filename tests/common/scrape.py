"""Scrape a metrics port over HTTP, as Prometheus does, and read samples by name and labels."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


class Samples:
    """One scrape: every sample, parsed with prometheus_client's own parser."""

    def __init__(self, text: str) -> None:
        self.families = {f.name: f for f in text_string_to_metric_families(text)}
        self.values: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
        for family in self.families.values():
            for sample in family.samples:
                self.values[(sample.name, frozenset(sample.labels.items()))] = sample.value

    def get(self, name: str, **labels: str) -> float:
        """The sample's value; 0 when the series does not exist (yet)."""
        return self.values.get((name, frozenset(labels.items())), 0.0)

    def series(self, name: str) -> dict[frozenset[tuple[str, str]], float]:
        return {labels: value for (n, labels), value in self.values.items() if n == name}


def scrape(port: int, host: str = "127.0.0.1") -> Samples:
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        return Samples(response.read().decode())
