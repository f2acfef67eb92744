"""kvstrata.render."""
