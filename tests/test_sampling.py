"""sampling.py: the logits -> probs pipeline and inverse-CDF sampling with explicit uniforms.

The pipeline is checked on hand examples (where the answer is known without the code) and against a
slow float64 reference that applies temperature -> top-k -> top-p -> min-p in that order. ``sample`` is
checked against a plain-Python inverse CDF in token-id order (docs/algorithms.md, Sampling), and against
the exact Fraction oracle.
"""

from __future__ import annotations

import math
from fractions import Fraction as F

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verispec.config import SamplingParams
from verispec.errors import SamplingError
from verispec.sampling import greedy_ids, logits_to_probs, sample, sample_batch, sample_from
from verispec.verify.exact import sample_exact

LARGEST_BELOW_ONE = math.nextafter(1.0, 0.0)


def probs_after(probs: list[float], **params) -> list[float]:
    """Run the pipeline on logits log(probs), so the filters see exactly these probabilities."""
    logits = torch.tensor(probs, dtype=torch.float64).log()
    return logits_to_probs(logits, SamplingParams(**params)).tolist()


def plain_sample(distribution: list[float], u: float) -> int:
    """Inverse-CDF sampling in token-id order, in plain Python: the first id whose cumulative mass exceeds u."""
    assert 0 <= u < 1
    cumulative = 0
    for token, mass in enumerate(distribution):
        cumulative += mass
        if u < cumulative:
            return token
    raise ValueError("distribution must sum to 1")


def reference_pipeline(logits: np.ndarray, temperature: float, top_k: int, top_p: float,
                       min_p: float) -> tuple[np.ndarray, float]:
    """Slow float64 pipeline in sampling.py's order (docs/algorithms.md, Sampling); also returns how
    close a filter came to a boundary."""
    scaled = logits / temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    margin = math.inf
    if 0 < top_k < len(probs):
        kth = np.sort(probs)[::-1][top_k - 1]
        probs = np.where(probs >= kth, probs, 0.0)
        probs /= probs.sum()
    if top_p < 1:
        keep = np.zeros_like(probs, dtype=bool)
        mass_before = 0.0
        for token in np.argsort(-probs, kind="stable"):
            margin = min(margin, abs(mass_before - top_p))
            if mass_before < top_p:
                keep[token] = True
            mass_before += probs[token]
        probs = np.where(keep, probs, 0.0)
        probs /= probs.sum()
    if min_p > 0:
        threshold = min_p * probs.max()
        margin = min(margin, np.abs(probs[probs > 0] - threshold).min())
        probs = np.where(probs >= threshold, probs, 0.0)
        probs /= probs.sum()
    return probs, margin


# --- logits -> probs ---------------------------------------------------------------------------------

def test_temperature_zero_is_one_hot_on_argmax_lowest_id_on_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, -1.0, 5.0, 5.0], [0.0, 0.0, 0.0, 0.1]])
    probs = logits_to_probs(logits, SamplingParams(temperature=0))
    assert probs.tolist() == [[0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 1]]


def test_temperature_scales_logits_before_softmax():
    logits = torch.randn(5, 7, generator=torch.Generator().manual_seed(0)) * 3
    for temperature in (0.3, 0.7, 1.0, 2.5):
        probs = logits_to_probs(logits, SamplingParams(temperature=temperature))
        assert probs.dtype == torch.float32
        expected = torch.softmax(logits.double() / temperature, dim=-1)
        torch.testing.assert_close(probs.double(), expected, atol=1e-6, rtol=1e-5)


def test_docstring_example():
    logits = torch.tensor([2.0, 1.0, 0.0, -math.inf])
    assert logits_to_probs(logits, SamplingParams()).tolist() == pytest.approx([0.665, 0.245, 0.090, 0], abs=1e-3)
    assert logits_to_probs(logits, SamplingParams(top_k=2)).tolist() == pytest.approx([0.731, 0.269, 0, 0], abs=1e-3)
    assert logits_to_probs(logits, SamplingParams(temperature=0)).tolist() == [1, 0, 0, 0]


def test_top_k_keeps_the_k_most_likely():
    assert probs_after([0.1, 0.4, 0.2, 0.3], top_k=2) == pytest.approx([0, 4 / 7, 0, 3 / 7])
    assert probs_after([0.1, 0.4, 0.2, 0.3], top_k=1) == pytest.approx([0, 1, 0, 0])
    # top_k >= V and top_k = 0 both switch the filter off.
    assert probs_after([0.1, 0.4, 0.2, 0.3], top_k=4) == pytest.approx([0.1, 0.4, 0.2, 0.3])
    assert probs_after([0.1, 0.4, 0.2, 0.3], top_k=0) == pytest.approx([0.1, 0.4, 0.2, 0.3])


