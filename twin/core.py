"""The twin's compiled core: one simulated sampler replica, the turn cycle of the sessions it serves, and the
calendar their events run on. Everything here runs millions of times per dry run; the rest of the twin is not hot.

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

`Turns` is the world's session cycle on top (a tool call ends -> the next turn is submitted to the session's
sticky replica -> it completes -> the next tool call), about two events per turn. Those events are bare entries
on `Calendar`, a sub-calendar merged with SimPy's queue in exact order (twin/engine.py states the contract).

Compiled: this module is written in Cython's pure-Python mode (`cython.*` declarations). `pip install`
compiles it when a C compiler is there (setup.py; `COMPILED` says which one runs); otherwise it runs as the
plain Python it is, with the same results (tests/test_twin_compiled.py runs both on the same plans).
"""

from __future__ import annotations

import math
from array import array
from bisect import bisect_right
from collections import deque
from heapq import heappop, heappush
from typing import Any, Protocol

import cython

COMPILED: bool = cython.compiled
_INF = cython.declare(cython.double, math.inf)
_NORMAL = cython.declare(cython.long, 1)  # simpy.events.NORMAL: a Timeout's priority (twin/engine.py checks it)


class ReplicaRates(Protocol):
    """What the twin needs from the cost model for one replica (costmodel's ReplicaModel fits)."""
    kv_capacity_tokens: float
    price_usd_per_hour: float
    cold_start_s: float

    def decode_step_s(self, batch: int, context_tokens: float) -> float: ...
    def prefill_s(self, tokens: float) -> float: ...


@cython.cfunc
def _round(x: cython.double) -> cython.long:
    """round(x) as Python does it (half to even), without a Python call when compiled (|x| < 2**62)."""
    if not cython.compiled:
        return round(x)
    k: cython.long = cython.cast(cython.long, x)  # toward zero; x - k is exact
    d: cython.double = x - k
    if d > 0.5 or (d == 0.5 and k % 2 != 0):
        return k + 1
    if d < -0.5 or (d == -0.5 and k % 2 != 0):
        return k - 1
    return k


@cython.cclass
class GridRates:
    """Decode-step and prefill times on grids, interpolated linearly (twin/rates.py's TabulatedRates fills the
    grids from the roofline). Batch rows 1..max_running, contexts and prefill lengths ascending."""
    max_running = cython.declare(cython.long, visibility="public")
    _ctx = cython.declare(list)
    _decode = cython.declare(list)       # per batch row: step seconds at each context
    _ddecode = cython.declare(list)      # per batch row: differences to the previous context point
    _dctx = cython.declare(list)
    _new = cython.declare(list)
    _prefill = cython.declare(list)
    _dprefill = cython.declare(list)
    _dnew = cython.declare(list)
    _n_ctx = cython.declare(cython.Py_ssize_t)
    _n_new = cython.declare(cython.Py_ssize_t)

    def set_grids(self, max_running: int, ctx: list, decode: list, new: list, prefill: list) -> None:
        """Batch rows 1..max_running of decode step seconds at the contexts `ctx`; prefill seconds at `new`."""
        if (max_running < 1 or len(ctx) < 2 or len(new) < 2 or len(decode) != max_running
                or any(len(row) != len(ctx) for row in decode) or len(prefill) != len(new)):
            raise ValueError(f"grids of {len(decode)} batch rows for max_running {max_running}, "
                             f"{len(ctx)} contexts and {len(new)} prefill points (>= 2 each), rows as long")
        self.max_running = max_running
        self._ctx, self._decode, self._new, self._prefill = ctx, decode, new, prefill
        self._n_ctx, self._n_new = len(ctx), len(new)
        # per-interval differences, precomputed (the very same float operations `_interp` does per call)
        self._dctx = [0.0] + [ctx[i] - ctx[i - 1] for i in range(1, self._n_ctx)]
        self._ddecode = [[0.0] + [row[i] - row[i - 1] for i in range(1, self._n_ctx)] for row in decode]
        self._dnew = [0.0] + [new[i] - new[i - 1] for i in range(1, self._n_new)]
        self._dprefill = [0.0] + [prefill[i] - prefill[i - 1] for i in range(1, self._n_new)]

    @cython.boundscheck(False)  # indices are in range by construction
    @cython.wraparound(False)
    @cython.cfunc
    def _upper(self, xs: list, n: cython.Py_ssize_t, x: cython.double) -> cython.Py_ssize_t:
        """bisect_right(xs, x) (xs ascending)."""
        if not cython.compiled:
            return bisect_right(xs, x)
        lo: cython.Py_ssize_t = 0
        hi: cython.Py_ssize_t = n
        mid: cython.Py_ssize_t
        xm: cython.double
        while lo < hi:
            mid = (lo + hi) // 2
            xm = xs[mid]
            if x < xm:
                hi = mid
            else:
                lo = mid + 1
        return lo

    @staticmethod
    def _interp(xs: list, ys: list, x: float) -> float:
        i = bisect_right(xs, x)
        if i <= 0:
            return ys[0] * (x / xs[0]) if x < xs[0] else ys[0]
        if i >= len(xs):
            return ys[-1] + (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) * (x - xs[-1])
        x0, x1 = xs[i - 1], xs[i]
        return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - x0) / (x1 - x0)

    def decode_step_s(self, batch: int, context_tokens: float) -> float:
        return self.decode_at(batch, context_tokens)

    def prefill_s(self, tokens: float) -> float:
        return self.prefill_at(tokens)

    @cython.boundscheck(False)  # indices are in range by construction
    @cython.wraparound(False)
    @cython.cfunc
    def decode_at(self, batch: cython.long, context_tokens: cython.double) -> cython.double:
        b: cython.Py_ssize_t = ((batch if batch <= self.max_running else self.max_running) - 1) if batch >= 1 else 0
        xs: list = self._ctx
        i: cython.Py_ssize_t = self._upper(xs, self._n_ctx, context_tokens)
        if 0 < i < self._n_ctx:  # inside the grid (the common case): `_interp`'s arithmetic, differences cached
            x0: cython.double = xs[i - 1]
            row: list = self._decode[b]
            drow: list = self._ddecode[b]
            d0: cython.double = row[i - 1]
            dd: cython.double = drow[i]
            dx: cython.double = self._dctx[i]
            return d0 + dd * (context_tokens - x0) / dx
        return self._interp(xs, self._decode[b], context_tokens)

    @cython.boundscheck(False)  # indices are in range by construction
    @cython.wraparound(False)
    @cython.cfunc
    def prefill_at(self, tokens: cython.double) -> cython.double:
        if tokens <= 0:
            return 0.0
        xs: list = self._new
        i: cython.Py_ssize_t = self._upper(xs, self._n_new, tokens)
        if 0 < i < self._n_new:
            x0: cython.double = xs[i - 1]
            p0: cython.double = self._prefill[i - 1]
            dp: cython.double = self._dprefill[i]
            dx: cython.double = self._dnew[i]
            return p0 + dp * (tokens - x0) / dx
        return self._interp(xs, self._prefill, tokens)


