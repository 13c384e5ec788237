"""The model card's measurements and their rendering."""

from __future__ import annotations

import random

import pytest


def test_card_acceptance_pools_prompts_and_brackets_them(tmp_path):
    """The model card's acceptance: pooled over prompts (accepted / proposed, as the engine counts them),
    with a bootstrap interval that brackets the pooled rate; a draft identical to the target accepts all."""
    from verispec.config import SamplingParams, SpecConfig, StopRules
    from verispec.drafters import DraftModelDrafter
    from verispec.engine import SpecEngine
    from verispec.models.llama import load_checkpoint
    from verispec.testing import make_checkpoint
    from verispec.train.card import acceptance_by_workload, render

    target = load_checkpoint(make_checkpoint(tmp_path / "t", 64, hidden=32, layers=2, seed=3, via_transformers=False))
    draft = load_checkpoint(make_checkpoint(tmp_path / "d", 64, hidden=16, layers=1, heads=2, kv_heads=1, seed=4,
                                            via_transformers=False))
    rng = random.Random(0)
    prompts = {"code": [[rng.randrange(1, 64) for _ in range(6)] for _ in range(12)]}
    chain, greedy = SpecConfig(method="chain", gamma=4), SamplingParams(temperature=0.0)

    class Count:
        runs = 0

        def update(self, n):
            self.runs += n

    progress = Count()
    same = acceptance_by_workload(SpecEngine(target, DraftModelDrafter(target)), prompts, chain, greedy, 21, progress)
    assert same["code"]["acceptance_rate"] == 1.0 and same["code"]["acceptance_interval"] == (1.0, 1.0)
    assert same["code"]["committed_per_round"] == 5.0  # 21 tokens: prefill's 1, then 4 rounds of 4 drafts + bonus
    engine = SpecEngine(target, DraftModelDrafter(draft))
    got = acceptance_by_workload(engine, prompts, chain, greedy, 20, progress)["code"]
    assert progress.runs == 24 and got["prompts"] == 12
    runs = [engine.generate(ids, greedy, chain, StopRules(max_tokens=20, ignore_eos=True), seed=seed).stats
            for seed, ids in enumerate(prompts["code"])]
    pooled = sum(s.accepted for s in runs) / sum(s.drafted for s in runs)
    assert got["acceptance_rate"] == pytest.approx(pooled) and 0.0 < pooled < 1.0
    low, high = got["acceptance_interval"]
    assert low < pooled < high
    measured = {"chain_gamma4": {"greedy": {"code": got}, "t1": {"code": got}}, "prompts_per_workload": 12,
                "max_tokens": 20, "early_exit_greedy_gamma4": {}, "unadapted_early_exit_greedy_gamma4": {}}
    assert f"{pooled:.3f} [{low:.3f}-{high:.3f}]" in render(measured)
