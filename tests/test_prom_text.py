"""kvroute.prom_text: the one reader of Prometheus text expositions (engines' and kvroute's own /metrics)."""

from __future__ import annotations

import pytest

from kvroute.prom_text import metric_names, sample_sums, sample_value, samples, sums_by_label

VLLM_TEXT = (
    "# HELP vllm:prefix_cache_hits_total Prefix cache hits\n"
    "# TYPE vllm:prefix_cache_hits counter\n"
    'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 96.0\n'
    'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 32.0\n'
    'vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e+09\n'
    "# TYPE vllm:prefix_cache_queries counter\n"
    "vllm:prefix_cache_queries_total 300\n"
    'vllm:prefix_cache_queries_total{model_name="odd } label, \\"quoted\\""} 4\n'
    "# TYPE vllm:num_requests_running gauge\n"
    "vllm:num_requests_running 2.0\n"
)


def test_sums_add_label_sets_and_leave_other_samples_out() -> None:
    assert sample_sums(VLLM_TEXT, {"vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "absent"}) == {
        "vllm:prefix_cache_hits_total": 128.0,
        "vllm:prefix_cache_queries_total": 304.0,
    }


def test_a_brace_comma_or_quote_inside_a_label_value_is_part_of_the_value() -> None:
    odd = [s for s in samples(VLLM_TEXT, {"vllm:prefix_cache_queries_total"}) if s.labels]
    assert [s.labels["model_name"] for s in odd] == ['odd } label, "quoted"'] and odd[0].value == 4


def test_values_by_label() -> None:
    text = (
        "# TYPE kvroute_router_fail_open counter\n"
        'kvroute_router_fail_open_total{reason="unavailable"} 3\n'
        'kvroute_router_fail_open_total{reason="index_empty"} 1\n'
        'kvroute_router_fail_open_total{reason="unavailable",extra="x"} 2\n'
    )
    assert sums_by_label(text, "kvroute_router_fail_open_total", "reason") == {"unavailable": 5.0, "index_empty": 1.0}
    assert sample_value(text, "kvroute_router_fail_open_total", {"reason": "unavailable"}) == 5.0
    assert sample_value(text, "kvroute_router_fail_open_total", {"reason": "deadline_exceeded"}) is None
    assert sample_value(text, "kvroute_router_fail_open_total") == 6.0


def test_names_include_families_and_their_samples() -> None:
    text = (
        "# TYPE kvroute_router_request_duration_seconds histogram\n"
        'kvroute_router_request_duration_seconds_bucket{le="+Inf"} 1\n'
        "kvroute_router_request_duration_seconds_sum 0.5\n"
        "kvroute_router_request_duration_seconds_count 1\n"
    )
    assert metric_names(text) == {
        "kvroute_router_request_duration_seconds",
        "kvroute_router_request_duration_seconds_bucket",
        "kvroute_router_request_duration_seconds_sum",
        "kvroute_router_request_duration_seconds_count",
        "kvroute_router_request_duration_seconds_created",
    }
    # A labelled counter with no child yet: only its # TYPE line, yet PromQL may name its samples.
    assert metric_names("# HELP x_errors Errors\n# TYPE x_errors counter\n") == {"x_errors", "x_errors_total", "x_errors_created"}


@pytest.mark.parametrize("bad", ['ok{a="unterminated} 1\n', "ok one\n", "ok{a=b} 1\n"])
def test_a_malformed_wanted_line_is_an_error_not_a_silent_zero(bad: str) -> None:
    with pytest.raises(ValueError):
        sample_sums("ok 1\n" + bad, {"ok"})


def test_only_wanted_lines_are_parsed_but_a_whole_read_sees_every_error() -> None:
    text = "ok 1\ngarbage_line_without_value\n"
    assert sample_sums(text, {"ok"}) == {"ok": 1.0}  # another metric's line is not read at all
    with pytest.raises(ValueError):
        metric_names(text)
