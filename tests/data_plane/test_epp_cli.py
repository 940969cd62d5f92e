"""`kvroute epp`'s flags: the router's routing flags (defined once, in data_plane/cli.py) without
the router-only ones, plus its own; and what needs no fleet: the failure mode, on a picker served
over real gRPC in this process, deciding over a static fleet."""

from __future__ import annotations

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_grpc

from kvroute.cli import parse_args
from kvroute.data_plane.epp.picker import EndpointPicker, host_port
from kvroute.data_plane.epp_cli import ROUTER_ONLY_FLAGS
from kvroute.data_plane.service.routing_service import build_routing_service
from kvroute.tools.ext_proc_client import EnvoyExtProcStream
from kvroute.tools.local_cluster import free_port


def test_the_picker_takes_the_routers_routing_flags_and_not_its_listeners(tiny_model_dir) -> None:
    args = parse_args(
        [
            "epp",
            "--tokenizer",
            str(tiny_model_dir),
            "--policy",
            "kv_aware",
            "--query-timeout-ms",
            "7",
            "--kv-aware-param",
            "load_bound=2",
            "--no-router-session",
            "--failure-mode",
            "FailOpen",
        ]
    )
    assert (args.policy, args.query_timeout_ms, args.no_router_session) == ("kv_aware", 7.0, True)
    assert args.kv_aware_param == ["load_bound=2"] and args.failure_mode == "FailOpen"
    assert args.grpc_port == 9002 and args.body_mode == "streamed"
    for flag in ROUTER_ONLY_FLAGS - {"--grpc-port"}:
        assert not hasattr(args, flag.lstrip("-").replace("-", "_")), flag
    with pytest.raises(SystemExit):
        parse_args(["epp", "--tokenizer", str(tiny_model_dir), "--port", "8080"])
    with pytest.raises(SystemExit):  # the router's own checks of flags that only fail together
        parse_args(["epp", "--tokenizer", str(tiny_model_dir), "--policy", "chwbl", "--kv-aware-param", "load_bound=2"])


def test_endpoints_are_named_as_gaie_names_them() -> None:
    assert host_port("http://10.0.0.7:8000") == "10.0.0.7:8000"
    assert host_port("http://[fd00::7]:8000/") == "[fd00::7]:8000"
    assert host_port("10.0.0.7:8000") == "10.0.0.7:8000"


# ---------------------------------------------------------------- failure mode, in process over real gRPC


async def _serve_picker(tiny_model_dir, fail_open: bool):
    """A picker on a real gRPC server in this process, deciding over a static fleet (the control plane
    address answers nothing: the router falls back to --static-workers)."""
    args = parse_args(
        [
            "epp",
            "--tokenizer",
            str(tiny_model_dir),
            "--control-plane",
            f"127.0.0.1:{free_port()}",
            "--static-workers",
            "w0=http://10.0.0.1:8000,w1=http://10.0.0.2:8000",
        ]
    )
    service = build_routing_service(args, "epp")
    picker = EndpointPicker(service, fail_open=fail_open)
    server = grpc.aio.server()
    port = server.add_insecure_port("127.0.0.1:0")
    ext_grpc.add_ExternalProcessorServicer_to_server(picker, server)
    await server.start()
    return server, service, f"127.0.0.1:{port}"


@pytest.mark.parametrize("fail_open", [False, True])
async def test_an_internal_error_follows_the_failure_mode(tiny_model_dir, fail_open: bool) -> None:
    """FailClose: a 500 in place. FailOpen: no destination at all, the body passed on, so Envoy's own
    load balancer picks. Before the error is provoked, the same picker decides over the static fleet."""
    server, service, address = await _serve_picker(tiny_model_dir, fail_open)
    body = b'{"model": "tiny-llama", "prompt": "hello there"}'
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = ext_grpc.ExternalProcessorStub(channel)
            picked = await EnvoyExtProcStream(stub, "streamed").request("/v1/completions", body)
            assert picked.endpoint in ("10.0.0.1:8000", "10.0.0.2:8000") and picked.body == body

            async def broken(*args, **kwargs):
                raise RuntimeError("a bug in the decision")

            service.router.decide = broken  # the one way to make the router's own code fail on demand
            picked = await EnvoyExtProcStream(stub, "streamed").request(
                "/v1/completions", body, headers={"x-gateway-destination-endpoint": "169.254.169.254:80"}
            )
    finally:
        await server.stop(None)
        await service.control_plane.close()
    if fail_open:
        assert picked.status == 0 and picked.endpoint == "" and picked.metadata_endpoint == "" and picked.body == body
        assert picked.removed == ["x-gateway-destination-endpoint"]  # the client's own choice does not steer Envoy
    else:
        assert picked.status == 500 and b"endpoint picker failed" in picked.error_body


async def test_envoys_body_modes_none_and_streamed(tiny_model_dir) -> None:
    """request_body_mode NONE: the headers are all Envoy sends, so the picker decides on them.
    STREAMED: refused with FAILED_PRECONDITION naming the modes that work (the headers would go
    upstream before the body is seen)."""
    server, service, address = await _serve_picker(tiny_model_dir, False)

    def first(mode: int) -> ext.ProcessingRequest:
        msg = ext.ProcessingRequest(
            request_headers=ext.HttpHeaders(
                headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":path", raw_value=b"/v1/completions")])
            )
        )
        msg.protocol_config.request_body_mode = mode
        return msg

    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = ext_grpc.ExternalProcessorStub(channel)
            call = stub.Process()
            await call.write(first(processing_mode_pb2.ProcessingMode.NONE))
            answer = await call.read()
            chosen = [o.header.raw_value for o in answer.request_headers.response.header_mutation.set_headers]
            assert chosen and chosen[0] in (b"10.0.0.1:8000", b"10.0.0.2:8000")
            await call.done_writing()
            call = stub.Process()
            await call.write(first(processing_mode_pb2.ProcessingMode.STREAMED))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call.read()
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "FULL_DUPLEX_STREAMED" in refused.value.details()
    finally:
        await server.stop(None)
        await service.control_plane.close()
