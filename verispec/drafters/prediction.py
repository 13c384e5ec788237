"""Predicted outputs: the user supplies text the answer is expected to repeat (a file being edited, a
document being corrected), and its tokens are the drafts, verified like any other point-mass drafts, so
the output's distribution does not change whatever the prediction says.

    drafter = PredictionDrafter(tokenizer.encode(old_code))
    drafter.lookup(context, generated=12, num_drafts=8)   # the prediction's tokens after the match

Drafts per round adapt: up to ``PREDICTION_DRAFTS`` while the prediction is accepted whole, fewer
after a miss (verifying positions costs time even when they are rejected).

Alignment: the output so far is matched into the prediction by its last n tokens (n from ``max_n`` down
to ``min_n``, 2 by default), preferring the occurrence that ends nearest where a copy would be now (the previous match moved
on by the tokens output since), so a copy proceeds through the prediction in order and resynchronises
after an edit. Before the first
output token, or with nothing matching, nothing is drafted that round.
"""

from __future__ import annotations

import torch

from verispec.config import SamplingParams
from verispec.drafters.base import DrafterBase, Proposal

PREDICTION_DRAFTS = 8  # drafts per round from a prediction (a copy is accepted in long runs)
MAX_N, MIN_N = 8, 2  # one shared token is weak evidence that the output is copying the prediction there


class PredictionDrafter(DrafterBase):
    def __init__(self, prediction: list[int], max_n: int = MAX_N, drafts: int = PREDICTION_DRAFTS, min_n: int = MIN_N):
        self.prediction, self.max_n, self.min_n, self.drafts = list(prediction), max_n, min_n, drafts
        self.cursor = 0  # where in the prediction the output was at the last match
        self.output_length = 0  # how long the output was then
        self.prompt_length: int | None = None
        self.length = drafts  # drafts per round now: halved on a miss, doubled on a full hit
        self.proposed: list[int] = []  # the last lookup's drafts

    def reset(self) -> None:
        self.cursor, self.output_length, self.prompt_length = 0, 0, None
        self.length, self.proposed = self.drafts, []

    def commit(self, context: list[int]) -> None:
        """Stateless but for the cursor, which ``lookup`` moves."""

    def lookup(self, output: list[int], num_drafts: int) -> list[int]:
        """Up to ``num_drafts`` prediction tokens that would follow ``output`` (the tokens generated so far)."""
        self._adapt(output)
        num_drafts = min(num_drafts, self.length)
        if not output or num_drafts <= 0 or not self.prediction:
            return []
        for n in range(min(self.max_n, len(output)), self.min_n - 1, -1):
            pattern = output[-n:]
            starts = [i for i in range(len(self.prediction) - n + 1) if self.prediction[i:i + n] == pattern]
            if not starts:
                continue
            # where a copy would be now: the last match moved on by the tokens output since
            expected = self.cursor + len(output) - self.output_length
            start = min(starts, key=lambda s: (abs(s + n - expected), s))
            self.cursor, self.output_length = start + n, len(output)
            self.proposed = self.prediction[self.cursor:self.cursor + num_drafts]
            return self.proposed
        return []

    def _adapt(self, output: list[int]) -> None:
        """Judge the last drafts by what the output did after them: a full hit doubles the drafts per
        round, a miss sets them to one more than were accepted (a verified position is not free)."""
        if not self.proposed:
            return
        since = output[self.output_length:]
        accepted = next((i for i, (a, b) in enumerate(zip(self.proposed, since)) if a != b),
                        min(len(self.proposed), len(since)))
        full = accepted == len(self.proposed)
        self.length = min(self.drafts, 2 * self.length) if full else max(1, min(self.length, accepted + 1))
        self.proposed = []

    def propose(self, context: list[int], num_drafts: int, sampling: SamplingParams,
                generator: torch.Generator) -> Proposal:
        if self.prompt_length is None:  # the first round: the context is the prompt and the first token
            self.prompt_length = len(context) - 1
        output = context[self.prompt_length:]
        return Proposal(torch.tensor(self.lookup(output, min(num_drafts, self.drafts)), dtype=torch.long), None)