@cython.cclass
class Episode:
    """One session's draw (twin/episodes.py): its turns, prompt, reply and tool-output tokens, tool latency."""
    turns = cython.declare(cython.long, visibility="readonly")          # model replies
    prompt_tokens = cython.declare(cython.long, visibility="readonly")  # first prompt
    reply_tokens = cython.declare(tuple, visibility="readonly")         # per turn
    tool_tokens = cython.declare(tuple, visibility="readonly")          # tool output after turn i (turns - 1)
    tool_s = cython.declare(tuple, visibility="readonly")               # tool latency after turn i (turns - 1)
    reward = cython.declare(cython.double, visibility="readonly")
    finish_reason = cython.declare(str, visibility="readonly")

    def __init__(self, *, turns: int, prompt_tokens: int, reply_tokens: tuple, tool_tokens: tuple, tool_s: tuple,
                 reward: float, finish_reason: str) -> None:
        if turns < 1 or len(reply_tokens) != turns or len(tool_tokens) != turns - 1 or len(tool_s) != turns - 1:
            raise ValueError(f"an episode of {turns} turns has {turns} replies and {turns - 1} tool calls, not "
                             f"{len(reply_tokens)}, {len(tool_tokens)} and {len(tool_s)}")
        self.turns, self.prompt_tokens = turns, prompt_tokens
        self.reply_tokens, self.tool_tokens, self.tool_s = reply_tokens, tool_tokens, tool_s
        self.reward, self.finish_reason = reward, finish_reason

    def __repr__(self) -> str:
        return (f"Episode(turns={self.turns}, prompt_tokens={self.prompt_tokens}, reward={self.reward}, "
                f"finish_reason={self.finish_reason!r})")


