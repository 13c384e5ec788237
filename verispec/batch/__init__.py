"""Batched speculative decoding with continuous batching: the engine behind ``serve``.

Every round drafts for all running sequences at once, verifies all of them in ONE target forward, and
commits each sequence's own accepted length. Sequences join (``add``: prefill, first token) and leave
(finish or ``abort``) between rounds. Active sequences occupy cache rows 0..n-1; when one leaves, the
last row moves into its place, so a forward only ever touches the rows in use.

    engine = BatchEngine(target, draft, SpecConfig(gamma=4), max_batch=8)
    events = engine.add(BatchRequest("a", prompt_ids, SamplingParams(temperature=0), StopRules(max_tokens=32)))
    while engine.active:
        events += engine.step()      # BatchEvent(request_id, tokens, finish_reason, ...)

Drafts per round come from ``gamma_policy``: fixed (``spec.gamma``) or adaptive to the batch size
(``verispec.adaptive.AdaptiveGamma``), which switches speculation off where it no longer pays. The
draft model reads a sequence lazily, when it first drafts for it, so rounds at gamma 0 cost what
plain decoding costs: no draft prefill, no draft catch-up. Before a round that would make it read a
backlog, the policy may refuse the switch (``GammaPolicy.afford``: the reads must repay themselves over the
rows' remaining tokens, or fit an exploration budget).
A draft model's chains are drafted for all rows at once (``verispec.batch.draft``), and so are an EAGLE
head's (``verispec.batch.eagle``). Every other drafter (a draft model's or an EAGLE head's static or
dynamic trees in any sibling mode, n-gram chains and trees, self-speculation; any object with the ``Drafter`` protocol) is lent to each row
(``verispec.batch.rows``): rows propose in turn with their own drafter and generator, and one target
pass verifies every row's chain or tree. Each request decodes as ``SpecEngine`` decodes it alone.
Self-speculation's verification is the batched full pass (its early layers' KV is recomputed, not
resumed as ``SpecEngine`` does for one request). Compressed-attention and transformers-backed targets keep
one sequence per cache: the engine wraps them in ``RowLoop`` (``verispec.batch.row_loop``), a cache and a
pass per row, each row's pass the one ``SpecEngine`` would run for it alone.

A request with ``logprobs`` set gets, for each committed token, the target's raw log-softmax there
(before temperature and truncation; with ``logprobs_mode="processed"`` the log of the distribution the
token was sampled from, after penalties, a grammar's mask, temperature and truncation) and the
``logprobs`` most likely alternatives, read off the logits the round already has: the prefill's for the
first token, then row i of the verification pass for the round's i-th committed token, whether accepted,
recovered or bonus. Exact under speculation.

A request under a grammar or with penalties (``verispec.guide``) has its drafts drawn under that
transform and staged, cut at the first draft the grammar forbids, followed by the tokens the grammar
forces, its rows verified under their transforms, and the guide advanced by what it commits.
"""

from verispec.batch.draft import CATCH_UP_ALONE
from verispec.batch.engine import FAULTS, BatchEngine
from verispec.batch.requests import (LOGPROBS_MODES, MIN_LOGPROB, BatchEvent, BatchRequest, TokenLogprob,
                                     token_logprobs)

__all__ = ["BatchEngine", "BatchEvent", "BatchRequest", "CATCH_UP_ALONE", "FAULTS", "LOGPROBS_MODES",
           "MIN_LOGPROB", "TokenLogprob", "token_logprobs"]
