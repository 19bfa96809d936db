"""Reduction operators, spelled as torchcomms (and torch.distributed) spell them."""

from __future__ import annotations

from numbers import Real
from typing import Any

from ._errors import InvalidArgument

__all__ = ["ReduceOp", "as_op"]

_NAMES = {
    "sum": "sum",
    "product": "prod",
    "prod": "prod",
    "min": "min",
    "max": "max",
    "avg": "avg",
    "band": "band",
    "bor": "bor",
    "bxor": "bxor",
    "premul_sum": "premul_sum",
}


class ReduceOp:
    """A reduction: ``ReduceOp.SUM``, ``PRODUCT`` (``PROD``), ``MIN``,
    ``MAX``, ``AVG``, ``BAND``, ``BOR``, ``BXOR``, or
    ``ReduceOp.premul_sum(factor)``: every input multiplied by ``factor``
    (a number, or a one-element tensor of the collective's dtype read when
    the collective runs, so a CUDA graph replay sees its current value)
    before the sum.

    Floats (f32, f16, bf16) take sum, prod, min, max, avg and premul_sum;
    int32 takes sum, min, max and the bitwise ops.
    """

    __slots__ = ("name", "factor")

    SUM: ReduceOp
    PRODUCT: ReduceOp
    PROD: ReduceOp
    MIN: ReduceOp
    MAX: ReduceOp
    AVG: ReduceOp
    BAND: ReduceOp
    BOR: ReduceOp
    BXOR: ReduceOp

    def __init__(self, name: str, factor: Any = None) -> None:
        key = str(name).lower().replace("-", "_")
        if key not in _NAMES:
            raise InvalidArgument(f"unknown reduction {name!r}: expected one of {sorted(set(_NAMES))}")
        self.name = _NAMES[key]
        self.factor = factor

    @staticmethod
    def premul_sum(factor: Any) -> ReduceOp:
        """Sum of every input multiplied by ``factor`` first."""
        if isinstance(factor, bool) or factor is None:
            raise InvalidArgument("premul_sum needs a numeric factor or a one-element tensor")
        if isinstance(factor, Real):
            factor = float(factor)
        return ReduceOp("premul_sum", factor)

    # torchcomms spells it as a factory on the class.
    PREMUL_SUM = premul_sum

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, ReduceOp)
            and self.name == other.name
            and (self.factor is other.factor or self.factor == other.factor)
        )

    def __hash__(self) -> int:
        return hash((self.name, self.factor if isinstance(self.factor, float) else id(self.factor)))

    def __repr__(self) -> str:
        if self.name == "premul_sum":
            return f"ReduceOp.premul_sum({self.factor!r})"
        return f"ReduceOp.{self.name.upper()}"


for _attr, _name in [
    ("SUM", "sum"),
    ("PRODUCT", "prod"),
    ("PROD", "prod"),
    ("MIN", "min"),
    ("MAX", "max"),
    ("AVG", "avg"),
    ("BAND", "band"),
    ("BOR", "bor"),
    ("BXOR", "bxor"),
]:
    setattr(ReduceOp, _attr, ReduceOp(_name))


def as_op(op: Any) -> ReduceOp:
    """A :class:`ReduceOp` from one, from its name (``"sum"``), or from
    torch.distributed's ``ReduceOp`` (by name; torch's premul_sum carries
    its factor where Python cannot read it, so pass ours)."""
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str):
        return ReduceOp(op)
    name = getattr(op, "name", None)
    if not isinstance(name, str):
        # torch.distributed.ReduceOp prints as "ReduceOp.SUM" / "RedOpType.SUM".
        name = str(op).rsplit(".", 1)[-1].split(":")[0].strip("<> ")
    if name.lower() == "premul_sum":
        raise InvalidArgument("pass ferrocomm.ReduceOp.premul_sum(factor) for a premul_sum")
    return ReduceOp(name)
