"""cusparseattn.analyses: the bands and the 32-bit narrowing the kernels learn from a traced rule, checked on
the rule's own C text (compiled with cc) and against the rule at every index."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from test_patterns import band_expr, needs_cc, run_c

from cusparseattn.mods import mask_rule
from cusparseattn.traced import CapturedArray


def bands(fn) -> tuple:
    """(key band, query band) of a mask function, as the kernels get them."""
    rule = mask_rule(fn).whole
    return rule.key_band, rule.query_band


def test_key_band_solves_sums_and_comparisons_for_k():
    """Conjunctions of comparisons of sums, k in one term (+k or -k in all), as first and last keys; anything
    else (or, products, array elements, no k, 2k) has none."""
    assert bands(lambda b, h, q, k, off=0: k <= q + off)[0] == (None, "(q + P0)")
    assert bands(lambda b, h, q, k: (q >= k) & (q - k < 64))[0] == ("((q - P0) + 1)", "q")
    assert bands(lambda b, h, q, k: (q - k < 8) & (q - k > -8))[0] == ("((q - P0) + 1)", "((q - P1) - 1)")
    assert bands(lambda b, h, q, k: (-(k - q) >= -5) & (k - 2 > h))[0] == ("((P1 + h) + 1)", "(q - P0)")
    assert bands(lambda b, h, q, k: (k == q) & (k <= 7) & (k < q))[0] == ("q", "min(min(q, P0), (q - 1))")
    # A term free of k (a block index) may stand beside it.
    assert bands(lambda b, h, q, k: k <= q // 128 * 128)[0] == (None, "((q / 128) * P0)")
    assert bands(lambda b, h, q, k: q * 2 <= k)[0] == ("(q * P0)", None)
    table = CapturedArray(np.arange(8))
    for fn in (
        lambda b, h, q, k: (k <= q) | (k < 5),
        lambda b, h, q, k: table[q] == table[k],
        lambda b, h, q, k: k + k <= q,
        lambda b, h, q, k: q // 64 <= k // 64,
        lambda b, h, q, k: (q >= 3) & (k <= q),
        lambda b, h, q, k: (k <= q) != (q < 3),
    ):
        assert bands(fn)[0] is None


def test_query_band_solves_them_for_q():
    """The same conjunctions solved for q (the queries that see each key), where q is in one term of every
    comparison; a comparison without k bounds no key, one without q no query."""
    assert bands(lambda b, h, q, k, off=0: k <= q + off)[1] == ("(k - P0)", None)
    assert bands(lambda b, h, q, k: (q >= k) & (q - k < 64))[1] == ("k", "((k + P0) - 1)")
    assert bands(lambda b, h, q, k: (k <= q + h) & (k + 3 > q))[1] == ("(k - h)", "((k + P0) - 1)")
    assert bands(lambda b, h, q, k: (q >= 9) & (k <= q + 1)) == (None, ("max(P0, (k - P1))", None))
    for fn in (lambda b, h, q, k: (k >= 5) & (k <= q), lambda b, h, q, k: q + q <= k):
        assert bands(fn)[1] is None


# Random sums over b, h, q, k, two parameters and literals, nested, each with its coefficients of k and q (the
# real and imaginary parts of a complex number).
def _sums():
    def signed(sign, term):
        return sign + term[0], -term[1] if sign == "-" else term[1]

    def joined(first, rest):
        text, coefficient = first
        for op, (t, c) in rest:
            text, coefficient = f"{text} {op} {t}", coefficient + (c if op == "+" else -c)
        return text, coefficient

    def sums_of(terms):
        return st.builds(joined, terms, st.lists(st.tuples(st.sampled_from("+-"), terms), max_size=2))

    atoms = st.sampled_from(["q", "k", "p0", "p1", "b", "h", "3", "0"]).map(
        lambda a: (a, {"k": 1, "q": 1j}.get(a, 0))
    )
    signs = st.sampled_from(["", "-"])
    terms = st.recursive(
        st.builds(signed, signs, atoms),
        lambda inner: st.builds(signed, signs, sums_of(inner).map(lambda s: (f"({s[0]})", s[1]))),
        max_leaves=6,
    )
    return sums_of(terms)


@needs_cc
@settings(max_examples=60, deadline=None)
@given(
    conjuncts=st.lists(
        st.tuples(_sums(), st.sampled_from(["<=", "<", ">=", ">", "=="]), _sums()), min_size=1, max_size=3
    ),
    params=st.tuples(st.integers(-6, 6), st.integers(-6, 6)),
)
def test_bands_are_the_rule(conjuncts, params, tmp_path_factory):
    """Random conjunctions of comparisons of sums, written as Python: a band of keys (of queries) exactly
    where every comparison has k (q) with coefficient +-1, and then the same truth as the rule at every (b,
    h, q, k), in C."""
    source = " & ".join(f"({left} {op} {right})" for (left, _), op, (right, _) in conjuncts)
    print(source, params)
    fn = eval(f"lambda b, h, q, k, p0={params[0]}, p1={params[1]}: {source}")  # noqa: S307 - our own text
    rule = mask_rule(fn)
    for var, band, part in (("k", rule.whole.key_band, "real"), ("q", rule.whole.query_band, "imag")):
        assert (band is not None) == all(
            abs(getattr(cl - cr, part)) == 1 for (_, cl), _, (_, cr) in conjuncts
        )
        if band is not None:
            tmp = tmp_path_factory.mktemp("band")
            same = run_c(rule, 2, 2, 12, 12, tmp, expr=f"({band_expr(band, var)}) == ({rule.c_expr})")
            assert same.all(), var


def test_narrow_rules_are_sums_and_comparisons_of_small_values():
    """TokenRule.narrow: 32-bit arithmetic for C texts without 64-bit calls, shifts or bitwise operations,
    where every integer they compute (bands included) stays below 2^31 at the present values."""
    assert mask_rule(lambda b, h, q, k, p=5: k <= q + p).narrow(1 << 20)
    assert not mask_rule(lambda b, h, q, k, p=5: k <= q + p).narrow(1 << 30)  # the band adds a tile's start
    assert not mask_rule(lambda b, h, q, k, p=2**31 - 64: k <= q + p).narrow(100)
    assert not mask_rule(lambda b, h, q, k: k <= q + 3000000000).narrow(10)
    flags = CapturedArray(np.arange(10))
    assert mask_rule(lambda b, h, q, k: (q // 64 - k // 64 <= 2) & (flags[q] != 0)).narrow(1 << 20)
    big = CapturedArray(np.array([0, 1 << 30]))
    assert not mask_rule(lambda b, h, q, k: big[q] + big[k] >= 1).narrow(100)
    # Products are bounded as the rest: a 2-D table's flat index, a scaled index.
    table = CapturedArray(np.zeros((4, 100), np.int32))
    assert mask_rule(lambda b, h, q, k: table[b, q] == table[b, k]).narrow(100)
    assert not mask_rule(lambda b, h, q, k: q * 3000 <= k).narrow(1 << 20)
    for fn in (
        lambda b, h, q, k: (q - k) % 3 == 0,  # Python's floor modulo: csa::floormod, in 64 bits
        lambda b, h, q, k: (q << 1) <= k,
        lambda b, h, q, k: (q & 7) == (k & 7),
    ):
        assert not mask_rule(fn).narrow(100)
    assert not mask_rule(lambda b, h, q, k: (q - k) % 3 == 0).whole.narrowable


def test_the_partial_output_is_what_is_judged():
    """A rule traced for a layout's blocks compiles its partial output, and that is what `narrow` judges."""
    rule = mask_rule(
        lambda b, h, q, k: (k <= q) & ((q // 128 - k // 128 < 8) | ((k // 128) * 3000000 % 8 == 7)),
        block_size=(128, 128),
    )
    assert rule.kernel_expr == "(k <= q)" and rule.kernel.key_band == (None, "q")
    assert rule.narrow(4096) and not rule.narrow(4096, whole=True)