@cython.cclass
class KeyHeap:
    """A binary min-heap of items keyed by (time, id), ids unique. The keys live in two flat arrays (array.array
    'd' and 'q', read through typed memoryviews when compiled: contiguous C doubles and integers, no objects to
    chase or count) and the items in a list beside them, so a push allocates no tuple and a comparison is two C
    compares. `len`, `time0` / `id0` (the head's key; the heap must not be empty), `push`, `pop` (removes and
    returns the head's item), `items` (all of them). Run as plain Python it is heapq over (time, id, item) tuples
    instead (faster there; the same pop order, since the keys are unique)."""
    _tarr = cython.declare(object)             # array('d'): the times, capacity entries
    _iarr = cython.declare(object)             # array('q'): the ids
    _t = cython.declare(cython.double[:])      # views of them (plain Python: the arrays themselves)
    _i = cython.declare(cython.longlong[:])
    _x = cython.declare(list)                  # the items (len = the heap's size); plain Python: the tuples

    def __init__(self, capacity: int = 64) -> None:
        self._x = []
        if cython.compiled:
            self._tarr, self._iarr = array("d", bytes(8 * capacity)), array("q", bytes(8 * capacity))
            self._t, self._i = self._tarr, self._iarr

    def __len__(self) -> int:
        return len(self._x)

    def items(self) -> list:
        if not cython.compiled:
            return [e[2] for e in self._x]
        return list(self._x)

    @cython.cfunc
    def _grow(self) -> cython.void:
        cap = len(self._tarr)
        self._t, self._i = None, None  # release the views before the arrays grow
        self._tarr.frombytes(bytes(8 * cap))
        self._iarr.frombytes(bytes(8 * cap))
        self._t, self._i = self._tarr, self._iarr

    @cython.boundscheck(False)  # indices are in range by construction
    @cython.wraparound(False)
    @cython.ccall
    def time0(self) -> cython.double:
        if not cython.compiled:
            return self._x[0][0]
        return self._t[0]

    @cython.boundscheck(False)
    @cython.wraparound(False)
    @cython.ccall
    def id0(self) -> cython.longlong:
        if not cython.compiled:
            return self._x[0][1]
        return self._i[0]

    @cython.boundscheck(False)  # indices are in range by construction
    @cython.wraparound(False)
    @cython.ccall
    def push(self, t: cython.double, i: cython.longlong, item: object) -> cython.void:
        if not cython.compiled:
            heappush(self._x, (t, i, item))
            return
        hx: list = self._x
        pos: cython.Py_ssize_t = len(hx)
        if pos == len(self._tarr):
            self._grow()
        ht: cython.double[:] = self._t
        hi: cython.longlong[:] = self._i
        parent: cython.Py_ssize_t
        pt: cython.double
        hx.append(item)
        while pos > 0:  # move the new key up past every parent that sorts after it
            parent = (pos - 1) >> 1
            pt = ht[parent]
            if pt < t or (pt == t and hi[parent] < i):
                break
            ht[pos] = pt
            hi[pos] = hi[parent]
            hx[pos] = hx[parent]
            pos = parent
        ht[pos] = t
        hi[pos] = i
        hx[pos] = item

    @cython.boundscheck(False)  # indices are in range by construction
    @cython.wraparound(False)
    @cython.ccall
    def pop(self) -> object:
        if not cython.compiled:
            return heappop(self._x)[2]
        hx: list = self._x
        ht: cython.double[:] = self._t
        hi: cython.longlong[:] = self._i
        head = hx[0]
        item = hx.pop()
        n: cython.Py_ssize_t = len(hx)
        if n == 0:
            return head
        t: cython.double = ht[n]
        i: cython.longlong = hi[n]
        pos: cython.Py_ssize_t = 0
        child: cython.Py_ssize_t
        ct: cython.double
        rt: cython.double
        while True:  # move the last key down from the root past every smaller child
            child = 2 * pos + 1
            if child >= n:
                break
            ct = ht[child]
            if child + 1 < n:  # the smaller of the two children
                rt = ht[child + 1]
                if rt < ct or (rt == ct and hi[child + 1] < hi[child]):
                    child += 1
                    ct = rt
            if t < ct or (t == ct and i < hi[child]):
                break
            ht[pos] = ct
            hi[pos] = hi[child]
            hx[pos] = hx[child]
            pos = child
        ht[pos] = t
        hi[pos] = i
        hx[pos] = item
        return head


