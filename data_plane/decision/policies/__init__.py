"""Routing policies behind one interface, and the table that names them.

    policy = make_policy("kv_aware", seed=0, decode_weight=32.0)
    choice = policy.choose(RoutingInput(model, prompt_tokens), [Candidate(...), ...])
    choice.worker        # the chosen Candidate
    choice.scores        # worker_id -> estimated cost, lower is better (the retry order)

The interface (`Candidate`, `RoutingInput`, `Choice`, `RoutingPolicy`) is defined in `base.py`
and re-exported here; one module per policy family, each policy's docstring gives its formula:

    module          policies                           reads                       `needs`
    load_balancing  round_robin, random, least_loaded  load only                   nothing
    session         session                            the session key, load       nothing
    chwbl           chwbl                              the first prompt tokens     tokens
    approx_tree     approx_tree                        the prompt's tokens         tokens
    kv_aware        kv_aware                           the index (KvAwareParams)   tokens, block keys, index

A policy declares what it reads (`needs: PolicyNeeds`); the request path tokenizes, hashes and
queries only for a policy that needs it.

Policies are pure (no I/O, no clock), so the fleet simulator drives exactly the code the router
runs. No policy breaks ties with "always the first worker": with an empty index every candidate
ties, and that would send the whole cold fleet's traffic to one GPU. least_loaded, session (without
a key) and approx_tree draw among the tied with their own `random.Random` (`seed=` or `rng=`);
kv_aware takes the emptiest cache, then rendezvous hashing on the prompt's first unheld block (two
routers agree on a new prefix), and draws only for a prompt without a full block; chwbl's ring
walk has no ties.
"""

from __future__ import annotations

from dataclasses import fields

from kvroute.data_plane.decision.policies.approx_tree import ApproxTree, PromptTree
from kvroute.data_plane.decision.policies.base import (
    Candidate,
    CandidateExplanation,
    Choice,
    Explanation,
    PolicyNeeds,
    RoutingInput,
    RoutingPolicy,
    explain_scores,
    request_load,
)
from kvroute.data_plane.decision.policies.chwbl import PrefixHashBoundedLoad
from kvroute.data_plane.decision.policies.kv_aware import KvAware, KvAwareParams, kv_aware_param, parse_kv_aware_params
from kvroute.data_plane.decision.policies.load_balancing import LeastLoaded, RandomPolicy, RoundRobin
from kvroute.data_plane.decision.policies.session import SessionAffinity

__all__ = [
    "POLICIES",
    "ApproxTree",
    "Candidate",
    "CandidateExplanation",
    "Choice",
    "Explanation",
    "KvAware",
    "KvAwareParams",
    "LeastLoaded",
    "PolicyNeeds",
    "PrefixHashBoundedLoad",
    "PromptTree",
    "RandomPolicy",
    "RoundRobin",
    "RoutingInput",
    "RoutingPolicy",
    "SessionAffinity",
    "explain_scores",
    "kv_aware_param",
    "make_policy",
    "parse_kv_aware_params",
    "request_load",
]

POLICIES: dict[str, type] = {
    "kv_aware": KvAware,
    "round_robin": RoundRobin,
    "random": RandomPolicy,
    "least_loaded": LeastLoaded,
    "session": SessionAffinity,
    "chwbl": PrefixHashBoundedLoad,
    "approx_tree": ApproxTree,
}
_KV_AWARE_FIELDS = frozenset(f.name for f in fields(KvAwareParams))


def make_policy(name: str, **params) -> RoutingPolicy:
    """`make_policy("kv_aware", seed=1, queue_weight=0.5)`: KvAwareParams fields may be passed flat.
    `seed`/`rng` are accepted (and ignored) by round_robin too, so callers can pass them uniformly."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
    if name == "kv_aware":
        weights = {k: params.pop(k) for k in list(params) if k in _KV_AWARE_FIELDS}
        if weights:
            if params.get("params") is not None:
                raise ValueError("pass either params=KvAwareParams(...) or its fields, not both")
            params["params"] = KvAwareParams(**weights)
    elif name == "round_robin":
        params.pop("seed", None)
        params.pop("rng", None)
    try:
        return POLICIES[name](**params)
    except TypeError as exc:
        raise ValueError(f"bad parameters for policy {name!r}: {exc}") from None
