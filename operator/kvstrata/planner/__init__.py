"""The memory-tier planner: model architecture → KV bytes/token → tier capacities → verdict + engine flags."""

from kvstrata.planner.plan import Plan, Problem, plan

__all__ = ["Plan", "Problem", "plan"]