@cython.cclass
class Request:
    """One turn of one session on one replica (the world's sessions are Requests themselves, so a turn
    allocates nothing; `tokens_by_version` then accumulates the session's tokens). A request is also a bare
    SimPy queue entry (twin/engine.py) while `callbacks` is set: a tool call's end."""
    tag = cython.declare(object, visibility="public")            # the caller's (tests: an arrival time)
    new_tokens = cython.declare(cython.long, visibility="public")      # tokens to prefill (not in the prefix cache)
    reply_tokens = cython.declare(cython.long, visibility="public")    # tokens to decode
    context_tokens = cython.declare(cython.long, visibility="public")  # context before this turn's reply
    finish_v = cython.declare(cython.double, visibility="public")      # virtual-clock mark at which it is done
    mark_v = cython.declare(cython.double, visibility="public")        # clock at admission or the last version switch
    version = cython.declare(cython.long, visibility="public")         # weights the current stretch is sampled with
    tokens_by_version = cython.declare(dict, visibility="public")      # versions with no tokens stay out
    generated = cython.declare(cython.long, visibility="public")       # tokens decoded for this request so far
    callbacks = cython.declare(object, visibility="public")            # SimPy's: set while it is a queue entry
    _ok = True                                                         # SimPy's: a queue entry that succeeded

    def __init__(self, *, new_tokens: int = 0, reply_tokens: int = 0, context_tokens: int = 0,
                 tag: Any = None) -> None:
        self.tag = tag
        self.new_tokens, self.reply_tokens, self.context_tokens = new_tokens, reply_tokens, context_tokens
        self.finish_v = self.mark_v = 0.0
        self.version = self.generated = 0
        self.tokens_by_version = {}
        self.callbacks = None


@cython.cclass
class Session(Request):
    """One trajectory (a sample of a prompt-group) in the world: its episode and where it is in it."""
    sid = cython.declare(cython.long, visibility="public")
    prompt_id = cython.declare(cython.long, visibility="public")
    sample = cython.declare(cython.long, visibility="public")
    ep = cython.declare(Episode, visibility="public")
    turn = cython.declare(cython.long, visibility="public")
    context = cython.declare(cython.long, visibility="public")         # tokens already in the context
    pending_new = cython.declare(cython.long, visibility="public")     # tokens to add before the next reply
    remaining_reply = cython.declare(cython.long, visibility="public")  # this turn's reply tokens still to decode
    cached_on = cython.declare(object, visibility="public")            # replica holding this session's prefix
    replica = cython.declare(object, visibility="public")              # the replica it is pinned to (or None)
    start_s = cython.declare(cython.double, visibility="public")
    end_s = cython.declare(cython.double, visibility="public")
    restarts = cython.declare(cython.long, visibility="public")
    prompt_total = cython.declare(cython.long, visibility="public")    # non-generated tokens (prompt + tool outputs)

    def __init__(self, *, sid: int, prompt_id: int, sample: int, ep: Any) -> None:
        Request.__init__(self)
        self.sid, self.prompt_id, self.sample, self.ep = sid, prompt_id, sample, ep
        self.turn = self.context = self.pending_new = self.remaining_reply = 0
        self.cached_on = self.replica = None
        self.start_s = self.end_s = 0.0
        self.restarts = self.prompt_total = 0

    def __repr__(self) -> str:
        return f"Session(sid={self.sid}, prompt_id={self.prompt_id}, sample={self.sample}, turn={self.turn})"


@cython.freelist(256)
@cython.cclass
class Entry:
    """A bare queue entry for `TwinEnvironment.push` (twin/engine.py): shared callbacks (one list per kind of
    entry), a value and a generation (the world ignores an entry whose generation is stale)."""
    callbacks = cython.declare(object, visibility="public")
    value = cython.declare(object, visibility="public")
    gen = cython.declare(cython.long, visibility="public")
    _ok = True

    def __init__(self, callbacks: list, value: Any, gen: int = 0) -> None:
        self.callbacks, self.value, self.gen = callbacks, value, gen


@cython.cfunc
def _entry(callbacks: list, value: object, gen: cython.long) -> Entry:
    """Entry(callbacks, value, gen) without the Python call (compiled: tp_new, no argument parsing)."""
    e: Entry = Entry.__new__(Entry)
    e.callbacks, e.value, e.gen = callbacks, value, gen
    return e


