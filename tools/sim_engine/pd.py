"""The sim engine's side of prefill/decode disaggregation (`kvroute sim-engine --role prefill|decode
--pd-protocol vllm|sglang`), shaped like the engines' own (docs/pd-disaggregation.md).

    pd = PdEngineSide(role="prefill", protocol="vllm", engine_id="sim-8100", host="127.0.0.1", port=8100)
    leg = pd.leg_of(body, prompt_blocks)        # PdLeg or None (a whole request); PdFieldError on bad fields
    await pd.receive(leg)                       # decode leg: the modelled KV transfer, before it is scheduled
    body["kv_transfer_params"] = pd.transfer_params(leg, request_id, prompt_blocks)  # vLLM prefill answer

vLLM (a KV connector):
- a request with `kv_transfer_params.do_remote_decode` true is a prefill leg: it runs as asked (the
  router asks for one token, not streamed) and its non-streamed answer carries `kv_transfer_params`
  {"do_remote_prefill": true, "do_remote_decode": false, "remote_block_ids": [0..n-1] (the prompt's
  full blocks), "remote_engine_id", "remote_request_id", "remote_host", "remote_port", "tp_size": 1},
  as NixlConnector's `request_finished` returns them;
- a request with `kv_transfer_params.do_remote_prefill` true is a decode leg: `remote_block_ids` (a
  list) and `remote_engine_id` (a string) are required (400 otherwise); it waits the transfer of
  those blocks, then runs without computing its prompt (the blocks are stored, and announced as
  KV events, as a decode engine's connector stores them);
- anything else is a whole request, whatever the role.
SGLang (`--disaggregation-mode`): a prefill or decode role needs `bootstrap_host` (a string),
`bootstrap_port` (an integer or null) and `bootstrap_room` (an integer in 0..2^63-1) on every
generation request (400 otherwise; role both serves whole requests and ignores them). The prefill
side computes the prompt and one token; the decode side waits the transfer of the prompt's full
blocks, then generates without computing the prompt.

The transfer takes `transfer_s_per_block` x blocks / speedup. A decode leg's answer says what it
received in the `x-sim-kv-transfer` header: `from=<remote_engine_id or bootstrap host:port>;
blocks=<n>[;room=<bootstrap_room>]`. GET /kvroute/pd counts legs: {"role", "protocol",
"prefill_legs", "decode_legs", "blocks_received"}.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

ROLES = ("prefill", "decode", "both")
PROTOCOLS = ("vllm", "sglang")
TRANSFER_HEADER = "x-sim-kv-transfer"
DEFAULT_TRANSFER_MS_PER_BLOCK = 0.1  # ~2 MB per 16-token block of an 8B model over a ~20 GB/s link
_ROOM_LIMIT = 2**63 - 1


class PdFieldError(ValueError):
    """A P/D field of the request is missing or malformed (`param` names it)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class PdLeg:
    kind: str  # "prefill" or "decode"
    source: str = ""  # decode: where the KV comes from (remote engine id, or bootstrap host:port)
    blocks: int = 0  # decode: blocks to transfer
    room: int | None = None  # SGLang's bootstrap room


class PdEngineSide:
    def __init__(
        self,
        role: str,
        protocol: str,
        engine_id: str,
        host: str,
        port: int,
        speedup: float = 1.0,
        transfer_s_per_block: float = DEFAULT_TRANSFER_MS_PER_BLOCK / 1000,
    ) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        if protocol not in PROTOCOLS:
            raise ValueError(f"P/D protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
        if transfer_s_per_block < 0:
            raise ValueError("the transfer time per block must not be negative")
        self.role, self.protocol, self.engine_id = role, protocol, engine_id
        self.host, self.port = host, port
        self._transfer_s_per_block = transfer_s_per_block / speedup
        self.prefill_legs = self.decode_legs = self.blocks_received = 0

    def leg_of(self, body: dict, prompt_blocks: int) -> PdLeg | None:
        """Which leg `body` is (module docstring), or None for a whole request; PdFieldError."""
        if self.protocol == "vllm":
            return self._vllm_leg(body.get("kv_transfer_params"))
        if self.role == "both":
            return None
        room = self._bootstrap(body)
        if self.role == "prefill":
            return PdLeg("prefill", room=room)
        return PdLeg("decode", f"{body['bootstrap_host']}:{body['bootstrap_port']}", prompt_blocks, room)

    def _vllm_leg(self, params: object) -> PdLeg | None:
        if params is None:
            return None
        if not isinstance(params, dict):
            raise PdFieldError("kv_transfer_params must be an object", "kv_transfer_params")
        if params.get("do_remote_decode") is True:
            return PdLeg("prefill")
        if params.get("do_remote_prefill") is not True:
            return None
        blocks, engine = params.get("remote_block_ids"), params.get("remote_engine_id")
        if not isinstance(blocks, list) or not isinstance(engine, str) or not engine:
            raise PdFieldError(
                "a remote prefill needs kv_transfer_params.remote_block_ids (a list) and "
                "remote_engine_id (a string), as the prefill worker returned them",
                "kv_transfer_params",
            )
        return PdLeg("decode", engine, len(blocks))

    @staticmethod
    def _bootstrap(body: dict) -> int:
        host, port, room = body.get("bootstrap_host"), body.get("bootstrap_port"), body.get("bootstrap_room")
        if not isinstance(host, str) or not host:
            raise PdFieldError("a disaggregated server needs bootstrap_host (the prefill server's host)", "bootstrap_host")
        if port is not None and (isinstance(port, bool) or not isinstance(port, int)):
            raise PdFieldError("bootstrap_port must be an integer or null", "bootstrap_port")
        if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room <= _ROOM_LIMIT:
            raise PdFieldError("a disaggregated server needs bootstrap_room, an integer in 0..2^63-1", "bootstrap_room")
        return room

    async def receive(self, leg: PdLeg) -> None:
        """A decode leg's KV transfer: blocks x the time per block."""
        self.decode_legs += 1
        self.blocks_received += leg.blocks
        if leg.blocks and self._transfer_s_per_block:
            await asyncio.sleep(leg.blocks * self._transfer_s_per_block)

    def transfer_params(self, request_id: str, prompt_blocks: int) -> dict:
        """What a vLLM prefill leg's answer returns for its decode leg."""
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": list(range(prompt_blocks)),
            "remote_engine_id": self.engine_id,
            "remote_request_id": request_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "tp_size": 1,
        }

    @staticmethod
    def transfer_header(leg: PdLeg) -> str:
        return f"from={leg.source};blocks={leg.blocks}" + (f";room={leg.room}" if leg.room is not None else "")

    def state(self) -> dict:
        return {
            "role": self.role,
            "protocol": self.protocol,
            "prefill_legs": self.prefill_legs,
            "decode_legs": self.decode_legs,
            "blocks_received": self.blocks_received,
        }
