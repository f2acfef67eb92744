"""kvstrata's development harness: the local control plane, real-vLLM engine harness, e2e launcher and demo.

Installed only in the development venv (`make venv`), never in the product wheel; the product package
`kvstrata` must not import it (tests/unit/test_import_rules.py).
"""
