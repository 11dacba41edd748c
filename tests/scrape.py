"""Reading a live /metrics endpoint the way Prometheus does: over HTTP, parsed from the text format."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

SUFFIXES = ("_total", "_count", "_sum", "_bucket", "_created")


def read_metrics(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        return response.read().decode()


def metrics_when_up(url: str) -> str | None:
    """The endpoint's text, or None while nothing listens there yet (a worker serves its metrics once its engine
    has loaded, so a worker its supervisor has just started again answers only some seconds later)."""
    try:
        return read_metrics(url)
    except OSError:
        return None


class Scrape:
    """One scrape: `value(name, **labels)` is the sample with exactly those labels; a metric not exported at all
    is an error (a check of "== 0" must not pass because nothing is exported)."""

    def __init__(self, text: str) -> None:
        families = list(text_string_to_metric_families(text))
        self.samples = {(s.name, frozenset(s.labels.items())): s.value for family in families for s in family.samples}
        self.families = {family.name for family in families}

    @classmethod
    def from_url(cls, url: str) -> Scrape:
        return cls(read_metrics(url))

    def value(self, name: str, **labels: str) -> float:
        """The sample; 0 when the metric is exported but not with these labels (a counter not yet incremented)."""
        family = next((name.removesuffix(suffix) for suffix in SUFFIXES if name.endswith(suffix)), name)
        if name not in self.names() and family not in self.families:
            raise AssertionError(f"metric {name} is not exported (exported: {sorted(self.names())[:20]}...)")
        return self.samples.get((name, frozenset(labels.items())), 0.0)

    def names(self) -> set[str]:
        return {name for name, _labels in self.samples}

    def labelsets(self, name: str) -> list[dict[str, str]]:
        return [dict(labels) for sample_name, labels in self.samples if sample_name == name]
