"""The memory-tier planner: model architecture → KV bytes/token → tier capacities → verdict + engine flags."""

from kvstrata.planner.plan import Plan, plan
from kvstrata.planner.problem import Problem

__all__ = ["Plan", "Problem", "plan"]