def test_top_k_keeps_ties_at_the_boundary():
    # Documented: every token equal to the k-th survives, so the result does not depend on sort order.
    logits = torch.tensor([2.0, 1.0, 1.0, 0.0])
    probs = logits_to_probs(logits, SamplingParams(top_k=2))
    assert (probs > 0).tolist() == [True, True, True, False]
    assert probs[1] == probs[2]


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    probs = [0.5, 0.3, 0.15, 0.05]
    assert probs_after(probs, top_p=0.8) == pytest.approx([0.625, 0.375, 0, 0])  # 0.5 + 0.3 reaches 0.8
    assert probs_after(probs, top_p=0.81) == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0])
    assert probs_after(probs, top_p=0.5) == pytest.approx([1, 0, 0, 0])
    assert probs_after(probs, top_p=0.1) == pytest.approx([1, 0, 0, 0])  # the top token always stays
    assert probs_after([0.05, 0.3, 0.15, 0.5], top_p=0.8) == pytest.approx([0, 0.375, 0, 0.625])  # id order irrelevant


def test_top_p_keeps_tokens_tied_with_a_kept_token():
    logits = torch.tensor([1.0, 1.0, 1.0, 0.0])  # three tokens of ~0.3 each
    probs = logits_to_probs(logits, SamplingParams(top_p=0.5))
    assert (probs > 0).tolist() == [True, True, True, False]


def _top_p_cases():
    """Distributions (R, V) for the fast top-p filter: peaked and flat over SmolLM2's and smaller
    vocabularies, ties, zeroed halves, and a uniform one whose nucleus passes every candidate width."""
    generator = torch.Generator().manual_seed(11)
    for trial in range(60):
        width = (49152, 8192, 300, 5000, 4)[trial % 5]
        scale = float(torch.rand((), generator=generator)) * 12
        logits = torch.randn(1 + trial % 3, width, generator=generator) * scale
        if trial % 4 == 1:  # a few levels only: many ties, some at the boundary
            logits = torch.randint(0, 4, logits.shape, generator=generator).float() * scale
        probs = torch.softmax(logits, -1)
        if trial % 6 == 2:  # a zeroed half, renormalised
            probs[..., :width // 2] = 0
            probs = probs / probs.sum(-1, keepdim=True)
        yield probs
    yield torch.full((2, 49152), 1 / 49152)
    yield torch.softmax(torch.randn(2, 3, 8192, generator=generator), -1).transpose(0, 1)  # 3-D, strided


def test_top_p_filter_is_its_sorted_reference_bit_for_bit():
    """The filter ranks only the nucleus's candidates (or the values alone): it must keep exactly the
    tokens the sort-everything definition keeps, with the same values, at every top_p."""
    from verispec.sampling import TOP_P_WIDTHS, _top_p, top_p_reference

    widest = 0
    for probs in _top_p_cases():
        for top_p in (0.1, 0.5, 0.9, 0.95, 0.99, 0.999999, float(probs.reshape(-1, probs.shape[-1])[0].max())):
            fast, reference = _top_p(probs, top_p), top_p_reference(probs, top_p)
            assert torch.equal(fast, reference), (probs.shape, top_p)
            widest = max(widest, int((reference > 0).sum(-1).max()))
    assert widest > TOP_P_WIDTHS[-1]  # the cases reach the path that ranks every value


def test_min_p_drops_tokens_below_a_fraction_of_the_top():
    probs = [0.5, 0.3, 0.15, 0.05]
    assert probs_after(probs, min_p=0.5) == pytest.approx([0.625, 0.375, 0, 0])  # threshold 0.25
    assert probs_after(probs, min_p=0.3) == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0])  # 0.15
    assert probs_after(probs, min_p=1.0) == pytest.approx([1, 0, 0, 0])
    assert probs_after(probs, min_p=0.0) == pytest.approx(probs)