@cython.cclass
class Replica:
    """A processor-sharing server. The world calls `submit`, `advance_to`, `complete_due`, `next_event_s`.

    Hot paths (advance, admit, complete) recompute the step time once per admission/completion burst, not once
    per request (the result is the same: it depends only on the batch after the burst); rates that are
    `GridRates` are read without a Python call."""
    group = cython.declare(object, visibility="public")
    index = cython.declare(cython.long, visibility="public")
    rates = cython.declare(object, visibility="public")
    version = cython.declare(cython.long, visibility="public")
    max_running = cython.declare(cython.long, visibility="public")
    up = cython.declare(cython.bint, visibility="public")
    draining = cython.declare(cython.bint, visibility="public")
    v_tokens = cython.declare(cython.double, visibility="public")       # the virtual clock (tokens per request)
    t_s = cython.declare(cython.double, visibility="public")            # time the clock was last advanced to
    stall_until_s = cython.declare(cython.double, visibility="public")  # prefill (or weight load) until then
    running = cython.declare(KeyHeap, visibility="readonly")            # requests by (finish_v, admission seq)
    waiting = cython.declare(object, visibility="public")               # deque of requests
    kv_used_tokens = cython.declare(cython.double, visibility="public")
    busy_s = cython.declare(cython.double, visibility="public")         # time with a running request
    tokens_generated = cython.declare(cython.long, visibility="public")
    idle_since_s = cython.declare(object, visibility="public")          # float, or None while busy
    gen = cython.declare(cython.long, visibility="public")              # the world's wake-up generation
    wake_at = cython.declare(cython.double, visibility="public")        # when the world's pending wake-up fires
    pending = cython.declare(object, visibility="public")               # (version, transfer done at s) while draining
    step_s = cython.declare(cython.double, visibility="public")         # seconds per token per request now
    _ctx_sum = cython.declare(cython.double)                            # sum of running requests' mean contexts
    _finish_sum = cython.declare(cython.double)                         # sum of their finish marks
    _waiting_tokens = cython.declare(cython.long)
    _seq = cython.declare(cython.long)
    _kv_cap = cython.declare(cython.double)
    _grid = cython.declare(GridRates)                                   # rates as grids, or None
    _decode_step_s = cython.declare(object)
    _prefill_s = cython.declare(object)

    def __init__(self, group: str, index: int, rates: ReplicaRates, version: int = 0) -> None:
        self.group, self.index, self.rates = group, index, rates
        self.version = version
        self.max_running = int(getattr(rates, "max_running", 1 << 30))
        self.up = True
        self.draining = False
        self.v_tokens = self.t_s = self.stall_until_s = 0.0
        self.running = KeyHeap()
        self.waiting = deque()
        self.kv_used_tokens = self._ctx_sum = self._finish_sum = 0.0
        self._waiting_tokens = self._seq = 0
        self.step_s = 0.0
        self.busy_s = 0.0
        self.tokens_generated = 0
        self.idle_since_s = 0.0
        self.gen = 0
        self.wake_at = _INF
        self.pending = None
        self._kv_cap = rates.kv_capacity_tokens
        self._grid = rates if isinstance(rates, GridRates) else None
        self._decode_step_s = rates.decode_step_s
        self._prefill_s = rates.prefill_s

    # ---- state ------------------------------------------------------------------------------------
    @property
    def outstanding_tokens(self) -> float:
        return self._finish_sum - len(self.running) * self.v_tokens + self._waiting_tokens

    @cython.cfunc
    def _decode(self, n: cython.long) -> cython.double:
        if self._grid is not None:
            return self._grid.decode_at(n, self._ctx_sum / n)
        return self._decode_step_s(n, self._ctx_sum / n)

    @cython.cfunc
    def _prefill(self, tokens: cython.long) -> cython.double:
        if self._grid is not None:
            return self._grid.prefill_at(tokens)
        return self._prefill_s(tokens)

    @cython.ccall
    def advance_to(self, now_s: cython.double) -> cython.void:
        """Move the virtual clock to `now_s` (decoding progresses only outside prefill stalls)."""
        start: cython.double
        if len(self.running):
            start = self.t_s
            if self.stall_until_s > start:
                start = self.stall_until_s
            if now_s > start:
                self.v_tokens += (now_s - start) / self.step_s
            self.busy_s += now_s - self.t_s
        self.t_s = now_s

    def next_event_s(self) -> float | None:
        """When the next running request completes (None when idle)."""
        if not len(self.running):
            return None
        return max(self.t_s, self.stall_until_s) + max(0.0, self.running.time0() - self.v_tokens) * self.step_s

    # ---- requests ---------------------------------------------------------------------------------
    @cython.ccall
    def submit(self, req: Request, now_s: cython.double) -> cython.void:
        """Queue a request and admit what fits. The caller has advanced the clock to `now_s`."""
        waiting = self.waiting
        blocked: cython.bint = len(waiting) > 0  # a waiting head stays blocked until a request leaves
        waiting.append(req)
        self._waiting_tokens += req.reply_tokens
        if not blocked and self.up and not self.draining:
            self._admit(now_s)

    def admit(self, now_s: float) -> None:
        """Admit waiting requests in FIFO order while KV has room (at least one when empty)."""
        if self.waiting and self.up and not self.draining:
            self._admit(now_s)

    @cython.boundscheck(False)  # indices are in range by construction
    @cython.wraparound(False)
    @cython.cfunc
    def _admit(self, now_s: cython.double) -> cython.void:
        waiting = self.waiting
        running: KeyHeap = self.running
        cap: cython.double = self._kv_cap
        need: cython.double
        stall: cython.double
        v: cython.double
        finish: cython.double
        req: Request
        n: cython.long
        admitted: cython.bint = False
        while waiting:
            req = waiting[0]
            need = req.context_tokens + req.reply_tokens
            if len(running) and (self.kv_used_tokens + need > cap or len(running) >= self.max_running):
                break
            waiting.popleft()
            self._waiting_tokens -= req.reply_tokens
            self.kv_used_tokens += need
            stall = self.stall_until_s
            self.stall_until_s = (stall if stall > now_s else now_s) + self._prefill(req.new_tokens)
            v = self.v_tokens
            req.mark_v = v
            finish = v + req.reply_tokens
            req.finish_v = finish
            req.version = self.version
            self._ctx_sum += req.context_tokens + req.reply_tokens / 2
            self._finish_sum += finish
            self._seq += 1
            running.push(finish, self._seq, req)
            admitted = True
        if admitted:
            self.idle_since_s = None
            n = len(running)
            self.step_s = self._decode(n)

    @cython.boundscheck(False)  # indices are in range by construction
    @cython.wraparound(False)
    @cython.ccall
    def complete_due(self, now_s: cython.double, eps_tokens: cython.double = 1e-6) -> list:
        """Remove and return the requests whose finish mark the clock has reached."""
        running: KeyHeap = self.running
        if not len(running):
            return []
        limit: cython.double = self.v_tokens + eps_tokens
        head: cython.double = running.time0()
        if head > limit:
            return []
        done: list = []
        req: Request
        n: cython.long
        while head <= limit:
            req = running.pop()
            self._leave(req, req.finish_v)
            done.append(req)
            if not len(running):
                break
            head = running.time0()
        n = len(running)
        if n:
            self.step_s = self._decode(n)
        else:
            self.step_s = 0.0
            self.idle_since_s = now_s
        if self.waiting and self.up and not self.draining:
            self._admit(now_s)
        return done

    @cython.boundscheck(False)  # indices are in range by construction
    @cython.wraparound(False)
    @cython.cfunc
    def _leave(self, req: Request, upto_v: cython.double) -> cython.void:
        finish: cython.double = req.finish_v
        tokens: cython.long = _round((upto_v if upto_v < finish else finish) - req.mark_v)
        v: cython.long
        if tokens:
            tbv: dict = req.tokens_by_version
            v = req.version
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
        for req in self.running.items():
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

    def lose(self, now_s: float) -> list:
        """The replica died: every running and waiting request is returned (their tokens so far are kept)."""
        self.advance_to(now_s)
        self.up = False
        lost = []
        while len(self.running):
            req = self.running.pop()
            self._leave(req, self.v_tokens)
            lost.append(req)
        lost.extend(self.waiting)
        self.waiting.clear()
        self._waiting_tokens = 0
        n = len(self.running)
        self.step_s = self._decode(n) if n else 0.0
        return lost


