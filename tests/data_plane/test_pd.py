"""The P/D router mode's pure parts: the vLLM prefill leg's body, reading a prefill's answer, the
SGLang bootstrap fields, and the router flags that configure it (tests/e2e/test_pd_disaggregation.py
runs the mode over real processes)."""

from __future__ import annotations

import argparse
import json
import random

import pytest

from kvroute.addresses import parse_port_map
from kvroute.data_plane import cli as router_cli
from kvroute.data_plane.decision.policies import Candidate
from kvroute.data_plane.http.pd import parse_roles, transfer_params, vllm_prefill_body


def test_the_vllm_prefill_leg_asks_for_one_unstreamed_token_and_a_remote_decode() -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "max_tokens": 50,
        "max_completion_tokens": 50,
        "stream_options": {"include_usage": True},
        "min_tokens": 3,
        "user": "u",
    }
    prefill = vllm_prefill_body(body)
    assert prefill == {
        "model": "m",
        "messages": body["messages"],
        "stream": False,
        "max_tokens": 1,
        "max_completion_tokens": 1,
        "user": "u",
        "kv_transfer_params": {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        },
    }
    assert body["stream"] is True and body["max_tokens"] == 50  # the decode leg still gets the client's body
    assert "max_completion_tokens" not in vllm_prefill_body({"prompt": "x"})


@pytest.mark.parametrize(
    "answer,params",
    [
        (
            b'{"choices": [], "kv_transfer_params": {"do_remote_prefill": true, "remote_block_ids": [1]}}',
            {"do_remote_prefill": True, "remote_block_ids": [1]},
        ),
        (b'{"choices": [], "kv_transfer_params": null}', None),  # an engine without a KV connector
        (b'{"choices": [], "kv_transfer_params": {}}', None),
        (b"[1, 2]", None),
        (b"not json", None),
    ],
)
def test_transfer_params_are_read_from_the_prefill_answer(answer, params) -> None:
    assert transfer_params(answer) == params


def test_sglang_bootstrap_fields_name_the_prefill_worker_and_a_fresh_room() -> None:
    from kvroute.data_plane.http.pd import PdRouting

    pd = PdRouting.__new__(PdRouting)  # with_bootstrap reads only the ports and the room generator
    pd.bootstrap_ports, pd.default_bootstrap_port, pd._rng = {"p1": 9101}, 8998, random.Random(1)
    p0 = Candidate("p0", "http://10.0.0.7:8000", 16, 0, 0, 0, 0, 0, 0.0, 0, 0, 0, 0)
    p1 = Candidate("p1", "http://[fd00::1]:8000", 16, 0, 0, 0, 0, 0, 0.0, 0, 0, 0, 0)
    first, second = pd.with_bootstrap({"prompt": "x"}, p0), pd.with_bootstrap({"prompt": "x"}, p1)
    assert (first["bootstrap_host"], first["bootstrap_port"]) == ("10.0.0.7", 8998)
    assert (second["bootstrap_host"], second["bootstrap_port"]) == ("[fd00::1]", 9101)
    assert first["bootstrap_room"] != second["bootstrap_room"]
    assert all(0 <= b["bootstrap_room"] < 2**63 for b in (first, second)) and first["prompt"] == "x"
    json.dumps(first)  # the room fits JSON as an integer


def test_roles_and_bootstrap_ports_parse_or_say_why() -> None:
    assert parse_roles("a=prefill, b=decode") == {"a": "prefill", "b": "decode"}
    assert parse_roles("") == {}
    for bad in ("a", "a=both", "=prefill", "a=prefil"):
        with pytest.raises(ValueError, match="ID=prefill or ID=decode"):
            parse_roles(bad)
    assert parse_port_map("9000") == (9000, {})
    assert parse_port_map("9000,p1=9101") == (9000, {"p1": 9101})
    for bad in ("0", "70000", "p1=", "=9000", "p1=x"):
        with pytest.raises(argparse.ArgumentTypeError, match="PORT or ID=PORT"):
            parse_port_map(bad)


def router_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(exit_on_error=False)
    router_cli.add_arguments(parser)
    return parser.parse_args(["--tokenizer", "t", *argv])


def test_pd_flags_without_pd_are_refused() -> None:
    router_cli.validate(router_args("--pd", "vllm", "--pd-role", "a=prefill"))
    for flags in (("--pd-role", "a=prefill"), ("--pd-bootstrap-port", "9000")):
        with pytest.raises(ValueError, match="need --pd vllm"):
            router_cli.validate(router_args(*flags))
    with pytest.raises(argparse.ArgumentError):
        router_args("--pd", "trtllm")
