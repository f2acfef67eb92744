"""End-to-end machinery: the kwok pod launcher and the demo driver (not imported by the operator)."""
