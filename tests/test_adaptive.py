"""adaptive.py: the gamma policies on simulated rounds: AdaptiveGamma's climb, margins, per-request
acceptance, prompt-read pricing and the read budget (``GammaPolicy.afford``). The batch engine driving a
policy is tested in test_batch.py."""

from __future__ import annotations

import random

import pytest

from verispec.adaptive import AdaptiveGamma, Backlog, FixedGamma
from verispec.costmodel import expected_tokens


def _drive(policy, batch, round_seconds, accepted, rounds):
    """Run ``rounds`` rounds of a simulated machine; returns the gammas the policy chose."""
    chosen = []
    for _ in range(rounds):
        gamma = policy.choose(batch)
        chosen.append(gamma)
        policy.observe(batch, gamma, round_seconds(gamma), [min(gamma, accepted)] * batch, [gamma] * batch)
    return chosen


def test_adaptive_policy_climbs_only_while_a_larger_gamma_pays():
    # Large batch: every verified position costs a full step, one draft in two accepted: gamma 1 loses
    # to plain decoding, so gamma >= 2 is never paid for (until the periodic neighbour re-measure).
    expensive = _drive(AdaptiveGamma(max_gamma=8, explore_every=50, min_samples=1), 64, lambda g: 0.01 * (1 + g), 0, 40)
    assert expensive[:2] == [0, 1] and set(expensive) == {0, 1} and expensive[-10:] == [0] * 10
    # Nearly free verification and every draft accepted: it climbs to the largest candidate and stays.
    cheap = _drive(AdaptiveGamma(max_gamma=8, explore_every=50, min_samples=1), 1, lambda g: 0.01 + 0.0005 * g, 8, 20)
    assert cheap[:7] == [0, 1, 2, 3, 4, 6, 8] and cheap[-5:] == [8] * 5


def test_adaptive_policy_caps_a_larger_batch_by_the_smaller_batch_decision():
    policy = AdaptiveGamma(max_gamma=8, explore_every=50, min_samples=1)
    _drive(policy, 4, lambda g: 0.01 * (1 + g), 0, 5)  # batch 4: speculation loses, decided gamma 0
    assert policy.last_best[4] == 0
    # Batch 8 on a machine where gamma 1 would look marginally better: capped at 0, no climb at all.
    assert set(_drive(policy, 8, lambda g: 0.01 * (1 + 0.4 * g), 1, 20)) == {0}


def test_adaptive_policy_needs_a_margin_to_leave_plain_decoding():
    # Every draft accepted (E[N] = 2 at gamma 1) but a gamma-1 round costs 1.96 plain rounds: gamma 1
    # is predicted 2% faster than plain decoding, within the 3% margin, so plain decoding is kept.
    chosen = _drive(AdaptiveGamma(max_gamma=8, explore_every=50, min_samples=1), 2, lambda g: 0.01 * (1 + 0.96 * g), 1, 20)
    assert chosen[:2] == [0, 1] and chosen[-10:] == [0] * 10


def test_adaptive_policy_judges_a_candidate_on_several_rounds():
    # gamma 1's first round is fast by accident (0.012 s), its next two slow (0.03 s): judged on the
    # mean of three rounds it loses to plain decoding (0.01 s per round, E[N] 1.5 at gamma 1).
    times = iter([0.01, 0.01, 0.01, 0.012, 0.03, 0.03] + [0.01] * 20)
    policy = AdaptiveGamma(max_gamma=8, explore_every=50)
    chosen = []
    for _ in range(12):
        gamma = policy.choose(4)
        chosen.append(gamma)
        seconds = next(times) if gamma in (0, 1) else 1.0
        policy.observe(4, gamma, seconds, [1, 0, 1, 0] if gamma else [0] * 4, [gamma] * 4)
    assert chosen[:6] == [0, 0, 0, 1, 1, 1] and chosen[6:] == [0] * 6


