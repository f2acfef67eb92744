"""kvstrata.api."""
