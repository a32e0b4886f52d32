"""95 % Student t intervals and paired differences over seeds (jascl.evaluation.intervals), by hand."""

import math

import pytest

from jascl.evaluation.intervals import T975, Interval, paired_differences, paired_interval, t_interval, t_quantile_975


@pytest.mark.parametrize(
    "df, published",  # two-sided 95 % critical values as every printed t table gives them (3 decimals)
    [(1, 12.706), (2, 4.303), (3, 3.182), (4, 2.776), (5, 2.571), (9, 2.262), (10, 2.228), (20, 2.086),
     (29, 2.045), (30, 2.042), (40, 2.021), (60, 2.000), (120, 1.980)],
)  # fmt: skip
def test_t_quantile_matches_published_tables(df, published):
    assert t_quantile_975(df) == pytest.approx(published, abs=5e-4)


def test_t_quantile_is_continuous_past_the_table_and_tends_to_the_normal():
    assert len(T975) == 30
    assert t_quantile_975(31) < t_quantile_975(30)
    assert t_quantile_975(30) - t_quantile_975(31) < 0.004  # 2.0423 -> 2.0395
    assert t_quantile_975(10**6) == pytest.approx(1.95996, abs=1e-5)
    with pytest.raises(ValueError, match=">= 1"):
        t_quantile_975(0)


def test_t_quantile_against_scipy_where_installed():
    stats = pytest.importorskip("scipy.stats")  # not a dependency of jascl; present through geoopt
    for df in range(1, 201):
        assert t_quantile_975(df) == pytest.approx(float(stats.t.ppf(0.975, df)), abs=2e-6), df


def test_t_interval_one_two_three_by_hand():
    iv = t_interval([1.0, 2.0, 3.0])
    assert (iv.mean, iv.std, iv.n) == (2.0, 1.0, 3)
    assert iv.half_width == pytest.approx(4.302653 / math.sqrt(3))  # = 2.484
    assert iv.half_width == pytest.approx(2.484, abs=5e-4)
    assert (iv.low, iv.high) == pytest.approx((2 - 2.48414, 2 + 2.48414), abs=1e-4)
    assert not iv.excludes_zero()


def test_t_interval_skips_nan_and_needs_two_values():
    iv = t_interval([1.0, math.nan, 3.0, None])
    assert (iv.mean, iv.n) == (2.0, 2)
    assert iv.std == pytest.approx(math.sqrt(2))
    assert iv.half_width == pytest.approx(12.706205)  # t_{0.975,1} * sqrt(2) / sqrt(2)
    one = t_interval([0.4])
    assert one.mean == 0.4 and one.n == 1 and math.isnan(one.half_width)
    none = t_interval([math.nan])
    assert none.n == 0 and math.isnan(none.mean)


def test_paired_differences_by_hand():
    full = [0.5, 0.7, 0.9]
    ablation = [0.4, 0.7, 0.7]
    assert paired_differences(full, ablation) == pytest.approx([0.1, 0.0, 0.2])
    iv = paired_interval(full, ablation)  # differences 0.1, 0, 0.2: mean 0.1, s 0.1
    assert iv.mean == pytest.approx(0.1)
    assert iv.std == pytest.approx(0.1)
    assert iv.half_width == pytest.approx(4.302653 * 0.1 / math.sqrt(3))  # 0.2484: includes 0
    assert not iv.excludes_zero()
    # the pairing removes what both arms share (the seed's difficulty): each arm alone varies twice as much
    assert t_interval(full).std == pytest.approx(0.2)
    assert paired_differences([1.0, math.nan, 3.0], [0.5, 0.2, math.nan]) == [0.5]  # a pair with a NaN drops
    with pytest.raises(ValueError, match="one value per seed"):
        paired_differences([1.0], [1.0, 2.0])


def test_excludes_zero():
    assert Interval(0.3, 0.1, 3, 0.05).excludes_zero()
    assert Interval(-0.3, 0.1, 3, 0.05).excludes_zero()
    assert not Interval(0.05, 0.1, 3, 0.05).excludes_zero()
    assert not Interval(0.3, math.nan, 1, math.nan).excludes_zero()