@pytest.mark.parametrize("probs, params, expected, wrong_order_result", [
    # top-k renormalises before top-p: [4/7, 3/7] and 4/7 already reaches 0.5.
    ([0.4, 0.3, 0.2, 0.1], dict(top_k=2, top_p=0.5), [1, 0, 0, 0], [4 / 7, 3 / 7, 0, 0]),
    # top-p before min-p: top-p keeps [0.625, 0.375]; min-p at 0.3125 keeps both.
    ([0.5, 0.3, 0.2], dict(top_p=0.6, min_p=0.5), [0.625, 0.375, 0], [1, 0, 0]),
    # temperature before top-p: at T=2 the probs flatten to [0.416, 0.322, 0.263], so two are needed.
    ([0.5, 0.3, 0.2], dict(temperature=2.0, top_p=0.5),
     [math.sqrt(0.5) / (math.sqrt(0.5) + math.sqrt(0.3)), math.sqrt(0.3) / (math.sqrt(0.5) + math.sqrt(0.3)), 0],
     [1, 0, 0]),
    # temperature before min-p: at T=2 the ratio 0.322 / 0.416 = 0.77 clears min_p 0.7.
    ([0.5, 0.3, 0.2], dict(temperature=2.0, min_p=0.7),
     [math.sqrt(0.5) / (math.sqrt(0.5) + math.sqrt(0.3)), math.sqrt(0.3) / (math.sqrt(0.5) + math.sqrt(0.3)), 0],
     [1, 0, 0]),
])
def test_filters_compose_in_the_documented_order(probs, params, expected, wrong_order_result):
    assert expected != pytest.approx(wrong_order_result)  # the example really distinguishes the orders
    assert probs_after(probs, **params) == pytest.approx(expected, abs=1e-6)


def test_pipeline_matches_a_slow_reference_in_the_documented_order():
    generator = np.random.default_rng(0)
    compared = 0
    for _ in range(300):
        vocab = int(generator.integers(2, 9))
        logits = generator.normal(size=vocab) * 2
        params = dict(temperature=float(generator.choice([0.5, 1.0, 1.7])),
                      top_k=int(generator.choice([0, 1, 2, 3, 5])),
                      top_p=float(generator.choice([1.0, 0.3, 0.7, 0.9])),
                      min_p=float(generator.choice([0.0, 0.05, 0.2, 0.5])))
        expected, margin = reference_pipeline(logits, **params)
        if margin < 1e-4:  # float32 and float64 may disagree on a token sitting on a filter boundary
            continue
        actual = logits_to_probs(torch.tensor(logits, dtype=torch.float32), SamplingParams(**params))
        np.testing.assert_allclose(actual.numpy(), expected, atol=1e-5, err_msg=str(params))
        compared += 1
    assert compared > 250


def test_rows_sum_to_one_for_every_filter():
    logits = torch.randn(64, 11, generator=torch.Generator().manual_seed(1)) * 4
    for params in [SamplingParams(), SamplingParams(temperature=0), SamplingParams(temperature=0.3, top_k=3),
                   SamplingParams(top_p=0.6), SamplingParams(min_p=0.3),
                   SamplingParams(temperature=1.5, top_k=5, top_p=0.9, min_p=0.1)]:
        probs = logits_to_probs(logits, params)
        assert probs.shape == logits.shape and (probs >= 0).all()
        torch.testing.assert_close(probs.sum(-1), torch.ones(64), atol=1e-5, rtol=0)


# --- SamplingParams validation -----------------------------------------------------------------------

@pytest.mark.parametrize("bad", [dict(temperature=-0.1), dict(temperature=math.nan), dict(temperature=math.inf),
                                 dict(top_p=0.0),
                                 dict(top_p=1.01), dict(top_p=-0.5), dict(top_k=-1), dict(top_k=2.5),
                                 dict(min_p=-0.01), dict(min_p=1.5)])
def test_sampling_params_reject_out_of_range_values(bad):
    name = next(iter(bad))
    with pytest.raises(SamplingError, match=name):
        SamplingParams(**bad)


def test_sampling_params_accept_the_range_edges():
    for good in [dict(temperature=0), dict(top_p=1.0), dict(top_p=1e-6), dict(top_k=0), dict(min_p=0.0),
                 dict(min_p=1.0)]:
        SamplingParams(**good)
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy


# --- inverse-CDF sampling ----------------------------------------------------------------------------

def test_sample_reproduces_plain_inverse_cdf():
    residual, p = [0.0, 1.0, 0.0], [0.5, 0.25, 0.25]  # the worked example's residual, and a dyadic p
    assert sample(torch.tensor(residual), 0.2) == plain_sample(residual, 0.2) == 1
    uniforms = [0.0, 0.2, 0.4999999, 0.5, 0.6, 0.74999, 0.75, 0.9, LARGEST_BELOW_ONE]
    for u in uniforms:
        assert sample(torch.tensor(p), u) == plain_sample(p, u), u
        assert sample(torch.tensor(residual), u) == plain_sample(residual, u) == 1, u


