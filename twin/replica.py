"""One simulated sampler replica: requests share its throughput (processor sharing), at request granularity.

Each running request decodes one token per engine step; a step at batch n and mean context L takes
`rates.decode_step_s(n, L)` seconds, so every running request progresses at 1 / step_s tokens/s, and
the rate only changes when a request arrives or leaves. The replica keeps a *virtual clock* `v_tokens`
(tokens each running request has received since time 0): a request arriving when the clock reads V
with R tokens to decode finishes when the clock reads V + R. So the next completion is the smallest
finish mark, reached after (mark - V) * step_s seconds: one heap pop per completion, no per-token
events, whatever the batch. Prefill is compute-bound and serial: admitting a request stalls decoding
for `rates.prefill_s(new_tokens)` (only the tokens not already in the session's prefix cache).
KV capacity bounds the batch: a request reserves its context + reply tokens; what does not fit waits
in FIFO order. Weight versions: `set_version` switches the weights between tokens (in-flight sync),
splitting each running request's tokens by version; `drain` stops admission until the batch empties.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol


class ReplicaRates(Protocol):
    """What the twin needs from the cost model for one replica (costmodel's ReplicaModel fits)."""
    kv_capacity_tokens: float
    price_usd_per_hour: float
    cold_start_s: float

    def decode_step_s(self, batch: int, context_tokens: float) -> float: ...
    def prefill_s(self, tokens: float) -> float: ...


@dataclass(eq=False, slots=True)
class Request:
    """One turn of one session on one replica. (The world submits its sessions themselves, which carry the
    same fields, so a turn allocates nothing; `tokens_by_version` then accumulates the session's tokens.)"""
    session: object                  # the world's session (opaque here)
    new_tokens: int                  # tokens to prefill (not in the prefix cache)
    reply_tokens: int                # tokens to decode
    context_tokens: int              # context before this turn's reply (prefix + new tokens)
    on_done: Callable[[Request, bool], None]  # called with ok=False when the replica is lost
    finish_v: float = 0.0            # virtual-clock mark at which it is done
    mark_v: float = 0.0              # virtual clock at admission or at the last version switch
    version: int = 0                 # weights the current stretch of tokens is sampled with
    tokens_by_version: dict[int, int] = field(default_factory=dict)  # versions with no tokens stay out
    generated: int = 0               # tokens decoded for this request so far (all versions)


class Replica:
    """A processor-sharing server. The world calls `submit`, `advance_to`, `complete_due`, `next_event_s`.

    Hot paths (advance, admit, complete) read the rates through bound methods cached at construction and
    recompute the step time once per admission/completion burst, not once per request (the result is the
    same: it depends only on the batch after the burst)."""

    __slots__ = ("group", "index", "rates", "version", "max_running", "up", "draining", "v_tokens", "t_s",
                 "stall_until_s", "running", "waiting", "kv_used_tokens", "_ctx_sum", "_finish_sum",
                 "_waiting_tokens", "_seq", "_step_s", "busy_s", "tokens_generated", "idle_since_s", "gen",
                 "wake_at", "pending", "_kv_cap", "_decode_step_s", "_prefill_s", "__dict__")

    def __init__(self, group: str, index: int, rates: ReplicaRates, version: int = 0) -> None:
        self.group, self.index, self.rates = group, index, rates
        self.version = version
        self.max_running = int(getattr(rates, "max_running", 1 << 30))
        self.up = True
        self.draining = False
        self.v_tokens = 0.0              # the virtual clock (tokens per running request)
        self.t_s = 0.0                   # time the clock was last advanced to
        self.stall_until_s = 0.0         # prefill (or weight load) in progress until then
        self.running: list[tuple[float, int, Request]] = []  # heap of (finish_v, seq, request)
        self.waiting: deque[Request] = deque()
        self.kv_used_tokens = 0.0
        self._ctx_sum = 0.0              # sum of running requests' mean contexts
        self._finish_sum = 0.0           # sum of running requests' finish marks (outstanding work)
        self._waiting_tokens = 0
        self._seq = 0
        self._step_s = 0.0               # seconds per token per request at the current batch
        self.busy_s = 0.0                # time with at least one running request (utilization)
        self.tokens_generated = 0
        self.idle_since_s: float | None = 0.0
        self.gen = 0                     # the world's wake-up generation (stale wake-ups are ignored)
        self.wake_at = math.inf          # when the world's pending wake-up fires
        self.pending: tuple[int, float] | None = None  # (version, transfer done at s) while draining
        self._kv_cap = rates.kv_capacity_tokens
        self._decode_step_s = rates.decode_step_s
        self._prefill_s = rates.prefill_s

    # ---- state ------------------------------------------------------------------------------------
    @property
    def outstanding_tokens(self) -> float:
        return self._finish_sum - len(self.running) * self.v_tokens + self._waiting_tokens

    def _rate_changed(self) -> None:
        n = len(self.running)
        self._step_s = self._decode_step_s(n, self._ctx_sum / n) if n else 0.0

    def advance_to(self, now_s: float) -> None:
        """Move the virtual clock to `now_s` (decoding progresses only outside prefill stalls)."""
        if self.running:
            start = self.t_s
            if self.stall_until_s > start:
                start = self.stall_until_s
            if now_s > start:
                self.v_tokens += (now_s - start) / self._step_s
            self.busy_s += now_s - self.t_s
        self.t_s = now_s

    def next_event_s(self) -> float | None:
        """When the next running request completes (None when idle)."""
        if not self.running:
            return None
        return max(self.t_s, self.stall_until_s) + max(0.0, self.running[0][0] - self.v_tokens) * self._step_s

    # ---- requests ---------------------------------------------------------------------------------
    def submit(self, req: Request, now_s: float) -> None:
        """Queue a request and admit what fits. The caller has advanced the clock to `now_s`."""
        waiting = self.waiting
        blocked = bool(waiting)  # a waiting head stays blocked until a request leaves (which admits again)
        waiting.append(req)
        self._waiting_tokens += req.reply_tokens
        if not blocked and self.up and not self.draining:
            self._admit(now_s)

    def admit(self, now_s: float) -> None:
        """Admit waiting requests in FIFO order while KV has room (at least one when empty)."""
        if self.waiting and self.up and not self.draining:
            self._admit(now_s)

    def _admit(self, now_s: float) -> None:
        waiting, running = self.waiting, self.running
        cap, max_running, prefill_s = self._kv_cap, self.max_running, self._prefill_s
        admitted = False
        while waiting:
            req = waiting[0]
            need = req.context_tokens + req.reply_tokens
            if running and (self.kv_used_tokens + need > cap or len(running) >= max_running):
                break
            waiting.popleft()
            self._waiting_tokens -= req.reply_tokens
            self.kv_used_tokens += need
            stall = self.stall_until_s
            self.stall_until_s = (stall if stall > now_s else now_s) + prefill_s(req.new_tokens)
            v = self.v_tokens
            req.mark_v = v
            req.finish_v = finish = v + req.reply_tokens
            req.version = self.version
            self._ctx_sum += req.context_tokens + req.reply_tokens / 2
            self._finish_sum += finish
            self._seq += 1
            heapq.heappush(running, (finish, self._seq, req))
            admitted = True
        if admitted:
            self.idle_since_s = None
            n = len(running)
            self._step_s = self._decode_step_s(n, self._ctx_sum / n)

    def complete_due(self, now_s: float, eps_tokens: float = 1e-6) -> list[Request]:
        """Remove and return the requests whose finish mark the clock has reached."""
        running = self.running
        if not running:
            return []
        limit = self.v_tokens + eps_tokens
        if running[0][0] > limit:
            return []
        done = []
        heappop = heapq.heappop
        while running and running[0][0] <= limit:
            req = heappop(running)[2]
            self._leave(req, req.finish_v)
            done.append(req)
        n = len(running)
        if n:
            self._step_s = self._decode_step_s(n, self._ctx_sum / n)
        else:
            self._step_s = 0.0
            self.idle_since_s = now_s
        if self.waiting and self.up and not self.draining:
            self._admit(now_s)
        return done

    def _leave(self, req: Request, upto_v: float) -> None:
        finish = req.finish_v
        tokens = round((upto_v if upto_v < finish else finish) - req.mark_v)
        if tokens:
            tbv, v = req.tokens_by_version, req.version
            tbv[v] = tbv.get(v, 0) + tokens
            req.generated += tokens
            self.tokens_generated += tokens
        self.kv_used_tokens -= req.context_tokens + req.reply_tokens
        self._ctx_sum -= req.context_tokens + req.reply_tokens / 2
        self._finish_sum -= finish

    # ---- weights and faults -----------------------------------------------------------------------
    def set_version(self, version: int, now_s: float, load_s: float = 0.0) -> None:
        """New weights from now on (running requests switch between tokens); `load_s` stalls decoding."""
        self.advance_to(now_s)
        for _, _, req in self.running:
            tokens = round(self.v_tokens - req.mark_v)
            if tokens:
                req.tokens_by_version[req.version] = req.tokens_by_version.get(req.version, 0) + tokens
                req.generated += tokens
                self.tokens_generated += tokens
            req.mark_v = self.v_tokens
            req.version = version
        self.version = version
        if load_s > 0:
            self.stall_until_s = max(self.stall_until_s, now_s) + load_s
        self.draining = False
        self.admit(now_s)

    def lose(self, now_s: float) -> list[Request]:
        """The replica died: every running and waiting request is returned (their tokens so far are kept)."""
        self.advance_to(now_s)
        self.up = False
        lost = []
        while self.running:
            _, _, req = heapq.heappop(self.running)
            self._leave(req, self.v_tokens)
            lost.append(req)
        lost.extend(self.waiting)
        self.waiting.clear()
        self._waiting_tokens = 0
        self._rate_changed()
        return lost
