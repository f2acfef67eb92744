"""Kubernetes Quantity as a typed API field: accepted as `64Gi`, `500G`, `1.5Ti` or a plain byte count.

Sizes in the API are Quantities, never bare strings with units in a comment (production-stack's mistake):
the CRD carries `x-kubernetes-int-or-string` plus a pattern, so `kubectl apply` rejects `64 GB` at once.
"""

from __future__ import annotations

from decimal import Decimal, InvalidOperation
from typing import Annotated, Any

from kubernetes.utils.quantity import parse_quantity
from pydantic import BeforeValidator, PlainSerializer, WithJsonSchema

GIB = 1 << 30

# The apiserver's own Quantity grammar, restricted to non-negative values.
QUANTITY_PATTERN = r"^(\+)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE][+-]?[0-9]+))?$"


def quantity_bytes(value: str | int) -> int:
    """Bytes in a Quantity, rounded up (a fractional byte still needs a byte)."""
    return quantity_units(value)


def quantity_units(value: str | int) -> int:
    """Whole units in a Quantity, rounded up: bytes of a memory size, CPUs of a cpu request."""
    try:
        amount: Decimal = parse_quantity(value)  # type: ignore[no-untyped-call]  # kubernetes is untyped
    except (ValueError, InvalidOperation, TypeError) as err:
        raise ValueError(f"{value!r} is not a Kubernetes quantity (e.g. 64Gi, 500G, 1073741824)") from err
    if amount < 0:
        raise ValueError(f"{value!r} must not be negative")
    return int(amount.to_integral_value(rounding="ROUND_CEILING"))


def _validate(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, str | int | float | Decimal):
        raise ValueError(f"{value!r} is not a Kubernetes quantity (e.g. 64Gi, 500G, 1073741824)")
    quantity_bytes(str(value))
    return str(value)


Quantity = Annotated[
    str,
    BeforeValidator(_validate),
    PlainSerializer(lambda v: v, return_type=str),
    WithJsonSchema(
        {
            # Structural schemas allow exactly `anyOf: [{type: integer}, {type: string}]` under
            # int-or-string: value checks go beside the anyOf (pattern applies to strings, minimum to ints).
            "x-kubernetes-int-or-string": True,
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": QUANTITY_PATTERN,
            "minimum": 0,
        }
    ),
]


def gib(nbytes: float) -> str:
    """Human size as the planner's messages print it: GiB with one decimal, MiB below 1 GiB."""
    if abs(nbytes) < GIB:
        return f"{nbytes / (1 << 20):.1f} MiB"
    return f"{nbytes / GIB:.1f} GiB"
