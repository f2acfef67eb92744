"""kvstrata.localcluster."""
