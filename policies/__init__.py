"""mixfleet.policies: decisions (router, autoscaler, batcher, weight sync) and the Plan.

Pure Python: no simpy, no torch, no I/O in decisions. The twin and the real runner call the very
same objects. Imports only mixfleet.costmodel. Importing the package registers the built-ins.
"""

from mixfleet.policies import autoscaler, batcher, replan, router, weight_sync  # noqa: F401  (registers built-ins)
from mixfleet.policies.autoscaler import Autoscaler
from mixfleet.policies.batcher import BatchDecision, Batcher
from mixfleet.policies.plan import (
    EmbeddedPlan,
    FaultsPlan,
    GroupPlan,
    Plan,
    PoliciesPlan,
    PolicyRef,
    TrainerPlan,
    load_plan,
    merge,
    plan_from_dict,
    save_plan,
    with_overrides,
)
from mixfleet.policies.registry import make, names
from mixfleet.policies.router import Router
from mixfleet.policies.views import BufferView, FleetView, GroupView, PromptGroupView, ReplicaView
from mixfleet.policies.weight_sync import SyncDecision, WeightSync

__all__ = ["Autoscaler", "BatchDecision", "Batcher", "BufferView", "EmbeddedPlan", "FaultsPlan", "FleetView",
           "GroupPlan", "GroupView", "Plan", "PoliciesPlan", "PolicyRef", "PromptGroupView", "ReplicaView", "Router",
           "SyncDecision", "TrainerPlan", "WeightSync", "load_plan", "make", "merge", "names", "plan_from_dict",
           "save_plan", "with_overrides"]
