"""Confidence intervals over seeds: the Student t interval of a mean and of paired differences.

Conventions:

* Every function takes plain sequences of floats (one value per seed) and skips NaN, so a seed
  whose value is undefined (e.g. a session without new classes) shrinks ``n`` instead of
  poisoning the mean; :class:`Interval` keeps ``n``.
* The interval is two-sided at 95 %: ``mean ± t_{0.975, n-1} · s / sqrt(n)`` with ``s`` the sample
  standard deviation (ddof = 1). With one value the half-width is NaN (no interval), with none the
  mean is NaN too.
* Paired differences (:func:`paired_differences`) are ``a[i] - b[i]`` seed by seed; a pair with a NaN
  on either side is dropped. Their interval is the one-sample t interval of the differences (the
  paired t interval), which removes the between-seed variance both arms share (same seed, same
  data, same base model).

The quantiles ``t_{0.975, df}`` are a table for df = 1..30 (Student's t distribution, six decimals;
the values of every published t table, e.g. 12.706, 4.303, 3.182 for df = 1, 2, 3) and, beyond, the
Cornish-Fisher expansion of the t quantile in the normal quantile (Abramowitz & Stegun 26.7.5, four
terms: error below 1e-7 from df = 30 on). scipy is not a dependency of jascl.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

#: ``T975[df - 1]`` = the 0.975 quantile of Student's t with ``df`` degrees of freedom, df = 1..30
T975: tuple[float, ...] = (
    12.706205, 4.302653, 3.182446, 2.776445, 2.570582, 2.446912, 2.364624, 2.306004, 2.262157, 2.228139,
    2.200985, 2.178813, 2.160369, 2.144787, 2.131450, 2.119905, 2.109816, 2.100922, 2.093024, 2.085963,
    2.079614, 2.073873, 2.068658, 2.063899, 2.059539, 2.055529, 2.051831, 2.048407, 2.045230, 2.042272,
)  # fmt: skip

#: the 0.975 quantile of the standard normal distribution
Z975 = 1.959963984540054


def t_quantile_975(df: int) -> float:
    """The 0.975 quantile of Student's t distribution with ``df`` >= 1 degrees of freedom.

    Raises:
        ValueError: ``df`` < 1.
    """
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1 (got {df})")
    if df <= len(T975):
        return T975[df - 1]
    z, nu = Z975, float(df)
    return (
        z
        + (z**3 + z) / (4 * nu)
        + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * nu**2)
        + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * nu**3)
        + (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / (92160 * nu**4)
    )


@dataclass(frozen=True)
class Interval:
    """A mean with its 95 % Student t confidence interval.

    Attributes:
        mean: the mean of the non-NaN values (NaN if none).
        half_width: ``t_{0.975, n-1} · s / sqrt(n)`` (NaN if n < 2).
        n: how many values entered.
        std: the sample standard deviation, ddof = 1 (NaN if n < 2).
    """

    mean: float
    half_width: float
    n: int
    std: float

    @property
    def low(self) -> float:
        return self.mean - self.half_width

    @property
    def high(self) -> float:
        return self.mean + self.half_width

    def excludes_zero(self) -> bool:
        """Whether the interval lies wholly on one side of 0 (False when there is no interval)."""
        return not math.isnan(self.half_width) and (self.low > 0 or self.high < 0)


def _finite(values: Sequence[float | None]) -> list[float]:
    return [float(v) for v in values if v is not None and not math.isnan(float(v))]


def t_interval(values: Sequence[float | None]) -> Interval:
    """Mean and 95 % Student t interval of ``values`` (NaN and None skipped).

    Example: ``[1, 2, 3]`` -> mean 2, s = 1, half-width 4.303 / sqrt(3) = 2.484.
    """
    vals = _finite(values)
    n = len(vals)
    if n == 0:
        return Interval(math.nan, math.nan, 0, math.nan)
    mean = statistics.fmean(vals)
    if n == 1:
        return Interval(mean, math.nan, 1, math.nan)
    std = statistics.stdev(vals)
    return Interval(mean, t_quantile_975(n - 1) * std / math.sqrt(n), n, std)


def paired_differences(a: Sequence[float | None], b: Sequence[float | None]) -> list[float]:
    """``a[i] - b[i]`` for every index where both are numbers (the seeds both arms ran).

    Raises:
        ValueError: the sequences differ in length (they must be indexed by the same seeds).
    """
    if len(a) != len(b):
        raise ValueError(f"paired values need one value per seed on both sides (got {len(a)} and {len(b)})")
    out = []
    for x, y in zip(a, b):
        if x is None or y is None or math.isnan(float(x)) or math.isnan(float(y)):
            continue
        out.append(float(x) - float(y))
    return out


def paired_interval(a: Sequence[float | None], b: Sequence[float | None]) -> Interval:
    """The 95 % paired t interval of ``a - b`` (seed by seed)."""
    return t_interval(paired_differences(a, b))
