"""The low-precision floating formats whose range the precision reducer checks a tensor against.

Each format's two constants are exact powers of two or sums of them, so they are exact in
float32 and float64, and ``tests/test_precision.py`` checks them against ``torch.finfo`` of the
matching torch dtype (``max`` and ``smallest_normal * eps``):

======== ============================= =================================== =====================
format   torch dtype                   largest finite value                smallest subnormal
======== ============================= =================================== =====================
bf16     ``torch.bfloat16``            ``(2 - 2**-7) * 2**127`` ≈ 3.3895e38 ``2**-133`` ≈ 9.18e-41
fp16     ``torch.float16``             ``65504``                           ``2**-24`` ≈ 5.96e-8
fp8_e4m3 ``torch.float8_e4m3fn``       ``448``                             ``2**-9`` ≈ 1.95e-3
fp8_e5m2 ``torch.float8_e5m2``         ``57344``                           ``2**-16`` ≈ 1.53e-5
======== ============================= =================================== =====================

``fp8_e4m3`` is the OCP / NVIDIA "fn" variant (no infinities, one NaN pattern), the one
Transformer Engine and ``torch._scaled_mm`` use.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class FloatFormat:
    """A floating-point format's range, by the name its metrics carry.

    Attributes:
        name: Prefix of its metric names (``fp16`` gives ``fp16_overflow_fraction``).
        dtype: The matching torch dtype's attribute name (``float16``).
        max: The largest finite value.
        smallest_subnormal: The smallest positive value (a subnormal).
    """

    name: str
    dtype: str
    max: float
    smallest_subnormal: float


FORMATS: tuple[FloatFormat, ...] = (
    FloatFormat("bf16", "bfloat16", (2 - 2**-7) * 2.0**127, 2.0**-133),
    FloatFormat("fp16", "float16", 65504.0, 2.0**-24),
    FloatFormat("fp8_e4m3", "float8_e4m3fn", 448.0, 2.0**-9),
    FloatFormat("fp8_e5m2", "float8_e5m2", 57344.0, 2.0**-16),
)
"""The formats ``PrecisionReducer`` reports, in the order of its metrics."""
