"""vLLM's `lora_requests_info` gauge under pdserve's prefix, from an engine's SchedulerStats.

    pdserve:lora_requests_info{max_lora="2", running_lora_adapters="a,b",
                               waiting_lora_adapters="c"} 1.7e9

The labels carry the state; the value is the time of the snapshot (vLLM's
`set_to_current_time`), so a dashboard keeps the latest series.
"""

from __future__ import annotations

import time

from prometheus_client.core import GaugeMetricFamily

from engine.scheduler_output import SchedulerStats

NAME = "pdserve:lora_requests_info"
DOC = "Running stats on lora requests."
LABELS = ["max_lora", "running_lora_adapters", "waiting_lora_adapters"]


def lora_requests_info(
    stats: SchedulerStats, max_loras: int, role: str | None = None
) -> GaugeMetricFamily:
    """The gauge's one sample for `stats` (`role`: the worker's, as a label of its own)."""
    labels = [*LABELS, "role"] if role is not None else LABELS
    gauge = GaugeMetricFamily(NAME, DOC, labels=labels)
    values = [str(max_loras), ",".join(stats.running_lora_adapters),
              ",".join(stats.waiting_lora_adapters)]
    gauge.add_metric([*values, role] if role is not None else values, time.time())
    return gauge
