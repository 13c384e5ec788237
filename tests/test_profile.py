"""Profiler and planner plumbing (timings themselves are benchmarks, not tests)."""

import json

import pytest

from verispec.cli import main
from verispec.config import SamplingParams, TreeShape
from verispec.drafters import DraftModelDrafter
from verispec.engine import SpecEngine
from verispec.models.llama import load_checkpoint
from verispec.profile import calibrate, plan_from_profile, profile, static_tree


@pytest.mark.parametrize("name", ["s3_k2_d6", "s4_k1_d5", "s2_k3_d7", "s5_k2_d9"])
def test_static_tree_matches_the_drafters_topology(checkpoints, name):
    drafter = DraftModelDrafter(load_checkpoint(checkpoints["draft"]))
    proposal = drafter.propose_tree([1, 2, 3], TreeShape.parse(name), "deterministic", SamplingParams(temperature=0), None)
    assert static_tree(TreeShape.parse(name)).parents == proposal.tree.parents


def test_profile_and_plan(checkpoints, tmp_path):
    target, draft = load_checkpoint(checkpoints["llama"]), load_checkpoint(checkpoints["draft"])
    data = profile(target, draft, context=16, max_positions=4, repeats=1, tree_shapes=("s3_k2_d6",))
    assert set(data["verify_ms"]) == {"1", "2", "3", "4"} and data["decode_ms"] == data["verify_ms"]["1"]
    assert data["draft_ms"] > 0 and "s3_k2_d6" in data["tree_verify_ms"]
    plans, best = plan_from_profile(data, acceptance=[0.9, 0.8])
    assert [p.gamma for p in plans] == [0, 1, 2, 3] and plans[0].speedup == pytest.approx(1.0)
    assert best.speedup == max(p.speedup for p in plans)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(data))
    assert main(["plan", "--profile", str(path), "--acceptance", "0.7", "--json"]) == 0


def test_calibration_measures_conditional_acceptance(checkpoints):
    target = load_checkpoint(checkpoints["llama"])
    engine = SpecEngine(target, DraftModelDrafter(target))  # draft == target: everything accepted
    assert calibrate(engine, [[1, 2, 3]], gamma=3, max_tokens=20)["acceptance"] == [1.0, 1.0, 1.0]


def test_in_situ_costs_feed_the_planner(checkpoints):
    """With in-situ costs the planner uses them, and maps the profiled verify curve onto the in-situ plain
    decoding and verify times: the prediction for the calibration gamma is exactly the in-situ cycle."""
    target = load_checkpoint(checkpoints["llama"])
    calibration = calibrate(SpecEngine(target, DraftModelDrafter(target)), [[1, 2, 3]], gamma=2, max_tokens=20,
                            plain_engine=SpecEngine(target), cycle=False)
    costs = calibration["in_situ"]
    del costs["round_ms"]  # as an older profile JSON has it: the affine model is the fallback
    assert costs["rounds"] > 0 and all(costs[k] > 0 for k in ("draft_ms", "verify_ms", "state_ms", "decode_ms"))
    profile_data = {"verify_ms": {"1": 1.0, "2": 2.0, "3": 4.0, "4": 5.0}, "decode_ms": 1.0, "draft_ms": 0.5,
                    "state_ms": 0.1, "calibration": calibration}
    plans, _ = plan_from_profile(profile_data)
    at_calibration = plans[2]
    assert at_calibration.cycle_ms == pytest.approx(2 * costs["draft_ms"] + costs["verify_ms"] + costs["state_ms"])
    # The curve is mapped affinely: 1 position -> in-situ decode, 3 positions -> in-situ verify; the
    # profiled 4 positions lie 1.25 of that span above 1 position.
    low, high = costs["decode_ms"], costs["verify_ms"]
    assert plans[3].cycle_ms == pytest.approx(3 * costs["draft_ms"] + low + (high - low) * (5.0 - 1.0) / (4.0 - 1.0)
                                              + costs["state_ms"])
    assert at_calibration.speedup == pytest.approx(costs["decode_ms"] / at_calibration.ms_per_token)
    assert plans[0].speedup == pytest.approx(1.0)  # gamma 0 is plain decoding


