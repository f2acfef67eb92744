"""kvstrata.router."""
