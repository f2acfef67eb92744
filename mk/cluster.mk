# Local Kubernetes control plane (kube-apiserver, controller-manager, scheduler, etcd, kwok, helm),
# built from source through the Go module proxy into $(KVSTRATA_CACHE)/k8s-<versions>/bin.
# See docs/local-cluster.md.
.PHONY: cluster-bin cluster-up cluster-down cluster-status cluster-env

# Idempotent: a stamp file makes the second run a no-op (well under a second).
cluster-bin: venv
	$(PY) -m kvstrata_dev.localcluster.build

cluster-up: cluster-bin
	$(VENV)/bin/kvstrata-dev cluster up

cluster-down: venv
	$(VENV)/bin/kvstrata-dev cluster down

cluster-status: venv
	$(VENV)/bin/kvstrata-dev cluster status

cluster-env: venv
	@$(VENV)/bin/kvstrata-dev cluster env
