"""The bounds on what a plan, a spec file or a command-line flag may ask for, in one place.

Each is far above any real run (the seed runs 54 replicas, 128 x 8 samples per update, 256k context) and
far below what exhausts a machine: a value beyond one is refused when it is read, with the limit in the
message (docs/safety.md lists them). Raise one here, with a reason, if a real run needs it.
"""

from __future__ import annotations

from typing import Any

from mixfleet.costmodel.errors import SpecError

MAX_REPLICAS_PER_GROUP = 4096        # replicas of one sampler group (plan `replicas`, `max_replicas`)
MAX_GPUS = 65536                     # GPUs of one type (trainer `gpus`, `plan --max-gpus`)
MAX_PROMPTS_PER_UPDATE = 65536       # prompts per trainer update (batcher, workload)
MAX_SAMPLES_PER_PROMPT = 1024        # samples per prompt, the GRPO group (batcher, workload)
MAX_TRAJECTORIES_PER_UPDATE = 1_048_576   # prompts per update x samples per prompt (the seed: 1,024)
MAX_INFLIGHT_PROMPTS = 1_048_576     # prompts generating at once (batcher)
MAX_TRAJECTORIES_IN_FLIGHT = 4_194_304    # prompts in flight x samples per prompt (the seed: 4,096)
MAX_STALENESS = 1_000_000            # versions (batcher `max_staleness`)
MAX_CONTEXT_TOKENS = 16_777_216      # tokens of one sequence (workload `max_context`, `capacity --contexts`)
MAX_BATCH = 65536                    # sequences decoded together (`capacity --batches`)
MAX_LOCAL_REPLICAS = 256             # embedded samplers of one group on this machine ([embedded])
MAX_THREADS = 1024                   # torch threads of one embedded sampler
MAX_TURNS = 4096                     # turns of one episode
MAX_NEW_TOKENS = 1_048_576           # reply tokens per turn
MAX_PASS_K = 1024                    # samples per prompt of a pass@k evaluation
MAX_BASE_STEPS = 1_000_000           # optimizer steps of a base policy's pretraining ([embedded] base_steps)
MAX_TOOL_LATENCY_S = 86_400.0        # seconds one tool call takes (a day; the seed's slowest test run: 600 s)
MAX_LOGNORMAL_SIGMA = 10.0           # a lognormal's sigma (a factor e^10 ~ 22,000 per standard deviation)

# A workload's distributions: the support each must stay inside, (lowest, highest, the highest's name). The
# twin draws turns x samples of each per prompt-group, so an unbounded `turns` (the probe's uniform 2..1e8)
# drew hundreds of millions of values per group; negative turns, tokens or seconds mean nothing.
WORKLOAD_DIST_BOUNDS: dict[str, tuple[float, float, str]] = {
    "turns": (0, MAX_TURNS, "MAX_TURNS"),
    "prompt_tokens": (0, MAX_CONTEXT_TOKENS, "MAX_CONTEXT_TOKENS"),
    "reply_tokens": (0, MAX_NEW_TOKENS, "MAX_NEW_TOKENS"),
    "tool_output_tokens": (0, MAX_CONTEXT_TOKENS, "MAX_CONTEXT_TOKENS"),
    "tool_latency_s": (0, MAX_TOOL_LATENCY_S, "MAX_TOOL_LATENCY_S"),
    "sandbox_start_s": (0, MAX_TOOL_LATENCY_S, "MAX_TOOL_LATENCY_S"),     # optional (WorkloadSpec.sandbox_start_s)
}


def _num(x: float) -> str:
    return f"{int(x):,}" if float(x).is_integer() else f"{x:,}"


def check_in_range(where: str, field: str, value: float, lo: float, hi: float, limit: str) -> None:
    """A distribution's parameter inside its field's support [lo, hi] (`limit`: hi's name here); else a SpecError
    naming the field, the value and the limit."""
    if value < lo:
        raise SpecError(where, field, value, f"at least {_num(lo)} (a count or a duration, never negative)")
    if value > hi:
        raise SpecError(where, field, value, f"at most {_num(hi)} ({limit}, costmodel/limits.py)")


def check_product(where: str, fields: str, value: int, hi: int) -> None:
    """A product of counts (e.g. trajectories per update) within `hi`."""
    if value > hi:
        raise SpecError(where, fields, value, f"a product of at most {hi:,}")


def check_count(where: str, field: str, value: Any, lo: int, hi: int, note: str = "") -> int:
    """An integer (never a bool, a float or a string) in [lo, hi]; else a SpecError with the bounds."""
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise SpecError(where, field, value, f"an integer in {lo}..{hi}{note}")
    return value
