"""`kv_aware`: the minimum estimated time to first token from the index's match, tiers and every
router's in-flight load, with a recompute penalty and a load bound (the formula: `KvAwareParams`)."""

from __future__ import annotations

import argparse
import difflib
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, fields

import xxhash

from kvroute.data_plane.decision.policies.base import (
    NEEDS_INDEX,
    Candidate,
    CandidateExplanation,
    Choice,
    Explanation,
    RoutingInput,
    make_rng,
    require_candidates,
)


@dataclass(frozen=True, slots=True)
class KvAwareParams:
    """Weights of the kv_aware cost, in prefill-token equivalents (lower is better):

        credited(w) = cached tokens, those on the cpu tier x cpu_tier_credit, on disk x disk_tier_credit
        cost(w) = max(0, prompt_tokens - credited(w))                  # prefill this request needs there
                + recompute_weight * (max_w' credited(w') - credited(w))  # of it, prefill the fleet already holds
                + pending_prefill_tokens(w)                            # prefill routers already queued there
                + queue_weight * max(0, waiting(w) - inflight(w)) * mean_prompt_tokens
                                                                       # queued there by unknown senders
                + decode_weight * max(running(w), inflight(w))         # decode pressure

    The first, third, fourth and fifth terms estimate this request's time to first token on w. The
    second prices what a cache miss costs everyone else: prefill that some worker holds is computed
    again, and its blocks evict others' on a full cache. It is what keeps a burst of one new prefix
    on the worker that got the first of them (the followers' blocks are speculatively held there)
    instead of scattering it, and what stops load noise from moving a prefix every few requests.

    Parameters (settable per router, i.e. per model: `kvroute router --kv-aware-param NAME=VALUE`,
    and in the simulator: `kvroute simulate --kv-aware-param NAME=VALUE`):
    queue_weight:       how much of a waiting request's estimated prefill lands before ours (1.0 = FCFS).
    mean_prompt_tokens: estimated uncached prefill behind each waiting request no kvroute router sent
                        (engines report a count, not tokens).
    decode_weight:      prefill tokens one running (or in-flight) request is worth: a busy decode batch
                        slows our prefill step and the decode that follows.
    recompute_weight:   see above; 0 = pure TTFT greedy (scatters bursts), 1 = a recomputed token
                        costs the fleet as much as a waited-for one.
    cpu_tier_credit, disk_tier_credit: fraction of a prefill a block on that tier saves (loading it
                        back is cheaper than recomputing, not free; 0.8 = host memory at ~5x prefill
                        speed, 0.5 = local disk / remote store at ~2x).
    load_bound, load_bound_slack_tokens: bounded load. A worker is eligible only while its pending
                        prefill plus this request's stays within load_bound x the fleet mean (with this
                        request) + slack, unless no worker has less. This is what moves a hot prefix
                        to a second (and third) worker, which then caches it too, before its holder's
                        queue explodes. 0 = off.
    temperature:        0 = minimum cost; > 0 = softmax sampling, probability ~ exp(-(cost - best) / T),
                        T in prefill tokens.
    spread_new_prefixes, spread_while_fill_below: where a prompt goes that no worker holds a block of,
                        while caches are still filling (the emptiest holds less than
                        spread_while_fill_below x the fullest's blocks): only to workers whose cache
                        holds at most spread_new_prefixes x the prompt's length more than the emptiest,
                        the cost deciding among them. The first sightings of long-lived prefixes then
                        spread by cache size (approx_tree's smallest-tree rule) instead of by the load
                        of the moment, which left some workers with twice the prefixes of others and a
                        p99 ~10 ms worse on shared-prefix. Once caches are full, block counts differ by
                        in-flight work, not by prefixes held, and the cost alone decides. 0 = off.
    inflight_prefix_credit: in the load bound, the share of a worker's pending prefill that is computing
                        blocks of this very prompt (other requests in flight there with its prefix) not
                        counted against it: this request would wait for those blocks on any worker that
                        does not hold them, by recomputing them, so their prefill is not a queue it could
                        avoid by going elsewhere. 1 = not counted; 0 = counted like any other (a prefix
                        whose first request is still prefilling is then spilled off its only holder).
    demand_half_life_s, demand_holders_headroom, demand_hard_bound: replication by sustained demand (0 =
                        off). Each router keeps, per shared prefix (the key of the deepest block the best
                        holder has cached), a rate of the requests that asked for it, decayed with this half
                        life, beside the rate of all its requests. A prefix asking for more holders than it
                        has, share x workers > holders x demand_holders_headroom, is spread by the load bound
                        as above; one whose holders can serve its demand stays on them unless a holder's work
                        passes demand_hard_bound x the fleet mean + slack (a queue no affinity is worth), so
                        a passing burst does not replicate a prefix that does not need it.
    replicate_min_requests: replication ahead of queues. A prefix asking for more holders than it has (as
                        above) whose decayed request count has reached this many goes to the cheapest eligible
                        worker that does not hold it, which then holds it (the router's in-flight claim counts
                        it as a holder at once, so one request adds one holder and replication stops when the
                        holders match the demand). The load bound alone never moves a prefix whose requests are
                        all short hits: their pending prefill stays small, but on few holders their decode
                        batches are large and every prefill step behind them slower (the simulator's
                        hot-prefix workload, 60% of requests on one prefix: two holders, p50 3-4% above
                        spreading it). The count is the evidence behind the share: a run's second request
                        would otherwise see a share of 1/2 and copy its prefix. It is the router's own count,
                        so with n routers a prefix is replicated after ~n times as many requests; scaled by n
                        instead, a router's share estimate from two or three requests copied prefixes into
                        full caches early in a run (the simulator's shared-prefix with the tight cache at 4
                        routers: p50 303 -> 491 ms). 0 = off.

    kv_fit, kv_fit_output_tokens: room in the KV cache. A request an engine cannot hold beside what it
                        holds waits there until running requests finish (a decode's length, seconds), longer
                        than any queue the load bound tolerates, and the cost's decode term cannot see it. So
                        a worker is eligible only if this request fits (while kv_fit_min_share of the workers
                        do, below; the load bound then applies among the fitting ones):
                            prompt_tokens - credited(w) + kv_fit_output_tokens
                                <= kv_fit x (kv_capacity_tokens(w) x (1 - kv_usage(w)) - pending_prefill_tokens(w))
                        with capacity and usage as the engine reports them (a worker that reports no capacity
                        fits) and the prefill routers queued there counted as not yet allocated. 0 = off.
                        kv_fit_output_tokens: the output a request is expected to hold KV for (requests
                        rarely say; max_tokens is only a bound). kv_fit_min_share: the rule applies only
                        while at least this share of the workers has room. When fewer do, the fleet's KV is
                        oversubscribed: a request waits for room wherever it goes, and sending it to
                        whichever worker has room for the moment only moves prefixes and recomputes them
                        (the simulator's tight-cache points thrashed: hit rate 63% -> 51%, p50 2.6x).
                        kv_fit_near_tokens: while fewer than that share have room, the workers with room
                        that cost at most this much more than the cheapest worker still take precedence:
                        moving there recomputes little (a short system prompt every request shares) and
                        starts now, while the cheapest waits for KV. Moves that would recompute more stay
                        off. 0 = off.
    near_tie_tokens:    while other routers decide on the same fleet (RoutingInput.other_routers, from the
                        index's answer): workers that hold as much of the prompt as the cheapest, cost at
                        most this much more and have room for it (kv_fit) are one choice, made by rendezvous
                        hashing on the prompt (below). The load a router sees is late by what the others
                        sent meanwhile, so it cannot rank them; routers deciding on one view at one instant
                        (a burst of arrivals) then spread different prompts over them instead of all sending
                        to the one cheapest worker, and still agree on one prompt. A router alone knows its
                        own in-flight work exactly: the cheapest only. 0 = the cheapest only always.

    Defaults were chosen with `kvroute simulate` over the generated suite (docs/operations.md: "Choosing kv_aware's
    weights"); they are not fitted to one workload.
    """

    queue_weight: float = 1.0
    mean_prompt_tokens: float = 2048.0
    decode_weight: float = 128.0
    recompute_weight: float = 1.0
    cpu_tier_credit: float = 0.8
    disk_tier_credit: float = 0.5
    load_bound: float = 1.25
    load_bound_slack_tokens: float = 2048.0
    temperature: float = 0.0
    spread_new_prefixes: float = 0.25
    spread_while_fill_below: float = 0.9
    inflight_prefix_credit: float = 1.0
    demand_half_life_s: float = 10.0
    demand_holders_headroom: float = 1.0
    demand_hard_bound: float = 4.0
    kv_fit: float = 1.0
    kv_fit_output_tokens: float = 128.0
    kv_fit_min_share: float = 0.5
    kv_fit_near_tokens: float = 512.0
    near_tie_tokens: float = 512.0
    replicate_min_requests: float = 8.0

    def __post_init__(self) -> None:
        for name in (
            "queue_weight",
            "mean_prompt_tokens",
            "decode_weight",
            "recompute_weight",
            "load_bound_slack_tokens",
            "temperature",
            "spread_new_prefixes",
            "demand_half_life_s",
            "demand_holders_headroom",
            "demand_hard_bound",
            "kv_fit_output_tokens",
            "near_tie_tokens",
            "replicate_min_requests",
            "kv_fit_near_tokens",
        ):
            if not getattr(self, name) >= 0:  # also rejects NaN
                raise ValueError(f"kv_aware {name} must be >= 0, got {getattr(self, name)}")
        for name in (
            "cpu_tier_credit",
            "disk_tier_credit",
            "spread_while_fill_below",
            "inflight_prefix_credit",
            "kv_fit",
            "kv_fit_min_share",
        ):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"kv_aware {name} must be in [0, 1], got {getattr(self, name)}")
        if self.load_bound and not self.load_bound >= 1.0:
            raise ValueError(f"kv_aware load_bound must be 0 (off) or >= 1.0, got {self.load_bound}")


