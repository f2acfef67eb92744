"""kvstrata_dev.testing."""