@cython.cclass
class Calendar:
    """Bare entries' sub-calendar, merged with SimPy's queue in exact order (the contract: twin/engine.py).

    An entry is pushed with an id drawn from SimPy's own counter, at NORMAL priority, onto a local binary heap
    ordered by (time, id), as SimPy's queue orders (time, priority, id). SimPy's queue holds a *proxy* at (the
    local head's time, NORMAL, its id): when SimPy pops it, `run` processes local entries in key order for as
    long as each sorts before SimPy's next event, sets `env._now` for each, and calls its callbacks as
    `Environment.step` would (clearing them first). So entries and SimPy's events run in exactly the order one
    heap would give, ids and event count included, while the hot events skip SimPy's Python step. A proxy is
    armed whenever the local head may sort before every proxy in SimPy's queue (their keys are kept in
    `_proxies`; a proxy whose entry already ran only runs what is due, if anything, when it fires).

    The local heap is a `KeyHeap` (no tuple per entry, C compares when compiled)."""
    env = cython.declare(object)
    _queue = cython.declare(list)        # SimPy's heap (env._queue)
    _eid = cython.declare(object)        # SimPy's id counter (env._eid)
    _heap = cython.declare(KeyHeap)      # the local heap of entries by (time, id)
    _proxies = cython.declare(list)      # heap of (time, id) of proxies in SimPy's queue
    _proxy_cbs = cython.declare(list)
    _running = cython.declare(cython.bint)
    turns = cython.declare(object)       # the Turns whose entries are dispatched without a Python call
    _now = cython.declare(cython.double)  # the clock while `run` runs (env._now is set before Python code reads it)
    _stale = cython.declare(cython.bint)  # env._now is behind _now

    def __init__(self, env: Any) -> None:
        self.env, self._queue, self._eid = env, env._queue, env._eid
        self._heap, self._proxies = KeyHeap(), []
        self._proxy_cbs = [self._fire]
        self._running = False
        self.turns = None
        self._now = 0.0
        self._stale = False

    @cython.ccall
    def sync(self) -> cython.void:
        """Bring SimPy's clock (env._now) up to the calendar's before Python code that reads it runs."""
        if self._stale:
            self.env._now = self._now
            self._stale = False

    @cython.ccall
    def now(self) -> cython.double:
        """The simulated time (SimPy's clock; read without a lookup while `run` runs)."""
        if self._running:
            return self._now
        return self.env._now

    @cython.ccall
    def push(self, delay_s: cython.double, entry: object) -> cython.void:
        """Schedule `entry` `delay_s` (>= 0) seconds from now, ordered as a Timeout created now would be."""
        i: cython.longlong = next(self._eid)
        self._heap.push(self.now() + delay_s, i, entry)
        if not self._running:
            self._arm()

    @cython.boundscheck(False)  # indices are in range by construction
    @cython.wraparound(False)
    @cython.cfunc
    def _arm(self) -> cython.void:
        """Put a proxy for the local head into SimPy's queue unless one sorts at or before it already."""
        if len(self._heap) == 0:
            return
        t: cython.double = self._heap.time0()
        i: cython.long = self._heap.id0()
        pt: cython.double
        pi: cython.long
        if self._proxies:
            pk: tuple = self._proxies[0]
            pt = pk[0]
            pi = pk[1]
            if pt < t or (pt == t and pi <= i):
                return
        heappush(self._proxies, (t, i))
        heappush(self._queue, (t, _NORMAL, i, _entry(self._proxy_cbs, None, 0)))

    def _fire(self, proxy: Entry) -> None:
        heappop(self._proxies)  # the proxy SimPy just popped is the smallest
        self.run()

    @cython.boundscheck(False)  # indices are in range by construction
    @cython.wraparound(False)
    @cython.ccall
    def run(self) -> cython.void:
        """Run local entries while each sorts before SimPy's next event (see the class docstring)."""
        heap: KeyHeap = self._heap
        queue: list = self._queue
        turns: Turns = self.turns
        nxt: tuple
        t: cython.double
        qt: cython.double
        qp: cython.long
        qi: cython.long
        i: cython.long
        req: Request
        ent: Entry
        self._running = True
        try:
            while len(heap):
                t = heap.time0()
                if queue:
                    nxt = queue[0]
                    qt = nxt[0]
                    if qt < t:
                        break
                    if qt == t:
                        qp = nxt[1]
                        i = heap.id0()
                        qi = nxt[2]
                        if qp < _NORMAL or (qp == _NORMAL and qi < i):
                            break
                entry = heap.pop()
                self._now = t
                self._stale = True
                if isinstance(entry, Entry):  # typed access to the callbacks (no attribute lookup)
                    ent = entry
                    callbacks = ent.callbacks
                    ent.callbacks = None
                    if turns is not None and callbacks is turns.wake_cbs:
                        turns.wake_c(ent)
                        continue
                elif isinstance(entry, Request):
                    req = entry
                    callbacks = req.callbacks
                    req.callbacks = None
                    if turns is not None and callbacks is turns.tool_cbs:
                        turns.turn(req)
                        continue
                else:
                    callbacks = entry.callbacks
                    entry.callbacks = None
                self.sync()
                for callback in callbacks:
                    callback(entry)
        finally:
            self.sync()
            self._running = False
            self._arm()