class KvAware:
    """Minimum estimated cost (see `KvAwareParams`) among the workers within the load bound.

    Ties (an idle fleet, a new prefix) go to the worker whose cache holds the fewest blocks, so new
    prefixes spread the fleet's working set evenly (a random pick piles several groups on some
    workers, which then evict each other: the simulator showed ~1.6x the misses of a balanced
    placement); among those, rendezvous hashing on the prompt's first block no candidate holds, so
    two routers deciding on the same new prefix at the same instant still agree; the seeded
    `random.Random` only when the prompt has no full block. Never "always the first worker".
    A prefix whose demand asks for more holders than it has goes to a worker that does not hold it
    (KvAwareParams.replicate_min_requests). While other routers decide on the same fleet, near ties
    (KvAwareParams.near_tie_tokens) go to the same rendezvous hashing, so a burst decided on one view
    spreads instead of herding."""

    name = "kv_aware"
    needs = NEEDS_INDEX

    def __init__(self, params: KvAwareParams | None = None, seed: int | None = None, rng: random.Random | None = None) -> None:
        self.params = params or KvAwareParams()
        self._rng = make_rng(seed, rng)
        self.demand = PrefixDemand(self.params.demand_half_life_s) if self.params.demand_half_life_s else None
        self._last_bound = self.params.load_bound
        self._replicate = False

    def credited_tokens(self, c: Candidate) -> float:
        return self._credited([c])[0]

    def cost(self, request: RoutingInput, c: Candidate, best_credited: float = 0.0) -> float:
        """The documented cost of one candidate; `best_credited`: the most any candidate has cached."""
        credited = self._credited([c])
        return self._costs(request.prompt_tokens, [c], credited, max(best_credited, credited[0]))[0]

    def _credited(self, candidates: list[Candidate]) -> list[float]:
        p = self.params
        cpu_loss, disk_loss = 1.0 - p.cpu_tier_credit, 1.0 - p.disk_tier_credit
        return [
            c.cached_tokens - cpu_loss * c.cpu_cached_tokens - disk_loss * c.disk_cached_tokens
            if c.cpu_cached_tokens or c.disk_cached_tokens
            else c.cached_tokens
            for c in candidates
        ]

    def _costs(self, prompt: int, candidates: list[Candidate], credited: list[float], best: float) -> list[float]:
        """The one copy of the formula: uncached prefill + recompute_weight x recomputed + queued
        work. One loop over every candidate with no call per candidate: it runs on every decision."""
        p = self.params
        waiting_tokens, decode, recompute = p.queue_weight * p.mean_prompt_tokens, p.decode_weight, p.recompute_weight
        out = []
        for c, cr in zip(candidates, credited):
            inflight = c.inflight_requests
            waiting = c.waiting_requests - inflight  # engine-counted waiting that kvroute did not send
            running = c.running_requests
            out.append(
                (prompt - cr if cr < prompt else 0.0)
                + recompute * (best - cr)
                + c.pending_prefill_tokens
                + (waiting_tokens * waiting if waiting > 0 else 0.0)
                + decode * (running if running > inflight else inflight)
            )
        return out

    def choose(self, request: RoutingInput, candidates: list[Candidate]) -> Choice:
        require_candidates(candidates)
        p = self.params
        credited = self._credited(candidates)
        prompt = request.prompt_tokens
        costs = self._costs(prompt, candidates, credited, max(credited))
        scores = dict(zip([c.worker_id for c in candidates], costs))
        self._replicate = False
        if p.load_bound and len(candidates) > 1:
            self._last_bound = self._bound_for(request, candidates, credited)
        pool, pool_costs, _, _ = self._eligible(candidates, credited, prompt, costs)
        if p.spread_new_prefixes and len(pool) > 1 and not max(credited):
            pool, pool_costs = self._spread_new(pool, pool_costs, prompt)
        if p.temperature > 0:
            return Choice(self._sample(pool_costs, pool), scores)
        return Choice(self._lowest(request, pool, pool_costs), scores)

    def _lowest(self, request: RoutingInput, pool: list[Candidate], costs: list[float]) -> Candidate:
        """The minimum cost; near ties (with other routers, see KvAwareParams.near_tie_tokens) by
        rendezvous hashing, exact ties by the fewest cached blocks first."""
        low = min(costs)
        if self.params.near_tie_tokens and request.other_routers:
            cheapest = next(c for c, cost in zip(pool, costs) if cost == low)
            held, prompt, limit = cheapest.cached_tokens, request.prompt_tokens, low + self.params.near_tie_tokens
            near = [
                c for c, cost in zip(pool, costs) if cost <= limit and c.cached_tokens == held and self._has_room(c, prompt, held)
            ]
            if len(near) > 1 or (near and near[0] is not cheapest):
                return self._tie_break(request, near)
        limit = low + 1e-9 * max(1.0, abs(low))
        tied = [c for c, cost in zip(pool, costs) if cost <= limit]
        if len(tied) > 1:
            fewest = min(c.worker_cached_blocks for c in tied)
            tied = [c for c in tied if c.worker_cached_blocks == fewest]
        return tied[0] if len(tied) == 1 else self._tie_break(request, tied)

    def explain(self, request: RoutingInput, candidates: list[Candidate], choice: Choice) -> Explanation:
        """`choose`'s steps taken apart for `choice` (only when a caller asks: POST /v1/route?explain=1,
        Route with `explain`): each candidate's cost terms (`_terms`, which sum to its cost), whether
        the load bound and the spread rule kept it, and why the winner won."""
        require_candidates(candidates)
        p = self.params
        credited = self._credited(candidates)
        best, prompt = max(credited), request.prompt_tokens
        costs = self._costs(prompt, candidates, credited, best)
        bounded = bool(p.load_bound) and len(candidates) > 1
        # The bound, and whether to replicate, are what `choose` used for this request (with demand
        # tracking they depend on what came before).
        pool, pool_costs, fitting, within = self._eligible(candidates, credited, prompt, costs)
        in_bound = {candidates[i].worker_id for i in within}
        replicating = len(pool) < len(within)
        fits = set(range(len(candidates))) if fitting is None else set(fitting)
        left_out = [i for i in range(len(candidates)) if i not in fits]
        unfit = [candidates[i].worker_id for i in left_out if not self._has_room(candidates[i], prompt, credited[i])]
        far = [candidates[i].worker_id for i in left_out if candidates[i].worker_id not in unfit]
        spreading = bool(p.spread_new_prefixes) and len(pool) > 1 and not best
        if spreading:
            pool, pool_costs = self._spread_new(pool, pool_costs, prompt)
        in_spread = {c.worker_id for c in pool}
        workers = [
            CandidateExplanation(
                c.worker_id,
                cost,
                self._terms(prompt, c, cr, best),
                cr,
                c.worker_id in in_bound if bounded or left_out else None,
                c.worker_id in in_spread if spreading else None,
            )
            for c, cr, cost in zip(candidates, credited, costs)
        ]
        steps = []
        if unfit:
            steps.append(f"no room in the KV cache of {', '.join(unfit)} for this request beside what they hold")
        if far:
            steps.append(
                f"most workers lack room, so only those with room within kv_fit_near_tokens "
                f"({p.kv_fit_near_tokens:g}) of the lowest cost were considered: left out {', '.join(far)}"
            )
        if bounded and len(in_bound) < len(candidates) - len(left_out):
            out = [c.worker_id for i, c in enumerate(candidates) if c.worker_id not in in_bound and i in fits]
            steps.append(
                f"the load bound ({self._last_bound:g} x the fleet's mean pending prefill + "
                f"{p.load_bound_slack_tokens:g} tokens) left out {', '.join(out)}"
            )
        if replicating:
            steps.append(
                f"this prefix's demand asks for more holders than it has (replicate_min_requests "
                f"{p.replicate_min_requests:g} reached): only workers that do not hold it were considered"
            )
        if spreading and len(in_spread) < len(in_bound):  # spreading: nothing cached, so no replication
            steps.append(
                f"no worker holds the prompt and caches are still filling: only the {len(in_spread)} "
                "workers with the emptiest caches were considered"
            )
        steps.append(self._why_winner(request, choice.worker.worker_id, pool, pool_costs))
        return Explanation(self.name, "; ".join(steps), workers, {f.name: getattr(p, f.name) for f in fields(p)})

    def _why_winner(self, request: RoutingInput, chosen: str, pool: list[Candidate], costs: list[float]) -> str:
        if self.params.temperature > 0:
            return (
                f"{chosen} drawn at temperature {self.params.temperature:g} among {len(pool)} eligible workers "
                "(probability ~ exp(-(cost - lowest) / temperature))"
            )
        mine = next((cost for c, cost in zip(pool, costs) if c.worker_id == chosen), None)
        if mine is None:
            return f"{chosen} chosen"
        others = sorted((cost, c.worker_id) for c, cost in zip(pool, costs) if c.worker_id != chosen)
        if not others:
            return f"{chosen} is the only eligible worker (cost {mine:.0f})"
        runner_cost, runner = others[0]
        if runner_cost < mine:  # a near tie (only with other routers deciding on the fleet)
            return (
                f"{chosen} costs {mine:.0f}, within near_tie_tokens ({self.params.near_tie_tokens:g}) of the "
                f"lowest ({runner} at {runner_cost:.0f}) and holds as much of the prompt: while "
                f"{request.other_routers} other routers decide on this fleet, rendezvous hashing on the "
                "prompt chooses among such workers"
            )
        if runner_cost - mine <= 1e-9 * max(1.0, abs(mine)):
            tied = [w for cost, w in others if cost - mine <= 1e-9 * max(1.0, abs(mine))]
            return (
                f"{chosen} tied on cost ({mine:.0f}) with {', '.join(tied)}: the fewest cached blocks, then "
                "rendezvous hashing on the prompt's first block no candidate holds"
            )
        return (
            f"{chosen} has the lowest cost ({mine:.0f}) of {len(pool)} eligible workers; next {runner} at "
            f"{runner_cost:.0f} (+{runner_cost - mine:.0f} prefill-token equivalents)"
        )

    def _terms(self, prompt: int, c: Candidate, credited: float, best: float) -> dict[str, float]:
        """`_costs`' formula for one candidate, term by term, summed in `_costs`' order (so the sum is
        the cost exactly; tests/data_plane/test_explain.py holds the two together)."""
        p = self.params
        waiting = c.waiting_requests - c.inflight_requests
        running, inflight = c.running_requests, c.inflight_requests
        return {
            "uncached_prefill": float(prompt - credited) if credited < prompt else 0.0,
            "recompute": p.recompute_weight * (best - credited),
            "pending_prefill": float(c.pending_prefill_tokens),
            "queue": p.queue_weight * p.mean_prompt_tokens * waiting if waiting > 0 else 0.0,
            "decode": p.decode_weight * (running if running > inflight else inflight),
        }

    def _tie_break(self, request: RoutingInput, tied: list[Candidate]) -> Candidate:
        bs = tied[0].block_size
        chain = request.chains.get(bs)
        if not chain:
            return self._rng.choice(tied)
        key = chain[min(len(chain) - 1, max(c.cached_tokens for c in tied) // bs)].to_bytes(8, "little")
        return max(tied, key=lambda c: (xxhash.xxh3_64_intdigest(key + c.worker_id.encode()), c.worker_id))

    def _bound_for(self, request: RoutingInput, candidates: list[Candidate], credited: list[float]) -> float:
        """The load bound for this request: `load_bound`, or with demand tracking `demand_hard_bound`
        for a prefix whose holders can serve its demand (this request is counted first). Sets
        `_replicate` for a prefix short of holders with replicate_min_requests reached."""
        p, demand = self.params, self.demand
        if demand is None:
            return p.load_bound
        best = max(credited)
        bs = candidates[0].block_size
        chain = request.chains.get(bs)
        if not best or not chain:
            demand.count(None, request.now_s)
            return p.load_bound
        anchor = chain[min(len(chain), int(best) // bs) - 1] if int(best) >= bs else chain[0]
        share = demand.count(anchor, request.now_s)
        holders = sum(1 for cr in credited if _holds(cr, best))
        if share * len(candidates) > holders * p.demand_holders_headroom:
            self._replicate = bool(p.replicate_min_requests) and demand.requests(anchor) >= p.replicate_min_requests
            return p.load_bound
        return max(p.load_bound, p.demand_hard_bound)

    def _eligible(
        self, candidates: list[Candidate], credited: list[float], prompt: int, costs: list[float]
    ) -> tuple[list[Candidate], list[float], list[int] | None, list[int]]:
        """The workers with room (`_fitting`), within the load bound `choose` set last and, while
        `choose` found the prefix short of holders, not holding it (when one such is left); with their
        costs, the indices of those with room (None: room left none out) and of those within the
        bound (before replication kept only non-holders)."""
        p = self.params
        fitting = self._fitting(candidates, credited, prompt, costs) if p.kv_fit and len(candidates) > 1 else None
        kept: list[int] = list(range(len(candidates))) if fitting is None else fitting
        if p.load_bound and len(candidates) > 1:
            kept = self._within_bound(candidates, credited, prompt, self._last_bound, kept)
        within = kept
        if self._replicate and len(kept) > 1:
            best = max(credited)
            kept = [i for i in kept if not _holds(credited[i], best)] or kept
        pool, pool_costs = _keep(candidates, costs, kept)
        return pool, pool_costs, fitting, within

    def _fitting(self, candidates: list[Candidate], credited: list[float], prompt: int, costs: list[float]) -> list[int] | None:
        """Indices of the workers whose free KV holds this request (see KvAwareParams.kv_fit); while
        fewer than kv_fit_min_share of them do, only those within kv_fit_near_tokens of the lowest
        cost. None when all of them do, or none qualifies (then room does not tell them apart)."""
        has_room = self._has_room
        fits = [i for i, (c, cr) in enumerate(zip(candidates, credited)) if has_room(c, prompt, cr)]
        if not len(candidates) > len(fits):
            return None
        if len(fits) >= max(1.0, self.params.kv_fit_min_share * len(candidates)):
            return fits
        near = self.params.kv_fit_near_tokens
        if near and fits:
            limit = min(costs) + near
            close = [i for i in fits if costs[i] <= limit]
            if close:
                return close
        return None

    def _has_room(self, c: Candidate, prompt: int, credited: float) -> bool:
        """This request fits in `c`'s free KV (KvAwareParams.kv_fit; unknown capacity fits; kv_fit 0: all do)."""
        p = self.params
        if not c.kv_capacity_tokens or not p.kv_fit:
            return True
        free = c.kv_capacity_tokens * (1.0 - c.kv_usage) - c.pending_prefill_tokens
        return prompt - credited + p.kv_fit_output_tokens <= p.kv_fit * free

    def _within_bound(
        self, candidates: list[Candidate], credited: list[float], prompt: int, bound: float, among: list[int]
    ) -> list[int]:
        """The indices (of `among`) of workers whose pending prefill with this request's stays within
        the bound of the whole fleet's mean (or is the least of them)."""
        p = self.params
        uncached = [prompt - cr if cr < prompt else 0.0 for cr in credited]
        pending = [c.pending_prefill_tokens for c in candidates]
        credit = p.inflight_prefix_credit
        work = [
            q - min(q, credit * c.inflight_cached_tokens) + u if credit else q + u
            for q, u, c in zip(pending, uncached, candidates)
        ]
        least = min(work[i] for i in among)
        scale, total, slack = bound / len(candidates), sum(pending), p.load_bound_slack_tokens
        return [i for i in among if work[i] <= least or work[i] <= scale * (total + uncached[i]) + slack]

    def _spread_new(self, pool: list[Candidate], costs: list[float], prompt: int) -> tuple[list[Candidate], list[float]]:
        """While caches fill: the workers whose cache is within spread_new_prefixes x this prompt of
        the emptiest (see KvAwareParams)."""
        p = self.params
        held = [c.worker_cached_blocks * c.block_size for c in pool]  # tokens: block sizes may differ
        fewest = min(held)
        if fewest > p.spread_while_fill_below * max(held):
            return pool, costs
        room = fewest + p.spread_new_prefixes * prompt
        return _keep(pool, costs, [i for i, tokens in enumerate(held) if tokens <= room])

    def _sample(self, costs: list[float], pool: list[Candidate]) -> Candidate:
        low = min(costs)
        weights = [math.exp(-(cost - low) / self.params.temperature) for cost in costs]
        return self._rng.choices(pool, weights)[0]


class PrefixDemand:
    """Requests per shared prefix, decayed with a half life, beside all requests: a prefix's share of
    the demand a router sees. Kept for the prefixes seen lately (bounded), in the policy's own state."""

    MAX_PREFIXES = 65_536

    def __init__(self, half_life_s: float) -> None:
        self.decay_per_s = math.log(2) / half_life_s
        self.total = (0.0, 0.0)  # (decayed count, at)
        self.prefixes: dict[int, tuple[float, float]] = {}

    def _bump(self, value: tuple[float, float], now: float) -> tuple[float, float]:
        count, at = value
        return count * math.exp(-self.decay_per_s * max(0.0, now - at)) + 1.0, now

    def count(self, anchor: int | None, now: float) -> float:
        """Count a request (for `anchor`, None = none shared) at `now`; the anchor's share of all."""
        self.total = self._bump(self.total, now)
        if anchor is None:
            return 0.0
        prefixes = self.prefixes
        value = prefixes.pop(anchor, (0.0, now))
        prefixes[anchor] = value = self._bump(value, now)  # re-inserted: the dict's order is recency
        if len(prefixes) > self.MAX_PREFIXES:
            del prefixes[next(iter(prefixes))]
        return value[0] / self.total[0]

    def requests(self, anchor: int) -> float:
        """The anchor's decayed request count as of its last `count`."""
        return self.prefixes.get(anchor, (0.0, 0.0))[0]


def _holds(credited: float, best: float) -> bool:
    """A worker holds the request's prefix when it has at least half the best worker's credited tokens:
    the holders demand is weighed against are the ones replication moves the prefix away from."""
    return credited >= 0.5 * best


def _keep(pool: list[Candidate], costs: list[float], kept: list[int]) -> tuple[list[Candidate], list[float]]:
    """The candidates at indices `kept` with their costs (the same lists when all are kept)."""
    if len(kept) == len(pool):
        return pool, costs
    return [pool[i] for i in kept], [costs[i] for i in kept]


_KV_AWARE_FIELDS = {f.name for f in fields(KvAwareParams)}


def parse_kv_aware_params(items: Sequence[str]) -> dict[str, float]:
    """`["recompute_weight=0.5", ...]` (CLI --kv-aware-param) -> validated KvAwareParams fields."""
    out: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or name not in _KV_AWARE_FIELDS:
            close = difflib.get_close_matches(name, _KV_AWARE_FIELDS, n=1) if sep else []
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                f"--kv-aware-param {item!r}: expected NAME=VALUE with NAME one of {', '.join(sorted(_KV_AWARE_FIELDS))}{hint}"
            )
        try:
            out[name] = float(value)
        except ValueError:
            raise ValueError(f"--kv-aware-param {item!r}: {value!r} is not a number") from None
    KvAwareParams(**out)  # validates ranges
    return out


def kv_aware_param(text: str) -> str:
    """argparse type: one --kv-aware-param NAME=VALUE, its name, number and range checked when the
    command line (or a config file, or KVROUTE_KV_AWARE_PARAM) is parsed."""
    try:
        parse_kv_aware_params([text])
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--kv-aware-param ")) from None
    return text