def test_a_seeded_policy_starts_at_the_profiles_best_and_rescales_to_the_machine():
    # Profile: plain 10 ms, gamma g costs 10 + 2g ms; acceptance 0.8 per position.
    seeded = {g: 0.010 + 0.002 * g for g in (0, 1, 2, 3, 4, 6, 8)}
    policy = AdaptiveGamma(max_gamma=8)
    policy.seed(seeded, [0.8] * 8)
    assert policy.acceptance()[:3] == pytest.approx([0.8, 0.8, 0.8])
    best = max(seeded, key=lambda g: expected_tokens(g, alpha=0.8) / seeded[g] if g else 1 / seeded[0])
    assert policy.choose(1) == best != 0  # no climb from gamma 0
    # This machine runs 1.5x slower than the profiled one: the measured gamma's estimate is real, and
    # the others still unmeasured scale with it, so the profile's ranking holds.
    for _ in range(3):
        policy.observe(1, best, 1.5 * seeded[best], [best], [best])
        assert policy.choose(1) == best
    assert all(policy.round_seconds[(1, g)] == pytest.approx(1.5 * seeded[g]) for g in seeded)
    # A gamma the server has measured keeps its own time when another is measured later.
    policy.observe(1, 1, 0.05, [1], [1])
    assert policy.round_seconds[(1, best)] == pytest.approx(1.5 * seeded[best])
    assert policy.round_seconds[(1, 0)] == pytest.approx(seeded[0] * 0.05 / seeded[1])


def test_adaptive_rate_uses_the_rows_its_rounds_ran_with():
    policy = AdaptiveGamma(max_gamma=4, candidates=(0, 1))
    policy.observe(8, 0, 0.08, [0] * 8, [0] * 8)  # 8 rows, plain: 100 tokens/s
    policy.observe(5, 1, 0.06, [1, 0, 1, 0, 1], [1] * 5)  # 5 rows of the same bucket, gamma 1
    assert policy.predicted_rate(8, 0) == pytest.approx(100.0)
    # E[N] = 1 + 3/5 = 1.6 committed per row and round, over the 5 rows it was measured with.
    assert policy.predicted_rate(8, 1) == pytest.approx(5 * 1.6 / 0.06)


def test_adaptive_policy_gives_each_request_its_own_gamma():
    """Shared round times, per-request acceptance: a request the draft follows gets a long chain, one
    it does not follow gets plain decoding, where one shared gamma would compromise."""
    from verispec.adaptive import AcceptanceCounts

    def run(per_request: bool) -> dict[str, list[int]]:
        rng = random.Random(0)
        policy = AdaptiveGamma(max_gamma=8, explore_every=20, min_samples=1)
        seconds = lambda g: 0.01 * (1 + 0.15 * g)  # noqa: E731  (cheap drafts and verification)
        counts = {"easy": AcceptanceCounts(), "hard": AcceptanceCounts()}
        chosen = {"easy": [], "hard": []}
        for round_index in range(600):
            name = "easy" if round_index % 2 else "hard"
            gamma = policy.choose(1, counts[name] if per_request else None)
            chosen[name].append(gamma)
            rate = 0.95 if name == "easy" else 0.1  # chance that each next draft is accepted
            accepted = 0
            while accepted < gamma and rng.random() < rate:
                accepted += 1
            policy.observe(1, gamma, seconds(gamma), [accepted], [gamma])
            counts[name].add(accepted, gamma)
        return {name: gammas[-100:] for name, gammas in chosen.items()}

    own = run(per_request=True)
    assert own["easy"].count(8) >= 80 and own["hard"].count(0) >= 80
    shared = run(per_request=False)  # one compromise gamma for both
    assert max(set(shared["easy"]), key=shared["easy"].count) == max(set(shared["hard"]), key=shared["hard"].count)


def test_adaptive_policy_backs_off_re_measuring_a_losing_neighbour():
    chosen = _drive(AdaptiveGamma(max_gamma=8, explore_every=10, min_samples=1), 64, lambda g: 0.01 * (1 + g), 0, 2000)
    explored = [i for i, g in enumerate(chosen) if g != 0 and i > 1]  # re-measures of gamma 1
    gaps = [b - a for a, b in zip(explored, explored[1:])]
    assert explored and gaps == sorted(gaps) and gaps[-1] >= 320  # intervals double (capped at 64x)
    assert len(explored) <= 10  # ~0.5% of 2000 rounds, instead of one in ten


