"""Dense projection x @ weight.T (+ bias): every nn.Linear of the model spec (and the router's GEMM) runs
through the implementation resolved here. "torch" is `F.linear` (what nn.Linear does); "exact" reduces
each output over K in one fixed order, so a row's result never depends on the other rows of the call
(exact mode, `exact.py`).
"""

from ..dispatch import resolve
from .reference import linear_ref

IMPLS = {
    "torch": "verl_moe.ops.linear.reference:linear_ref",
    "exact": "verl_moe.ops.linear.exact:linear_exact",
}


def linear(x, weight, bias=None, impl: str | None = None):
    """x [..., K] @ weight [N, K].T (+ bias [N]) -> [..., N] through `resolve("linear", impl)`."""
    return resolve("linear", impl)(x, weight, bias)


__all__ = ["IMPLS", "linear", "linear_ref"]
