"""verispec.server.metrics: the Prometheus counters and histograms the scheduler's hooks feed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("prometheus_client")

from verispec.batch import BatchEvent, BatchRequest  # noqa: E402
from verispec.server.metrics import ServerMetrics  # noqa: E402

LABELS = {"model_name": "m"}


def value(metrics: ServerMetrics, name: str, **labels) -> float | None:
    return metrics.registry.get_sample_value(f"verispec:{name}", {**LABELS, **labels})


def test_spec_decode_counters_sum_a_finished_requests_rounds():
    metrics = ServerMetrics("m")
    assert value(metrics, "spec_decode_num_drafts_total") == 0.0  # exported from the start
    rounds = [SimpleNamespace(drafted=3, accepted=2), SimpleNamespace(drafted=0, accepted=0),
              SimpleNamespace(drafted=3, accepted=3), SimpleNamespace(drafted=2, accepted=0)]
    handle = SimpleNamespace(arrived=0.0)
    metrics.on_finish(handle, BatchEvent("a", [], "stop", stats=SimpleNamespace(rounds=rounds)), "stop")
    assert value(metrics, "spec_decode_num_drafts_total") == 3  # the gamma-0 round does not count
    assert value(metrics, "spec_decode_num_draft_tokens_total") == 8
    assert value(metrics, "spec_decode_num_accepted_tokens_total") == 5
    per_position = [value(metrics, "spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(3)]
    assert per_position == [2, 2, 1]
    assert value(metrics, "request_success_total", finished_reason="stop") == 1
    assert value(metrics, "request_success_total", finished_reason="length") == 0


def test_the_first_tokens_time_to_first_token_then_gaps_with_zeros_within_a_round():
    metrics = ServerMetrics("m")
    handle = SimpleNamespace(arrived=10.0, admitted=10.5, last_emit=None,
                             request=BatchRequest("a", [1, 2, 3, 4]))
    metrics.on_admit(handle)
    metrics.on_tokens(handle, 1, now=11.0)
    handle.last_emit = 11.0
    metrics.on_tokens(handle, 3, now=11.25)  # one real gap, two tokens of the same round
    assert value(metrics, "request_queue_time_seconds_sum") == 0.5
    assert value(metrics, "prompt_tokens_total") == 4
    assert value(metrics, "time_to_first_token_seconds_count") == 1
    assert value(metrics, "time_to_first_token_seconds_sum") == 1.0
    assert value(metrics, "inter_token_latency_seconds_count") == 3
    assert value(metrics, "inter_token_latency_seconds_sum") == 0.25
    assert value(metrics, "inter_token_latency_seconds_bucket", le="0.0") == 2
    assert value(metrics, "generation_tokens_total") == 4


def test_gauges_failures_and_the_exposition():
    metrics = ServerMetrics("m")
    metrics.set_queue(running=3, waiting=7)
    metrics.on_rejected("queue_full")
    metrics.on_failure(SimpleNamespace(), "engine_error")
    assert value(metrics, "num_requests_running") == 3 and value(metrics, "num_requests_waiting") == 7
    assert value(metrics, "request_failure_total", reason="queue_full") == 1
    text = metrics.exposition().decode()
    assert 'verispec:request_failure_total{model_name="m",reason="engine_error"} 1.0' in text
    assert metrics.content_type.startswith("text/plain")
    assert ServerMetrics("m").registry is not metrics.registry  # several apps in one process