def test_adaptive_policy_switches_off_when_verification_is_expensive():
    policy = AdaptiveGamma(max_gamma=4, candidates=(0, 2, 4))
    for _ in range(3):  # measured: every extra verified position costs a full step, acceptance is poor
        for gamma in (0, 2, 4):
            policy.observe(32, gamma, 0.01 * (1 + gamma), [0] * 32, [gamma] * 32)
    assert policy.choose(32) == 0
    cheap = AdaptiveGamma(max_gamma=4, candidates=(0, 2, 4))
    for _ in range(3):  # verification nearly free and drafts always accepted
        for gamma in (0, 2, 4):
            cheap.observe(1, gamma, 0.01 + 0.0005 * gamma, [gamma], [gamma])
    assert cheap.choose(1) == 4


def test_charged_prompt_reading_makes_speculation_dearer():
    """Prompt reads are a cost per committed token while speculating: the mean read over the mean
    output of a finished request. gamma 1 at 1.4 plain rounds for E[N] 1.5 wins by 7% until each
    40-token request's prompt costs 4 ms to read (1.2 ms per 12-token round), then plain decoding is kept."""
    def run(read_s):
        policy = AdaptiveGamma(max_gamma=1, candidates=(0, 1), explore_every=50, min_samples=1)
        chosen = []
        for _ in range(30):
            gamma = policy.choose(8)
            chosen.append(gamma)
            if read_s and gamma:
                policy.charge(8, read_s, prompts=1)
            policy.observe(8, gamma, 0.01 * (1 + 0.4 * gamma), [1, 0] * 4 if gamma else [0] * 8, [gamma] * 8)
            policy.finished(40)
        return policy, chosen

    free, chosen = run(0.0)
    assert chosen[-10:] == [1] * 10 and free.prompt_seconds_per_token() == 0.0
    charged, chosen = run(0.004)
    assert charged.prompt_seconds_per_token() == pytest.approx(0.004 / 40)
    assert charged.predicted_rate(8, 1) == pytest.approx(12 / (0.014 + 12 * 0.004 / 40))
    assert charged.predicted_rate(8, 0) == pytest.approx(8 / 0.01)  # plain decoding reads no prompt
    assert chosen[-10:] == [0] * 10
    assert charged.predicted_rate(4, 1) is None  # another bucket: nothing measured


def test_a_prompt_read_costs_the_same_however_rarely_the_bucket_speculates():
    """A re-measure after 99 rounds at gamma 0 reads the 8 prompts admitted meanwhile in one round: that
    is 8 reads' worth, not 8 per round (which would lock speculation out), and not one read spread over
    100 rounds (which made a bucket that seldom speculates see a fraction of the price)."""
    def price_after(plain_rounds):
        policy = AdaptiveGamma(max_gamma=2, candidates=(0, 1))
        for _ in range(plain_rounds):
            policy.observe(8, 0, 0.01, [0] * 8, [0] * 8)
        for _ in range(4):
            policy.finished(48)
        policy.charge(8, 0.016, prompts=8)  # the re-measure reads 8 prompts, 2 ms each
        policy.observe(8, 1, 0.014, [1, 0] * 4, [1] * 8)
        return policy

    rare, often = price_after(99), price_after(3)
    assert rare.prompt_seconds_per_token() == pytest.approx(0.002 / 48)
    assert rare.predicted_rate(8, 1) == pytest.approx(often.predicted_rate(8, 1))
    assert rare.predicted_rate(8, 1) == pytest.approx(12 / (0.014 + 12 * 0.002 / 48))


def test_a_re_measured_neighbour_gets_a_fresh_estimate():
    """gamma 1 is slow while first measured (the machine was busy), then as fast as it really is: the
    periodic re-measure replaces the stale estimate with a fresh mean, and gamma 1 becomes the best."""
    policy = AdaptiveGamma(max_gamma=1, candidates=(0, 1), explore_every=10)
    busy = {"on": True}

    def seconds(gamma):
        return 0.01 if gamma == 0 else (0.03 if busy["on"] else 0.011)  # gamma 1 commits 2 per round

    chosen = _drive(policy, 1, seconds, 1, 8)
    assert chosen[-2:] == [0, 0]  # gamma 1 measured slow: plain decoding chosen
    busy["on"] = False
    chosen = _drive(policy, 1, seconds, 1, 30)
    assert chosen[-5:] == [1] * 5
    assert policy.round_seconds[(1, 1)] == pytest.approx(0.011)


