"""gRPC `kvroute.v1.Router/Route`: the same decision as POST /v1/route."""

from __future__ import annotations

import grpc

from data_plane.routing import NoWorkersError, Router
from data_plane.tokenization import PromptTokenizer, TokenizationError
from kvroute.v1 import kvroute_pb2 as pb
from kvroute.v1 import kvroute_pb2_grpc as pb_grpc


class RouterGrpcService(pb_grpc.RouterServicer):
    def __init__(self, router: Router, tokenizer: PromptTokenizer, model: str, max_prompt_tokens: int) -> None:
        self.router, self.tokenizer, self.model, self.max_prompt_tokens = router, tokenizer, model, max_prompt_tokens

    async def Route(self, request: pb.RouteRequest, context: grpc.aio.ServicerContext) -> pb.RouteResponse:
        if request.model != self.model:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"model {request.model!r} is not served by this router")
        kind = request.WhichOneof("input")
        try:
            if kind == "prompt":
                tokens = self.tokenizer.encode_prompt(request.prompt)
            elif kind == "token_ids":
                tokens = list(request.token_ids.ids)
            elif kind == "messages":
                tokens = self.tokenizer.encode_chat([{"role": m.role, "content": m.content}
                                                     for m in request.messages.messages])
            else:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "one of prompt, token_ids or messages is required")
        except TokenizationError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if not tokens:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty")
        if len(tokens) > self.max_prompt_tokens:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"prompt has {len(tokens)} tokens, more than {self.max_prompt_tokens}")
        try:
            d = await self.router.decide(request.model, tokens, request.lora_name, request.cache_salt)
        except NoWorkersError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        return pb.RouteResponse(
            worker_id=d.worker_id, endpoint=d.endpoint, prompt_tokens=d.prompt_tokens, cached_tokens=d.cached_tokens,
            policy=d.policy, fail_open=d.fail_open,
            workers=[pb.WorkerScore(worker_id=c.worker_id, endpoint=c.endpoint, cached_tokens=c.cached_tokens,
                                    score=d.scores.get(c.worker_id, 0.0), inflight_requests=c.inflight_requests,
                                    load=pb.WorkerLoad(running_requests=c.running_requests,
                                                       waiting_requests=c.waiting_requests, kv_usage=c.kv_usage))
                     for c in d.candidates])