def test_cycling_calibration_times_every_width_in_situ(checkpoints):
    """The calibration's rounds draft 1, 2, 3, 1, ...: each width is timed, the acceptance still counts
    every round, the draft's prompt reads are split off per token, and the planner's cycles are the
    timed rounds."""
    target = load_checkpoint(checkpoints["llama"])
    engine = SpecEngine(target, DraftModelDrafter(target))  # draft == target: everything accepted
    prompt = list(range(1, 41))
    calibration = calibrate(engine, [prompt, prompt[5:]], gamma=3, max_tokens=30, plain_engine=SpecEngine(target))
    assert calibration["cycle"] and calibration["acceptance"] == [1.0, 1.0, 1.0]
    assert engine.gamma_policy is None  # the engine's own policy is put back
    costs = calibration["in_situ"]
    assert set(costs["round_ms"]) == {"1", "2", "3"} and all(costs["rounds_by_width"][w] >= 2 for w in "123")
    assert costs["read_ms_per_token"] > 0  # each request's first round read its 40-token prompt
    plans, _ = plan_from_profile({"verify_ms": {"1": 1.0, "2": 2.0, "3": 3.0, "4": 4.0}, "calibration": calibration,
                                  "decode_ms": 1.0, "draft_ms": 0.5, "state_ms": 0.1})
    from verispec.profile import local_fit
    fitted = local_fit({int(w): ms for w, ms in costs["round_ms"].items()},
                        {int(w): n for w, n in costs["rounds_by_width"].items()})
    timed = [fitted[1], fitted[2], fitted[3]]
    for gamma in (1, 2, 3):
        assert plans[gamma].cycle_ms == pytest.approx(timed[gamma - 1])
        # Tokens per round: the greedy replay (draft == target: every draft accepted, but the last
        # rounds of each request are cut short by max_tokens, so a little under gamma + 1).
        tokens = calibration["tokens_per_round"][str(gamma)]
        assert gamma < tokens < gamma + 1 and plans[gamma].expected_tokens == tokens
        assert plans[gamma].ms_per_token == pytest.approx(timed[gamma - 1] / tokens + costs["read_ms_per_token"])
        assert plans[gamma].speedup == pytest.approx(costs["decode_ms"] / plans[gamma].ms_per_token)


def test_seed_policy_starts_the_adaptive_policy_at_the_planned_best():
    from verispec.adaptive import AdaptiveGamma
    from verispec.profile import seed_policy

    data = {"verify_ms": {str(n): 5.0 + 0.5 * (n - 1) for n in range(1, 10)}, "decode_ms": 5.0, "draft_ms": 0.8,
            "state_ms": 0.1, "calibration": {"gamma": 8, "acceptance": [0.8] * 8}}
    policy = AdaptiveGamma(max_gamma=8)
    plans, _ = plan_from_profile(data)
    best = max((p for p in plans if p.gamma in policy.candidates), key=lambda p: p.speedup)
    assert seed_policy(policy, data) == best.gamma == policy.choose(1) > 0
    assert policy.round_seconds[(1, 0)] == pytest.approx(plans[0].cycle_ms / 1e3)
    with pytest.raises(ValueError, match="calibrate"):
        seed_policy(AdaptiveGamma(), {k: v for k, v in data.items() if k != "calibration"})


def test_greedy_chain_replay_by_hand():
    from verispec.profile import simulate_greedy_chain

    # 7 generated tokens (token 0 from the prefill); matches for tokens 1..6.
    matches = [[True, True, False, True, True, True]]
    assert simulate_greedy_chain(matches, 2) == 3.0  # rounds commit 1-3 (2 accepted + 1), 4-6
    assert simulate_greedy_chain(matches, 1) == 1.5  # 1-2, 3 (rejected), 4-5, 6 (no room to draft)


@pytest.mark.parametrize("gamma", [1, 2, 4, 6])
def test_greedy_chain_replay_equals_the_engine(checkpoints, gamma):
    """The replay from one plain run and one teacher-forced draft pass commits per round exactly what
    greedy chain speculation does (the reference: the engine itself)."""
    from verispec.config import SpecConfig, StopRules
    from verispec.profile import greedy_matches, simulate_greedy_chain

    target, draft = load_checkpoint(checkpoints["llama"]), load_checkpoint(checkpoints["draft"])
    prompts = [[1, 2, 3, 4, 5], [7, 3, 9], [2] * 12]
    stop = StopRules(max_tokens=40, ignore_eos=True)
    greedy = SamplingParams(temperature=0)
    matches, committed, rounds = [], 0, 0
    for prompt in prompts:
        plain = SpecEngine(target).generate(prompt, greedy, SpecConfig(method="none"), stop)
        matches.append(greedy_matches(draft, prompt, plain.tokens))
        spec = SpecEngine(target, DraftModelDrafter(draft)).generate(prompt, greedy, SpecConfig(gamma=gamma), stop)
        assert spec.tokens == plain.tokens
        committed += sum(r.committed for r in spec.stats.rounds)
        rounds += len(spec.stats.rounds)
    assert 0 < sum(map(sum, matches)) < sum(map(len, matches))  # some drafts accepted, some not
    assert simulate_greedy_chain(matches, gamma) == pytest.approx(committed / rounds)


