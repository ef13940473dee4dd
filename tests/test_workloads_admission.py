"""Admission rules in front of CLOCK: the compiled replay against the plain-Python reference, bounds, and the
rules' defining behaviour on hand-made traces."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slacktier.errors import SlackTierError
from slacktier.workloads import admission as A
from slacktier.workloads import policies as P
from benchmarks.micro import admission_reference as R
from benchmarks.micro import policy_reference as PR

rules = st.builds(
    A.AdmissionRule,
    prefill_max_order=st.integers(1, 4),
    decode_max_order=st.integers(1, 4),
    probation_share=st.sampled_from([0.0, 0.0, 0.1, 0.3, 0.6]),
    prefill_insert=st.sampled_from(A.PREFILL_INSERTS),
    sketch=st.sampled_from(A.SKETCHES),
    sketch_width=st.sampled_from([0.5, 1.0, 4.0]),
    sketch_reset=st.sampled_from([0.5, 2.0, 10.0]),
)

traces = st.tuples(
    st.lists(st.tuples(st.integers(0, 30), st.booleans(), st.integers(2, 4)), min_size=0, max_size=250),
    st.integers(0, 24),
)


def _arrays(trace):
    seq = [x for x, _, _ in trace]
    ids = np.asarray(seq, dtype=np.int32)
    dec = np.asarray([d for _, d, _ in trace], dtype=bool)
    order = np.asarray([o for _, _, o in trace], dtype=np.int8)
    return seq, ids, dec, order


def _reference(seq, dec, order, cap, rule, allow=None):
    return R.ref_clock_admit(seq, dec.tolist(), order.tolist(), cap, rule.prefill_max_order, rule.decode_max_order,
                             A.probation_slots(rule, cap), rule.prefill_insert == "cold", rule.sketch,
                             A.sketch_bits(rule, cap), A.sketch_reset_lookups(rule, cap), allow)


@settings(max_examples=400, deadline=None)
@given(traces, rules, st.booleans())
def test_compiled_admission_matches_reference(trace, rule, oracle):
    (lookups, cap) = trace
    seq, ids, dec, order = _arrays(lookups)
    allow = A.oracle_allow(ids, dec) if oracle else None
    if oracle:
        assert allow.tolist() == R.ref_oracle_allow(seq, dec.tolist())
    got = A.replay_admission(ids, dec, order, 31, cap, rule, allow)
    assert got.tolist() == _reference(seq, dec, order, cap, rule, None if allow is None else allow.tolist())


@settings(max_examples=200, deadline=None)
@given(traces, rules, st.booleans())
def test_no_rule_beats_belady_with_bypass(trace, rule, oracle):
    (lookups, cap) = trace
    _, ids, dec, order = _arrays(lookups)
    got = A.replay_admission(ids, dec, order, 31, cap, rule, A.oracle_allow(ids, dec) if oracle else None)
    assert int(got[dec].sum()) <= int(P.belady(ids, dec, 31, cap).sum())


def test_oracle_allow_worked_example():
    ids = np.array([4, 6, 4, 6], dtype=np.int32)
    assert A.oracle_allow(ids, np.array([0, 0, 1, 0], bool)).tolist() == [True, False, False, False]


@settings(max_examples=200, deadline=None)
@given(traces)
def test_no_rule_is_textbook_clock(trace):
    (lookups, cap) = trace
    seq, ids, dec, order = _arrays(lookups)
    got = A.replay_admission(ids, dec, order, 31, cap, A.AdmissionRule())
    assert got.tolist() == PR.ref_clock(seq, cap)
    assert got.tolist() == P.clock(ids, 31, cap, evict_ahead=False).tolist()


def test_order_rule_worked_example():
    # the module docstring's example: row 8 (order 4) is never cached under decode_max_order=3
    ids = np.array([5, 8, 5, 8], dtype=np.int32)
    dec = np.ones(4, dtype=bool)
    order = np.array([2, 4, 2, 4], dtype=np.int8)
    rule = A.AdmissionRule(decode_max_order=3)
    assert A.replay_admission(ids, dec, order, 9, 2, rule).tolist() == [0, 0, 1, 0]
    assert A.replay_admission(ids, dec, order, 9, 2, A.AdmissionRule()).tolist() == [0, 0, 1, 1]


def test_probation_keeps_prefill_scans_out_of_clock():
    # rows 0, 1 are read at decode again and again; a scan of 50 prefill rows read once passes between
    hot = [0, 1, 0, 1]
    scan = list(range(2, 52))
    seq = hot + scan + hot
    dec = np.array([True] * 4 + [False] * 50 + [True] * 4)
    ids = np.asarray(seq, dtype=np.int32)
    order = np.full(len(seq), 2, dtype=np.int8)
    plain = A.replay_admission(ids, dec, order, 52, 4, A.AdmissionRule())
    prob = A.replay_admission(ids, dec, order, 52, 4, A.AdmissionRule(probation_share=0.5))
    assert plain[-4:].tolist() == [0, 0, 1, 1]          # the scan flushed CLOCK
    assert prob[-4:].tolist() == [1, 1, 1, 1]           # the scan only ever filled the probationary FIFO


def test_sketch_refuses_a_once_seen_row_over_a_frequent_victim():
    # capacity 1: row 0 seen 5 times, then row 1 once, then row 0: TinyLFU keeps 0, CLOCK swaps it out
    seq = [0, 0, 0, 0, 0, 1, 0]
    ids = np.asarray(seq, dtype=np.int32)
    dec = np.ones(len(seq), dtype=bool)
    order = np.full(len(seq), 2, dtype=np.int8)
    lfu = A.AdmissionRule(sketch="all", sketch_reset=100.0)
    assert A.replay_admission(ids, dec, order, 2, 1, lfu).tolist() == [0, 1, 1, 1, 1, 0, 1]
    assert A.replay_admission(ids, dec, order, 2, 1, A.AdmissionRule()).tolist() == [0, 1, 1, 1, 1, 0, 0]


def test_cold_prefill_rows_go_first():
    # capacity 2: decode row 3, prefill row 7, then decode row 9 needs a slot: CLOCK's hand clears both bits
    # and takes 3 (the older); with 7 inserted cold the hand takes 7 and 3 stays
    ids = np.array([3, 7, 9, 3], dtype=np.int32)
    dec = np.array([True, False, True, True])
    order = np.full(4, 2, dtype=np.int8)
    assert A.replay_admission(ids, dec, order, 10, 2, A.AdmissionRule(prefill_insert="cold")).tolist() == \
        [0, 0, 0, 1]
    assert A.replay_admission(ids, dec, order, 10, 2, A.AdmissionRule()).tolist() == [0, 0, 0, 0]


def test_sizes_and_bad_input():
    rule = A.AdmissionRule(probation_share=0.05, sketch="all", sketch_width=4.0)
    assert A.probation_slots(rule, 1000) == 50
    assert A.probation_slots(rule, 1) == 0
    assert A.probation_slots(A.AdmissionRule(probation_share=0.9), 3) == 2
    assert A.sketch_bits(rule, 1000) == 12            # 4,000 counters -> 4,096
    assert A.sketch_bits(A.AdmissionRule(), 1) == 4   # at least 16
    assert A.lookup_orders(np.array([0, 9, 23]), 8).tolist() == [2, 3, 4]
    assert A.AdmissionRule().label() == "CLOCK"
    for bad in (dict(probation_share=1.0), dict(prefill_insert="warm"), dict(sketch="on"), dict(sketch_width=0),
                dict(decode_max_order=0)):
        with pytest.raises(SlackTierError):
            A.AdmissionRule(**bad)
    ids = np.array([0, 1], dtype=np.int32)
    with pytest.raises(SlackTierError):
        A.replay_admission(ids, np.ones(2, bool), np.full(2, 2, np.int8), 1, 2)      # id 1 outside 0..0
    with pytest.raises(SlackTierError):
        A.replay_admission(ids, np.ones(3, bool), np.full(2, 2, np.int8), 2, 2)      # one flag too many
    with pytest.raises(SlackTierError):
        A.replay_admission(ids, np.ones(2, bool), np.full(2, 2, np.int8), 2, -1)
