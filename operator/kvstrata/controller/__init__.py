"""kvstrata.controller."""
