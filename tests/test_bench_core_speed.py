"""verispec.bench.core_speed: the forward timer and the transformers-generate rate, on stand-in models (the
script's main needs real checkpoints and minutes; it is run by hand)."""

from __future__ import annotations

import time

import torch

from verispec.bench.core_speed import ForwardTimer, hf_plain_tokens_per_s


class _Slow(torch.nn.Module):
    def forward(self, x, scale=1):
        time.sleep(0.01)
        return x * scale


def test_forward_timer_sums_time_inside_forward_and_passes_arguments_through():
    model = _Slow()
    timer = ForwardTimer(model)
    assert model.forward is timer
    assert model.forward(torch.tensor(2), scale=3).item() == 6
    assert model(torch.tensor(1)).item() == 1  # nn.Module.__call__ goes through the wrapper too
    assert 0.02 <= timer.seconds < 1.0
    del model.forward  # what core_speed does to restore the class method
    model(torch.tensor(1))
    assert 0.02 <= timer.seconds < 1.0 and model.forward.__func__ is _Slow.forward


def test_hf_rate_counts_requested_tokens_and_returns_only_new_ones():
    class _Generator:
        def generate(self, ids, max_new_tokens, min_new_tokens, do_sample, pad_token_id):
            assert max_new_tokens == min_new_tokens == 3 and not do_sample  # greedy, exactly 3 tokens
            time.sleep(0.01)
            return torch.cat([ids, torch.tensor([[7, 8, 9]])], dim=1)

    rate, tokens = hf_plain_tokens_per_s(_Generator(), [1, 2], 3)
    assert tokens == [7, 8, 9] and 0 < rate <= 3 / 0.01
