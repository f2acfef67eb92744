"""kvstrata.planner."""
