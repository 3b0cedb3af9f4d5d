"""Sandboxes for a model's shell commands: bubblewrap, no network, the system read-only, a private copy of a
repository as the only writable folder, limits on time, CPU, memory, processes, file size, disk and output.

See docs/sandbox.md. Never falls back to running commands unsandboxed: where bubblewrap cannot run,
`SandboxUnavailable` names the install step.
"""

from mixfleet.runner.rollout.sandbox.box import ExecResult, Sandbox, SandboxLimits, SandboxUnavailable, check_sandbox
from mixfleet.runner.rollout.sandbox.patch import apply_patch
from mixfleet.runner.rollout.sandbox.pool import POOL_ROLE, SandboxPool, pool_role

__all__ = ["POOL_ROLE", "ExecResult", "Sandbox", "SandboxLimits", "SandboxPool", "SandboxUnavailable", "apply_patch",
           "check_sandbox", "pool_role"]
