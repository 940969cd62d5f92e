"""`kvroute epp`'s flags: the router's routing flags (defined once, in data_plane/cli.py) without
the router-only ones, plus its own; and the ext_proc message handling that needs no fleet."""

from __future__ import annotations

import pytest

from kvroute.cli import parse_args
from kvroute.data_plane.epp import ROUTER_ONLY_FLAGS, host_port


def test_the_picker_takes_the_routers_routing_flags_and_not_its_listeners(tiny_model_dir) -> None:
    args = parse_args(["epp", "--tokenizer", str(tiny_model_dir), "--policy", "chwbl", "--query-timeout-ms", "7",
                       "--kv-aware-param", "load_bound=2", "--no-router-session", "--failure-mode", "FailOpen"])
    assert (args.policy, args.query_timeout_ms, args.no_router_session) == ("chwbl", 7.0, True)
    assert args.kv_aware_param == ["load_bound=2"] and args.failure_mode == "FailOpen"
    assert args.grpc_port == 9002 and args.body_mode == "streamed"
    for flag in ROUTER_ONLY_FLAGS - {"--grpc-port"}:
        assert not hasattr(args, flag.lstrip("-").replace("-", "_")), flag
    with pytest.raises(SystemExit):
        parse_args(["epp", "--tokenizer", str(tiny_model_dir), "--port", "8080"])


def test_endpoints_are_named_as_gaie_names_them() -> None:
    assert host_port("http://10.0.0.7:8000") == "10.0.0.7:8000"
    assert host_port("http://[fd00::7]:8000/") == "[fd00::7]:8000"
    assert host_port("10.0.0.7:8000") == "10.0.0.7:8000"