def test_sample_uses_u_at_double_precision():
    # 0.5 - 2**-40 rounds to 0.5 in float32 and would land on the wrong side of the boundary.
    p = torch.tensor([0.5, 0.25, 0.25])
    assert sample(p, 0.5 - 2 ** -40) == 0
    assert sample(p, 0.75 - 2 ** -40) == 1
    assert sample(p, 0.5) == 1


def test_sample_never_returns_a_zero_probability_token():
    cases = [[0.3, 0.7, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0], [0.0, 1e-30, 0.0, 0.0], [2.0, 0.0, 5.0, 0.0],
             [0.0, 3e-8, 0.0, 1e-7, 0.0], [1.0, 1e-12, 0.0]]
    uniforms = [0.0, 1e-300, 0.3, 0.5, 0.999999, 1 - 1e-12, LARGEST_BELOW_ONE]
    for probs in cases:
        for dtype in (torch.float32, torch.float64):
            tensor = torch.tensor(probs, dtype=dtype)
            for u in uniforms:
                assert tensor[sample(tensor, u)] > 0, (probs, dtype, u)
    # A subnormal total: u * total rounds up to the total itself, past every CDF entry.
    tiny = torch.tensor([0.0, 5e-324, 0.0], dtype=torch.float64)
    assert [sample(tiny, u) for u in (0.0, 0.9, LARGEST_BELOW_ONE)] == [1, 1, 1]


def test_sample_accepts_unnormalised_probs():
    # u is scaled by the total mass: [2, 6] behaves as [0.25, 0.75].
    assert [sample(torch.tensor([2.0, 6.0]), u) for u in (0.0, 0.24, 0.26, 0.99)] == [0, 0, 1, 1]
    assert [sample(torch.tensor([0.0, 0.1, 0.0, 0.1]), u) for u in (0.49, 0.51)] == [1, 3]


def test_sample_batch_equals_row_wise_sample():
    generator = torch.Generator().manual_seed(2)
    probs = torch.rand(200, 6, generator=generator)
    probs[probs < 0.3] = 0
    probs[:, 0] += 1e-3  # every row keeps some mass
    uniforms = torch.rand(200, generator=generator, dtype=torch.float64)
    uniforms[:5] = torch.tensor([0.0, LARGEST_BELOW_ONE, 0.5, 1 - 1e-12, 1e-12], dtype=torch.float64)
    tokens = sample_batch(probs, uniforms)
    assert tokens.dtype == torch.int64
    assert tokens.tolist() == [sample(row, float(u)) for row, u in zip(probs, uniforms)]


def test_sample_from_is_reproducible_and_stays_in_support():
    probs = torch.tensor([0.0, 0.2, 0.0, 0.8])
    first = [sample_from(probs, torch.Generator().manual_seed(3)) for _ in range(3)]
    assert len(set(first)) == 1
    generator = torch.Generator().manual_seed(4)
    draws = [sample_from(probs, generator) for _ in range(400)]
    assert set(draws) == {1, 3}
    assert 40 < draws.count(1) < 120  # mean 80, sd 8


@settings(max_examples=200, deadline=None)
@given(weights=st.lists(st.one_of(st.just(0.0), st.floats(1e-6, 1.0)), min_size=1, max_size=8)
       .filter(lambda w: sum(w) > 0),
       u=st.floats(0.0, 1.0, exclude_max=True))
def test_sample_agrees_with_the_exact_oracle(weights, u):
    probs = torch.tensor(weights, dtype=torch.float32)
    token = sample(probs, u)
    assert probs[token] > 0
    exact_probs = [F(x) for x in probs.tolist()]
    total = sum(exact_probs, F(0))
    boundaries = np.cumsum([float(x / total) for x in exact_probs])[:-1]
    if np.min(np.abs(boundaries - u), initial=1.0) > 1e-9:  # away from float ties
        assert token == sample_exact(exact_probs, F(u))


def test_greedy_ids_equal_torch_argmax_with_ties_nan_and_views():
    """numpy's argmax (the fast path) and torch's agree: lowest id on ties, NaN as the largest, any
    shape and stride, int for a vector; other dtypes take torch's own."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 50, generator=generator)
    logits[0, 0, [7, 30]] = 9.0  # a tie: 7
    logits[1, 2, 11] = float("nan")
    cases = [logits, logits[:, -1], logits[2, 1], logits.transpose(0, 1), logits.double(), logits.bfloat16()]
    for case in cases:
        assert greedy_ids(case) == case.argmax(-1).tolist()
    assert greedy_ids(logits[2, 1]) == int(logits[2, 1].argmax()) and isinstance(greedy_ids(logits[2, 1]), int)
    assert greedy_ids(logits)[0][0] == 7 and greedy_ids(logits)[1][2] == 11
