"""kvstrata.testing."""