def test_a_bucket_on_gamma_zero_re_measures_only_as_often_as_its_reads_are_affordable():
    """Leaving gamma 0 at batch 16 makes the draft read every row's backlog (10,000 tokens at 50 us: 0.5 s,
    against 30 ms rounds): at a 2% budget a re-measure of gamma 1 needs 0.5 / 0.02 = 25 s of plain
    rounds (~830) behind it, where with the draft caught up re-measures come after 50, 100, 200, ...
    rounds."""
    def run(backlog_tokens):
        policy = AdaptiveGamma(max_gamma=8, explore_every=50, min_samples=1, switch_budget=0.02)
        policy.reads(1000, 0.05)  # the draft's measured price: 50 us per token
        chosen = []
        for _ in range(2000):
            gamma = policy.afford(16, policy.choose(16), Backlog(backlog_tokens, 16 * 40))
            chosen.append(gamma)
            policy.observe(16, gamma, 0.03 * (1 + gamma), [0] * 16, [gamma] * 16)  # speculation loses
        return [i for i, g in enumerate(chosen) if g and i > 1]  # rounds spent on gamma 1 after the climb

    caught_up = run(0)
    behind = run(10_000)
    assert caught_up[0] < 60 and len(caught_up) >= 5
    starts = [behind[0]] + [b for a, b in zip(behind, behind[1:]) if b > a + 1]
    assert starts[0] >= 0.5 / (0.02 * 0.03)  # the first re-measure waits for its budget too
    assert all(b - a >= 0.5 / (0.02 * 0.03) for a, b in zip(starts, starts[1:])) and len(behind) < len(caught_up)


def test_switching_to_the_best_gamma_must_repay_the_drafts_reads():
    """Batch 2 where gamma 2 commits 2.5 tokens per 1.25 plain rounds (2x the rate): rows that join
    with 400 unread tokens (20 ms of reads at 50 us) switch when they may still generate 20 tokens
    (saving 20 x (5 - 2.5) ms = 50 ms) and stay plain with 4 left (saving 10 ms)."""
    policy = AdaptiveGamma(max_gamma=2, candidates=(0, 2), min_samples=1)
    policy.reads(1000, 0.05)
    for gamma in (0, 2):
        policy.observe(2, gamma, 0.01 * (1 + 0.125 * gamma), [gamma if gamma else 0, 1 if gamma else 0], [gamma] * 2)
    for gamma in (0, 2):
        policy.observe(2, gamma, 0.01 * (1 + 0.125 * gamma), [1 if gamma else 0, gamma if gamma else 0], [gamma] * 2)
    assert policy.choose(2) == 2
    assert policy.afford(2, 2, Backlog(400, 20)) == 2
    assert policy.afford(2, 2, Backlog(400, 4)) == 0
    assert policy.afford(2, 2, Backlog(0, 4)) == 2  # caught up: nothing to repay
    assert FixedGamma(2).afford(2, 2, Backlog(400, 4)) == 2  # a fixed gamma is what the user asked for


def test_a_first_climb_must_be_expected_to_repay_its_reads():
    """Bucket 8 gained 3.4% over plain decoding with gamma 1. At batch 16 the draft would first read
    1,600 tokens (32 ms at 20 us) to try gamma 1 there: expected at best to gain what bucket 8 did over
    rows that may still generate 400 tokens at 4 tokens/ms (100 ms: ~3 ms saved), it stays plain; with
    nothing to read, or 40,000 tokens still to come, it climbs. Batch 1 has nothing smaller to go by
    and climbs at once."""
    policy = AdaptiveGamma(max_gamma=1, candidates=(0, 1), min_samples=1)
    policy.reads(1000, 0.02)
    policy.observe(8, 0, 0.002, [0] * 8, [0] * 8)  # 4 tokens per ms
    policy.observe(8, 1, 0.0029, [1, 0] * 4, [1] * 8)  # E[N] 1.5: 4.14 tokens per ms
    assert policy.choose(8) == 1 and policy._smaller_gain(16) == pytest.approx(1.5 * 0.002 / 0.0029)
    policy.observe(16, 0, 0.004, [0] * 16, [0] * 16)
    assert policy.choose(16) == 1  # the climb it asks for
    assert policy.afford(16, 1, Backlog(1600, 400)) == 0
    assert policy.afford(16, 1, Backlog(0, 400)) == 1
    assert policy.afford(16, 1, Backlog(1600, 40_000)) == 1
    alone = AdaptiveGamma(max_gamma=1, candidates=(0, 1), min_samples=1)
    alone.reads(1000, 0.02)
    alone.observe(1, 0, 0.002, [0], [0])
    assert alone.choose(1) == 1 and alone.afford(1, 1, Backlog(1600, 40)) == 1


