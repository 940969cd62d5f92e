"""data_plane/access/api_keys.py: the keys file holds digests only, keys from the environment, Bearer parsing,
scopes, and the file read again when it changes."""

from __future__ import annotations

import hashlib
import os
import subprocess
import time

import pytest

from kvroute.data_plane.access import api_keys
from kvroute.data_plane.access.api_keys import ApiKeys, KeyFileError, Verdict, bearer_token, parse_key_file
from kvroute.tools.local_cluster import free_port, kvroute_argv


def sha(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def test_the_file_takes_digests_and_refuses_keys_themselves():
    keys = parse_key_file(f"# ops\n\n{sha('a')}\n{sha('b')} ci scope=route  # the CI's key\n", "keys")
    assert [(k.name, k.scope) for k in keys] == [("keys:3", "all"), ("ci", "route")]
    with pytest.raises(KeyFileError, match="keys:1: expected sha256:<64 hex digits>"):
        parse_key_file("sk-plaintext-key\n", "keys")
    with pytest.raises(KeyFileError, match="keys:1"):
        parse_key_file("sha256:abcd\n", "keys")
    with pytest.raises(KeyFileError, match="scope must be one of all, route"):
        parse_key_file(f"{sha('a')} scope=admin\n", "keys")


def test_verdicts():
    assert ApiKeys().check(None, proxied=True) == (Verdict.OPEN, None)
    keys = ApiKeys("", f"plain-key,{sha('hashed-key')}")
    assert keys.check(None, proxied=True)[0] is Verdict.MISSING
    assert keys.check("Bearer", proxied=True)[0] is Verdict.MISSING
    assert keys.check("Basic plain-key", proxied=True)[0] is Verdict.MISSING
    assert keys.check("Bearer nope", proxied=True)[0] is Verdict.INVALID
    assert keys.check("Bearer plain-key", proxied=True)[0] is Verdict.ALLOWED
    assert keys.check("bearer  hashed-key ", proxied=True)[0] is Verdict.ALLOWED
    assert bearer_token("Bearer a b") == "a b"


def test_route_scope(tmp_path):
    path = tmp_path / "keys"
    path.write_text(f"{sha('route-only')} app scope=route\n")
    keys = ApiKeys(str(path))
    assert keys.check("Bearer route-only", proxied=False)[0] is Verdict.ALLOWED
    verdict, key = keys.check("Bearer route-only", proxied=True)
    assert verdict is Verdict.FORBIDDEN and key.name == "app"


def test_the_file_is_read_again_when_it_changes_and_a_bad_one_keeps_the_last(tmp_path, monkeypatch):
    monkeypatch.setattr(api_keys, "RECHECK_S", 0.0)
    path = tmp_path / "keys"
    path.write_text(f"{sha('one')}\n")
    keys = ApiKeys(str(path))
    assert keys.check("Bearer two", proxied=True)[0] is Verdict.INVALID
    path.write_text(f"{sha('one')}\n{sha('two')}\n")
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 1_000_000))
    assert keys.check("Bearer two", proxied=True)[0] is Verdict.ALLOWED
    path.write_text("two\n")  # a key written in clear by mistake: refused, the previous keys stay
    assert keys.check("Bearer two", proxied=True)[0] is Verdict.ALLOWED


def test_the_router_refuses_a_bad_keys_file_in_one_line(tmp_path, tiny_model_dir):
    path = tmp_path / "keys"
    path.write_text("sk-plaintext\n")
    done = subprocess.run(
        kvroute_argv(
            "router",
            "--tokenizer",
            str(tiny_model_dir),
            "--port",
            str(free_port()),
            "--grpc-port",
            "off",
            "--api-keys-file",
            str(path),
        ),
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert f"kvroute router: error: {path}:1: expected sha256:<64 hex digits>" in done.stderr