def test_affine_fit_is_weighted_least_squares():
    from verispec.profile import affine_fit

    # y = 2 + 3x exactly: the line itself; a noisy point with little weight barely moves it.
    assert affine_fit({1: 5.0, 2: 8.0, 3: 11.0}, {1: 1, 2: 1, 3: 1}) == pytest.approx({1: 5.0, 2: 8.0, 3: 11.0})
    fit = affine_fit({1: 5.0, 2: 8.0, 3: 11.0, 4: 30.0}, {1: 100, 2: 100, 3: 100, 4: 1})
    assert fit[1] == pytest.approx(5.0, abs=0.2) and fit[4] < 16
    # Weighted normal equations by hand: points (1, 1), (2, 3), (3, 2) with weights 1, 2, 1.
    # mean x = 2, mean y = 9/4, slope = (1*(-1)(-5/4) + 0 + 1*(1)(-1/4)) / 2 = 1/2.
    assert affine_fit({1: 1.0, 2: 3.0, 3: 2.0}, {1: 1, 2: 2, 3: 1}) == pytest.approx({1: 1.75, 2: 2.25, 3: 2.75})
    # A falling line or too few points: non-decreasing values instead.
    assert affine_fit({1: 3.0, 2: 2.0, 3: 1.0}, {1: 1, 2: 1, 3: 1}) == pytest.approx({1: 2.0, 2: 2.0, 3: 2.0})
    assert affine_fit({1: 3.0, 2: 2.0}, {1: 1, 2: 1}) == pytest.approx({1: 2.5, 2: 2.5})


def test_local_fit_follows_bends_and_averages_noise():
    from verispec.profile import affine_fit, local_fit

    # A bend: 10, 13, 16 then steeper. One line through all misses width 1 by a lot; the local fit,
    # a line through widths 1-3, gives it exactly.
    bent = {1: 10.0, 2: 13.0, 3: 16.0, 4: 25.0, 5: 34.0, 6: 43.0}
    ones = {w: 1 for w in bent}
    assert affine_fit(bent, ones)[1] < 9.0
    local = local_fit(bent, ones)
    assert local[1] == pytest.approx(10.0) and local[6] == pytest.approx(43.0)
    assert local[3] == pytest.approx(18.0)  # widths 2-4 (13, 16, 25): the bend averaged in
    # Noise in one width is shared with its neighbours, weighted by their rounds.
    noisy = local_fit({1: 10.0, 2: 14.0, 3: 12.0, 4: 14.0}, {1: 10, 2: 1, 3: 10, 4: 10})
    assert 11.0 < noisy[2] < 12.0
    assert list(noisy.values()) == sorted(noisy.values())  # non-decreasing
    assert local_fit({1: 3.0, 2: 2.0}, {1: 1, 2: 1}) == affine_fit({1: 3.0, 2: 2.0}, {1: 1, 2: 1})


def test_monotone_pools_decreasing_runs():
    from verispec.profile import monotone

    assert monotone([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    assert monotone([8.7, 8.0, 8.2, 9.0, 8.6, 10.0]) == pytest.approx([8.3, 8.3, 8.3, 8.8, 8.8, 10.0])
    assert monotone([3.0, 2.0, 1.0]) == pytest.approx([2.0, 2.0, 2.0])
    # The least-squares non-decreasing fit: no other non-decreasing sequence is closer (brute check).
    import itertools
    values = [2.0, 1.0, 3.0, 2.5]
    fit = monotone(values)
    assert all(a <= b for a, b in zip(fit, fit[1:]))
    error = sum((f - v) ** 2 for f, v in zip(fit, values))
    grid = [x / 4 for x in range(0, 17)]
    for candidate in itertools.product(grid, repeat=4):
        if all(a <= b for a, b in zip(candidate, candidate[1:])):
            assert sum((c - v) ** 2 for c, v in zip(candidate, values)) >= error - 1e-9


def test_planner_never_prefers_a_gamma_for_a_dip_in_the_profile():
    """A profile whose 5-position verify dips below 4 positions: after the monotone fit gamma 4's
    verification costs at least gamma 3's."""
    profile_data = {"verify_ms": {"1": 8.7, "2": 8.0, "3": 8.2, "4": 9.0, "5": 8.6, "6": 10.0},
                    "decode_ms": 8.7, "draft_ms": 1.0, "state_ms": 0.1}
    plans, _ = plan_from_profile(profile_data, acceptance=[0.8] * 5)
    verify = [p.cycle_ms - p.gamma * 1.0 - 0.1 for p in plans[1:]]
    assert all(a <= b + 1e-9 for a, b in zip(verify, verify[1:]))
    assert plans[1].cycle_ms == pytest.approx(1.0 + 8.3 + 0.1)


def test_the_draft_step_is_timed_as_the_drafter_takes_it(checkpoints, monkeypatch):
    """One token, the last position's logits only, and only the ids the drafter may propose."""
    target, draft = load_checkpoint(checkpoints["llama"]), load_checkpoint(checkpoints["draft"])
    seen = []
    real = draft.forward
    monkeypatch.setattr(draft, "forward", lambda tokens, cache, **kwargs: seen.append((tokens.shape, kwargs))
                        or real(tokens, cache, **kwargs))
    data = profile(target, draft, context=8, max_positions=2, repeats=2, tree_shapes=(), draft_vocab=40)
    assert data["draft_vocab"] == 40
    timed = [kwargs for shape, kwargs in seen if shape == (1, 1)]
    assert timed and all(kwargs == {"last_only": True, "vocab_limit": 40} for kwargs in timed)