def test_a_re_measure_between_speculating_gammas_is_not_a_switch():
    """Best gamma 1: the draft is caught up but for the last round's tokens, so re-measuring gamma 2 is
    not a switch from gamma 0 and no read budget applies (it used to be refused for good, leaving a
    server at gamma 1 when 2-4 were better)."""
    policy = AdaptiveGamma(max_gamma=2, candidates=(0, 1, 2), explore_every=5, min_samples=1)
    policy.reads(1000, 0.05)
    seconds = {0: 0.010, 1: 0.011, 2: 0.020}  # gamma 2's second draft is never accepted: 1 is best
    chosen = []
    for _ in range(40):
        gamma = policy.afford(1, policy.choose(1), Backlog(1, 40))
        chosen.append(gamma)
        policy.observe(1, gamma, seconds[gamma], [min(gamma, 1)], [gamma])
    assert chosen[:3] == [0, 1, 2] and policy.last_best[1] == 1
    assert 2 in chosen[3:]  # re-measured


def test_at_batch_one_the_depth_follows_the_requests_runs():
    """Batch 1 with a request: once speculation is chosen, the depth starts at the cost model's gamma (here
    the largest candidate: every draft is accepted) for each new request, gains RUN_UP after a fully accepted round, loses one after any other, stays within
    [1, 2 x the largest candidate] and is drafted up to the largest candidate."""
    from verispec.adaptive import AcceptanceCounts

    policy = AdaptiveGamma(max_gamma=8, min_samples=1)
    for gamma in policy.candidates:  # measured: cheap drafts and verification, speculation pays
        policy.observe(1, gamma, 0.01 + 0.0005 * gamma, [gamma], [gamma])
    request = AcceptanceCounts()
    chosen = []
    for accepted in [None, None, None, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2]:  # None: every draft accepted
        gamma = policy.choose(1, request)
        chosen.append(gamma)
        policy.observe(1, gamma, 0.01 + 0.0005 * gamma, [gamma if accepted is None else min(accepted, gamma - 1)],
                       [gamma])
        request.add(gamma if accepted is None else min(accepted, gamma - 1), gamma)
    # depth 8 -> 10 -> 12 -> 14 (drafts 8), then -1 per partial round: 13 .. 8 still draft 8, then 7, 6, ...
    assert chosen == [8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 7, 6, 5]
    assert policy.choose(1, AcceptanceCounts()) == 8  # a new request starts again at the top
    for _ in range(40):
        gamma = policy.choose(1, request)
        policy.observe(1, gamma, 0.01 + 0.0005 * gamma, [0], [gamma])
    assert policy.choose(1, request) == 1  # never below one draft while speculating
    fixed = AdaptiveGamma(max_gamma=8, min_samples=1, follow_runs=False)
    for gamma in fixed.candidates:
        fixed.observe(1, gamma, 0.01 + 0.0005 * gamma, [gamma], [gamma])
    assert fixed.choose(1, AcceptanceCounts()) == 8 and fixed.choose(1, request) == 8  # no depth state


