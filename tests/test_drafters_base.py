"""verispec.drafters.base: the Drafter protocol, its defaults and the helpers every drafter shares."""

from __future__ import annotations

import random

import pytest
import torch

from verispec.config import SamplingParams, TreeShape
from verispec.drafters.base import DrafterBase, DraftReads, Proposal, check_drafter, common_prefix_length, head_args
from verispec.errors import VerispecError
from verispec.tree import TokenTree


def test_common_prefix_length_agrees_with_a_slow_scan():
    def slow(a, b):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    rng = random.Random(0)
    for _ in range(500):
        a = [rng.randrange(3) for _ in range(rng.randrange(12))]
        b = a[:rng.randrange(len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(6))]
        assert common_prefix_length(a, b) == slow(a, b), (a, b)


def test_check_drafter_names_what_is_missing():
    class Half:
        def propose(self, context, num_drafts, sampling, generator): ...

        def commit(self, context): ...

    with pytest.raises(VerispecError, match="Half does not implement the Drafter protocol: missing propose_tree, "
                                            "reset, bind, observe, reads, unread, shares_target_cache"):
        check_drafter(Half())

    class Complete(DrafterBase):
        def propose(self, context, num_drafts, sampling, generator): ...

        def commit(self, context): ...

        def reset(self): ...

    check_drafter(Complete())


def test_the_base_drafts_chains_only_and_reports_its_reads():
    class Chains(DrafterBase):
        prompt_s, read_tokens = 0.5, 12

    drafter = Chains()
    with pytest.raises(VerispecError, match="Chains drafts chains only; drop --tree"):
        drafter.propose_tree([1], TreeShape.parse("s3_k2_d6"), "iid", SamplingParams(), torch.Generator())
    assert drafter.reads() == DraftReads(prompt_s=0.5, backlog_s=0.0, tokens=12)
    assert not drafter.shares_target_cache and not drafter.wants_features and drafter.max_context is None


def test_head_args_pass_a_vocabulary_limit_only_when_set():
    assert head_args(None) == {} and head_args(40) == {"vocab_limit": 40}


def test_capped_cuts_a_proposal_to_the_tokens_left():
    chain = Proposal(torch.tensor([5, 6, 7]), None)  # a lookup may draft past the round's gamma
    assert chain.capped(4) is chain and chain.capped(2).tokens.tolist() == [5] and chain.capped(1).num_drafts == 0
    tree = TokenTree(parents=[-1, 0, 1, 2, 0], tokens=[9, 5, 6, 7, 8])  # depth 3, plus a sibling at depth 1
    proposal = Proposal(torch.tensor(tree.tokens[1:]), None, tree)
    assert proposal.capped(4) is proposal  # deep enough to commit all of it plus one token
    cut = proposal.capped(2)  # room for one accepted draft and the token after it
    assert cut.tree.tokens == [9, 5, 8] and cut.tokens.tolist() == [5, 8]
