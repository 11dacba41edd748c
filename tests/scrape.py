"""Reading a live /metrics endpoint the way Prometheus does: over HTTP, parsed from the text format."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


class Scrape:
    """One scrape: `value(name, **labels)` is the sample with exactly those labels (0 when absent)."""

    def __init__(self, text: str) -> None:
        self.samples = {(s.name, frozenset(s.labels.items())): s.value
                        for family in text_string_to_metric_families(text) for s in family.samples}

    @classmethod
    def from_url(cls, url: str) -> Scrape:
        with urllib.request.urlopen(url, timeout=10) as response:
            assert response.status == 200
            return cls(response.read().decode())

    def value(self, name: str, **labels: str) -> float:
        return self.samples.get((name, frozenset(labels.items())), 0.0)

    def names(self) -> set[str]:
        return {name for name, _labels in self.samples}

    def labelsets(self, name: str) -> list[dict[str, str]]:
        return [dict(labels) for sample_name, labels in self.samples if sample_name == name]