def test_a_requests_run_starts_at_the_cost_models_gamma():
    """The depth a new request's run starts at is the cost model's choice, not the largest candidate:
    where the first two drafts are right and the third never, a request starts at gamma 2 (a start at 8
    paid positions that could not be accepted, round after round on the way down) and deepens after a
    fully accepted round; where only the first draft is ever right (the model's gamma 1), a fully
    accepted round is no evidence for a second draft and the request stays at 1."""
    from verispec.adaptive import AcceptanceCounts

    for right, start in ((2, 2), (1, 1)):
        policy = AdaptiveGamma(max_gamma=8, min_samples=1)
        for gamma in policy.candidates:  # cheap verification; the first `right` drafts right, later ones never
            policy.observe(1, gamma, 0.01 + 0.002 * gamma, [min(gamma, right)], [gamma])
        request = AcceptanceCounts()
        assert policy.choose(1, request) == start
        policy.observe(1, start, 0.01 + 0.002 * start, [start], [start])  # fully accepted
        request.add(start, start)
        assert policy.choose(1, request) == (start + AdaptiveGamma.RUN_UP if start >= 2 else start)


def test_following_runs_never_overrides_plain_decoding():
    """Where plain decoding wins at batch 1 the run's depth is not used, and a change of costs that makes
    plain decoding win is noticed within FOLLOW_CHECK_ROUNDS rounds of following."""
    from verispec.adaptive import AcceptanceCounts

    policy = AdaptiveGamma(max_gamma=4, candidates=(0, 2, 4), min_samples=1, window=1)
    request = AcceptanceCounts()
    for gamma in (0, 2, 4):  # each verified position costs a full step and drafts are rarely right
        policy.observe(1, gamma, 0.01 * (1 + gamma), [0], [gamma])
    assert policy.choose(1, request) == 0
    cheap = AdaptiveGamma(max_gamma=4, candidates=(0, 2, 4), min_samples=1, window=1, explore_every=10 ** 6)
    for gamma in (0, 2, 4):
        cheap.observe(1, gamma, 0.01 + 0.0001 * gamma, [gamma], [gamma])
    assert cheap.choose(1, request) == 4
    cheap.observe(1, 4, 0.05, [0], [4])  # the machine changed: speculation now loses
    cheap.observe(1, 2, 0.05, [0], [2])
    for _ in range(3):
        cheap.counts.add(0, 4)
    chosen = [cheap.choose(1, request) for _ in range(cheap.FOLLOW_CHECK_ROUNDS + 1)]
    assert chosen[-1] == 0 and chosen[0] != 0


def test_a_first_climb_is_offered_the_gain_the_smaller_buckets_trend_to():
    """Buckets 4 and 8 gained 27% and 10% over plain decoding: bucket 16 is offered 1 + 0.10^2 / 0.27
    (~3.7%), not bucket 8's 10%, so reading 800 tokens (16 ms) for 768 tokens still to come at 4 tokens
    per ms (a saving of ~7 ms at 3.7%, ~17 ms at 10%) is refused. With one smaller bucket, or gains
    that did not shrink, the nearest gain is offered as before."""
    def decided(gains: dict[int, float]) -> AdaptiveGamma:
        policy = AdaptiveGamma(max_gamma=1, candidates=(0, 1), min_samples=1)
        policy.reads(1000, 0.02)
        for batch, gain in gains.items():
            policy.observe(batch, 0, 0.001 * batch / 4, [0] * batch, [0] * batch)  # 4 tokens per ms
            policy.observe(batch, 1, 0.001 * batch / 4 * 2 / gain, [1] * batch, [1] * batch)  # E[N] 2
            assert policy.choose(batch) == 1
        return policy

    trend = decided({4: 1.27, 8: 1.10})
    assert trend._smaller_gain(16) == pytest.approx(1 + 0.10 ** 2 / 0.27, rel=1e-3)
    trend.observe(16, 0, 0.004, [0] * 16, [0] * 16)
    assert trend.choose(16) == 1  # the climb it would take...
    assert trend.afford(16, 1, Backlog(800, 768)) == 0  # ...is not worth its reads
    assert trend.afford(16, 1, Backlog(800, 40_000)) == 1
    nearest = decided({8: 1.10})
    assert nearest._smaller_gain(16) == pytest.approx(1.10, rel=1e-3)
    nearest.observe(16, 0, 0.004, [0] * 16, [0] * 16)
    assert nearest.afford(16, 1, Backlog(800, 768)) == 1
    growing = decided({4: 1.05, 8: 1.10})
    assert growing._smaller_gain(16) == pytest.approx(1.10, rel=1e-3)
