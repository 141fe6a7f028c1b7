"""Tolerances for comparing a float32 result with a float64 reference.

float32 carries about 6e-8 of relative rounding per operation, and which kernels compute a
reduction (AVX2 or AVX-512, their summation orders) depends on the CPU. A float32 loss cast
to float64 and compared at float64's default tolerance (rtol 1.3e-7 in ``assert_close``,
1e-7 in ``numpy.testing``) therefore passes on one machine and fails on another: CI saw
relative differences of 1.4e-7 to 1.7e-7 on an AMD EPYC without AVX-512. Compare at what
float32 justifies instead: a few hundred units in the last place of a result built from a
few dozen operations.
"""

from __future__ import annotations

import torch

F32_RTOL = 1e-5
"""Relative tolerance for a float32 result against an exact reference (~80 float32 ulps)."""
F32_ATOL = 1e-6
"""Absolute tolerance, for results near zero."""


def assert_f32_close(
    actual: torch.Tensor, expected: torch.Tensor, *, rtol: float = F32_RTOL, atol: float = F32_ATOL
) -> None:
    """``actual`` (computed in float32) equals ``expected`` (any float dtype) to float32 precision."""
    assert actual.dtype in (torch.float32, torch.float16, torch.bfloat16) or expected.dtype == torch.float32, (
        "assert_f32_close is for float32 results; compare float64 results at float64 tolerance"
    )
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol, atol=atol)
