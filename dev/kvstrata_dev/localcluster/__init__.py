"""kvstrata_dev.localcluster."""
