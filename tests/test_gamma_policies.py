"""gamma_policies.py: the gamma-policy protocol and its check, per-position acceptance counts, and the
simple policies (fixed, transformers' heuristic, the calibration cycle). AdaptiveGamma: test_adaptive.py."""

from __future__ import annotations

import pytest

from verispec.gamma_policies import (Backlog, CycleGamma, FixedGamma, GammaPolicyBase, HFHeuristicGamma,
                                     report_draft_reads)


def test_acceptance_counts_blend_a_request_with_the_shared_prior():
    from verispec.adaptive import AcceptanceCounts

    counts = AcceptanceCounts(4)
    for accepted, drafted in [(2, 2), (0, 2), (1, 2), (2, 3)]:
        counts.add(accepted, drafted)
    # Position 1 reached 4 times, accepted 3; position 2 reached 3 times (after an accepted first), accepted 2.
    assert counts.rates(2) == pytest.approx([3 / 4, 2 / 3])
    # Position 3 reached once (the gamma-3 round), accepted never; position 4 never reached: the prior.
    assert counts.rates(4, prior=[0.5, 0.5, 0.5, 0.25], prior_rounds=4) == pytest.approx(
        [(3 + 2) / 8, (2 + 2) / 7, (0 + 2) / 5, 0.25])


def test_a_policy_missing_part_of_the_protocol_is_refused_by_name():
    from verispec.adaptive import GammaPolicyBase, check_policy
    from verispec.engine import SpecEngine
    from verispec.errors import VerispecError

    class OnlyChooses:
        def choose(self, batch_size=1, request=None):
            return 2

    with pytest.raises(VerispecError, match="OnlyChooses .*missing observe, charge, reads, finished, afford"):
        SpecEngine(object(), gamma_policy=OnlyChooses())

    class Complete(GammaPolicyBase, OnlyChooses):
        pass

    check_policy(Complete())
    assert Complete().afford(4, 3, Backlog(100, 10)) == 3  # the default affords what was chosen


def test_full_share_counts_the_drafting_rounds_that_accepted_every_draft():
    from verispec.gamma_policies import AcceptanceCounts

    counts = AcceptanceCounts(4)
    assert counts.full_share() is None
    for accepted, drafted in [(3, 3), (0, 0), (1, 3), (2, 2)]:  # (0, 0): a plain round, not counted
        counts.add(accepted, drafted)
    assert counts.rounds == 3 and counts.full_share() == pytest.approx(2 / 3)


def test_the_simple_policies():
    assert [FixedGamma(3).choose(b) for b in (1, 8)] == [3, 3]
    cycle = CycleGamma(3)
    assert [cycle.choose() for _ in range(7)] == [1, 2, 3, 1, 2, 3, 1]
    hf = HFHeuristicGamma(initial=4, max_gamma=7)
    chosen = []
    for accepted in ([4], [6], [7], [0], [0], [0], [0], [0], [0]):  # +2 when all accepted (capped), else -1 (min 1)
        gamma = hf.choose()
        chosen.append(gamma)
        hf.observe(1, gamma, 0.01, [min(accepted[0], gamma)], [gamma])
    assert chosen == [4, 6, 7, 7, 6, 5, 4, 3, 2] and hf.choose() == 1
    hf.observe(2, 1, 0.01, [1, 0], [1, 1])  # one row short of all accepted: -1, but never below 1
    assert hf.choose() == 1


def test_draft_reads_are_reported_as_a_charge_and_a_price():
    class Recorder(GammaPolicyBase):
        def __init__(self):
            self.calls = []

        def choose(self, batch_size=1, request=None):
            return 1

        def charge(self, batch_size, seconds, prompts=1):
            self.calls.append(("charge", batch_size, seconds, prompts))

        def reads(self, tokens, seconds):
            self.calls.append(("reads", tokens, seconds))

    policy = Recorder()
    report_draft_reads(policy, 4, 0.02, 300, 0.05, prompts=2)
    report_draft_reads(policy, 4, 0.0, 0, 0.0)  # nothing read: nothing reported
    assert policy.calls == [("charge", 4, 0.02, 2), ("reads", 300, 0.05)]