@cython.cclass
class Turns:
    """The sessions' turn cycle, the world's hot path: a tool call ends (the session is its own queue entry) ->
    `turn` submits the next request to the session's sticky replica -> the replica's wake-up (`wake`, one pending
    per replica, `poke` reschedules it) completes it -> `turn_done` starts the next tool call. What is not hot
    (routing a session, a finished trajectory, a restart) goes back to the world: `world.route_session(s)`,
    `world.session_finished(s)`, `world.restart(s)`."""
    env = cython.declare(object)
    cal = cython.declare(Calendar)
    world = cython.declare(object)
    restart = cython.declare(cython.bint)      # a turn cut by a replica loss restarts the trajectory
    wake_cbs = cython.declare(list, visibility="readonly")
    tool_cbs = cython.declare(list, visibility="readonly")
    sessions_lost = cython.declare(cython.long, visibility="public")      # turns cut by a replica loss
    sessions_restarted = cython.declare(cython.long, visibility="public")

    def __init__(self, env: Any, world: Any, restart: bool) -> None:
        self.env, self.cal, self.world, self.restart = env, env.calendar, world, restart
        self.wake_cbs, self.tool_cbs = [self.wake], [self.turn]  # shared by every queue entry of a kind
        self.sessions_lost = self.sessions_restarted = 0
        self.cal.turns = self  # the calendar calls wake / turn directly for these entries

    @cython.boundscheck(False)  # indices are in range by construction
    @cython.wraparound(False)
    @cython.ccall
    def poke(self, rep: Replica) -> cython.void:
        """(Re)schedule the replica's next completion; an older wake-up becomes a no-op."""
        running: KeyHeap = rep.running
        if not len(running):
            rep.gen += 1
            rep.wake_at = _INF
            return
        ts: cython.double = rep.t_s  # rep.next_event_s(), inlined (the same arithmetic)
        stall: cython.double = rep.stall_until_s
        head: cython.double = running.time0()
        left: cython.double = head - rep.v_tokens
        t: cython.double = (stall if stall > ts else ts) + (left if left > 0.0 else 0.0) * rep.step_s
        if rep.wake_at <= t:
            return  # the pending wake-up comes first; it reschedules if nothing is due by then
        rep.gen += 1
        rep.wake_at = t
        delay: cython.double = t - self.cal.now()
        self.cal.push(delay if delay > 0.0 else 0.0, _entry(self.wake_cbs, rep, rep.gen))

    def wake(self, event: Entry) -> None:
        self.wake_c(event)

    @cython.boundscheck(False)  # indices are in range by construction
    @cython.wraparound(False)
    @cython.ccall
    def wake_c(self, event: Entry) -> cython.void:
        rep: Replica = event.value
        if event.gen != rep.gen or not rep.up:
            return
        rep.wake_at = _INF
        now: cython.double = self.cal.now()
        rep.advance_to(now)
        for req in rep.complete_due(now):
            self.turn_done(req, True)
        if rep.draining:
            self.maybe_load(rep)
        self.poke(rep)

    @cython.ccall
    def maybe_load(self, rep: Replica) -> cython.void:
        """A draining replica loads its pending weights once its batch is empty and the transfer is in."""
        pend = rep.pending
        now: cython.double = self.cal.now()
        if rep.draining and pend is not None and not len(rep.running) and now >= pend[1]:
            rep.pending = None
            rep.set_version(pend[0], now)

    @cython.boundscheck(False)  # indices are in range by construction
    @cython.wraparound(False)
    @cython.ccall
    def turn(self, s: Session) -> cython.void:
        """Send the session's next request to its (sticky) replica; the world's router picks one for a new
        session or when the pinned replica is gone."""
        rep: Replica = s.replica
        if rep is None or not rep.up:
            self.cal.sync()
            rep = self.world.route_session(s)
            if rep is None:
                return  # parked until a replica is up
            s.replica = rep
        ctx: cython.long = s.context + s.pending_new
        s.new_tokens = s.pending_new if s.cached_on is rep else ctx
        s.reply_tokens, s.context_tokens, s.generated = s.remaining_reply, ctx, 0
        now: cython.double = self.cal.now()
        rep.advance_to(now)
        rep.submit(s, now)  # the session is the request: the replica adds its tokens to s.tokens_by_version
        self.poke(rep)

    @cython.boundscheck(False)  # indices are in range by construction
    @cython.wraparound(False)
    @cython.ccall
    def turn_done(self, s: Session, ok: cython.bint) -> cython.void:
        """The session's request left its replica: completed (ok) or cut by the replica's loss."""
        generated: cython.long
        if not ok:  # the replica was lost mid-turn
            generated = s.generated
            self.sessions_lost += 1
            if self.restart:
                self.sessions_restarted += 1
                s.restarts += 1
                self.cal.sync()
                self.world.restart(s)
                return
            s.restarts += 1
            s.context += s.pending_new + generated
            s.pending_new, s.remaining_reply, s.cached_on = 0, s.remaining_reply - generated, None
            if s.remaining_reply <= 0:
                ok = True  # the reply was complete when the replica died
            else:
                self.turn(s)
                return
        s.context += s.pending_new + s.remaining_reply
        s.cached_on, s.turn = s.replica, s.turn + 1
        ep: Episode = s.ep
        if s.turn >= ep.turns:
            self.cal.sync()
            self.world.session_finished(s)
            return
        turn: cython.long = s.turn
        s.pending_new, s.remaining_reply = ep.tool_tokens[turn - 1], ep.reply_tokens[turn]
        s.prompt_total += s.pending_new
        s.callbacks = self.tool_cbs  # a timeout of the tool's latency: the session is the entry; SimPy calls turn(s)
        self.cal.push(ep.tool_s[turn - 1], s)
