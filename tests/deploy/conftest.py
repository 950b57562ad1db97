"""What the server exports, for checking the queries of the dashboard and the alert rules."""

import re

from server.metrics import ServerMetrics

# labels the Prometheus Operator adds to every scraped series (plus `le` of histogram buckets)
TARGET_LABELS = {"namespace", "pod", "job", "instance", "service", "container", "endpoint", "le"}
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "gauge": ("",), "info": ("_info",)}


def exported_series() -> set[str]:
    """Every series name the server's registry can expose, from the collectors' names and types."""
    return {family.name + suffix for family in ServerMetrics().registry.collect() for suffix in SUFFIXES[family.type]}


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\b(nmtserve_[a-z_]+)\b", expr))
