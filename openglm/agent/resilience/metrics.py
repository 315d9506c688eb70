"""Prometheus metrics of the resilience layer: one registry per process, labelled by task; the task API
serves it at `GET /metrics`."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

# Reading field -> (metric name, help)
GAUGES = {
    "cpu_percent": ("openglm_task_cpu_percent", "CPU of the task's process tree, percent of its allotment"),
    "rss_bytes": ("openglm_task_rss_bytes", "Resident memory of the task's process tree"),
    "rss_growth_short": ("openglm_task_rss_growth_bytes_per_second", "Robust RSS growth rate, short window"),
    "rss_growth_long": ("openglm_task_rss_growth_long_bytes_per_second", "Robust RSS growth rate, long window"),
    "open_files": ("openglm_task_open_files", "Open file descriptors of the task's process tree"),
    "disk_free_bytes": ("openglm_task_disk_free_bytes", "Free space on the workspace volume"),
    "endpoint_latency_s": ("openglm_model_endpoint_latency_seconds", "Latency of the model endpoint probe"),
    "endpoint_up": ("openglm_model_endpoint_up", "1 when the model endpoint answers"),
    "gpu_ecc_errors": ("openglm_gpu_ecc_errors", "Uncorrected volatile ECC errors of the GPUs"),
    "machine_cpu_percent": ("openglm_machine_cpu_percent", "CPU of the whole machine"),
}


class ResilienceMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.gauges = {k: Gauge(name, doc, ["task"], registry=self.registry) for k, (name, doc) in GAUGES.items()}
        self.alerts = Counter("openglm_resilience_actions", "Monitor actions taken", ["task", "metric", "action"],
                              registry=self.registry)
        self.escalations = Counter("openglm_recovery_escalations", "Recovery ladder decisions",
                                   ["task", "level", "error_class"], registry=self.registry)
        self.stuck = Counter("openglm_stuck_detections", "Stuck loops detected", ["task", "kind"],
                             registry=self.registry)

    def observe(self, task: str, reading: dict):
        for key, gauge in self.gauges.items():
            value = reading.get(key)
            if isinstance(value, bool):
                value = float(value)
            if isinstance(value, (int, float)):
                gauge.labels(task=task).set(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)


METRICS = ResilienceMetrics()  # one registry per process; the agent server exposes it at /metrics
