"""Speculation on compressed attention (models/compressed.py): scratch pads per branch, accepted-path refresh.

The slow reference everywhere is ``train_forward``: whole sequences from position 0, no state at all.
A scripted drafter (it knows the plain greedy continuation) builds trees whose accepted path runs through
non-first children, whose sibling branches diverge inside a CSA block and complete blocks of their own,
and whose rounds sometimes reject early: the cases where a tree mask alone goes wrong.
"""

from __future__ import annotations

import pytest
import torch

from verispec.audit import AuditConfig, run_audit
from verispec.config import SamplingParams, SpecConfig, StopRules
from verispec.drafters import DraftModelDrafter, NgramDrafter
from verispec.drafters.base import DrafterBase, Proposal
from verispec.engine import SpecEngine
from verispec.errors import CheckpointError, ContextError
from verispec.models.compressed import CompressedConfig, CompressedForCausalLM, load_checkpoint
from verispec.models.llama import load_checkpoint as load_llama
from verispec.testing import make_checkpoint, make_compressed_checkpoint
from verispec.tree import TokenTree

VOCAB = 40
CONFIGS = {  # (window, block, hca_block): CSA only; CSA + HCA; blocks of 3 with a wide window
    "csa4": (5, 4, 0),
    "csa4_hca8": (5, 4, 8),
    "csa3_hca6_w9": (9, 3, 6),
}
GREEDY = SamplingParams(temperature=0)


def random_model(window: int, block: int, hca_block: int, seed: int = 0, scratch_pads: bool = True,
                 vocab: int = VOCAB) -> CompressedForCausalLM:
    torch.manual_seed(seed)
    config = CompressedConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, window=window, block=block,
                              hca_block=hca_block, max_position_embeddings=256)
    model = CompressedForCausalLM(config, scratch_pads=scratch_pads).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.normal_(0.0, 0.4)
    return model


def naive_twin(model: CompressedForCausalLM) -> CompressedForCausalLM:
    twin = CompressedForCausalLM(model.config, scratch_pads=False).eval()
    twin.load_state_dict(model.state_dict())
    return twin


def reference_logits(model: CompressedForCausalLM, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model.train_forward(torch.tensor([tokens]))[0][0]  # (T, V)


def assert_state_matches_prefill(model: CompressedForCausalLM, state, tokens: list[int]) -> None:
    """The committed compressed state equals a fresh prefill of the committed tokens."""
    assert state.length == len(tokens)
    fresh = model.new_cache(1, state.max_len)
    model.forward(torch.tensor([tokens]), fresh)
    fresh.commit(0, len(tokens))
    n = len(tokens)
    assert state.csa_rows == fresh.csa_rows and state.hca_rows == fresh.hca_rows
    pairs = [(state.keys[:, :, :n], fresh.keys[:, :, :n]), (state.values[:, :, :n], fresh.values[:, :, :n]),
             (state.inputs[:, :n], fresh.inputs[:, :n]), (state.hca_sum, fresh.hca_sum)]
    for kind in ("csa", "hca"):
        rows = getattr(state, f"{kind}_rows")
        pairs += [(getattr(state, f"{kind}_{part}")[:, :, :rows], getattr(fresh, f"{kind}_{part}")[:, :, :rows])
                  for part in ("keys", "values")]
    for committed, prefilled in pairs:  # float tolerance: chunked and whole passes sum in other orders
        torch.testing.assert_close(committed, prefilled, atol=1e-4, rtol=1e-4)


# ---- the model against its stateless reference ------------------------------------------------------

@pytest.mark.parametrize("name", CONFIGS)
def test_incremental_chunks_match_whole_sequence_reference(name):
    model = random_model(*CONFIGS[name])
    tokens = torch.randint(0, VOCAB, (41,), generator=torch.Generator().manual_seed(1)).tolist()
    state = model.new_cache(1, 64)
    outputs, start = [], 0
    for size in (9, 1, 3, 1, 5, 2, 7, 13):  # chunks cross block and HCA boundaries at every offset
        outputs.append(model.forward(torch.tensor([tokens[start:start + size]]), state)[0])
        state.commit(0, size)
        start += size
    torch.testing.assert_close(torch.cat(outputs), reference_logits(model, tokens), atol=1e-4, rtol=1e-4)
    assert_state_matches_prefill(model, state, tokens)


# A tree after 13 committed tokens (positions 13..17 with the root at 12): siblings at depth 1 and 2 diverge
# inside the block 12..15, which completes at depth 3 in three different branches; block 16..19 and the
# HCA block of 8 (8..15) complete inside the tree too.
PARENTS = [-1, 0, 0, 1, 1, 2, 3, 4, 5, 6, 6, 9]


@pytest.mark.parametrize("name", CONFIGS)
def test_tree_pass_gives_every_node_the_logits_of_its_own_path(name):
    model = random_model(*CONFIGS[name])
    generator = torch.Generator().manual_seed(2)
    prefix = torch.randint(0, VOCAB, (13,), generator=generator).tolist()
    tokens = [prefix[-1]] + torch.randint(0, VOCAB, (len(PARENTS) - 1,), generator=generator).tolist()
    buffers = TokenTree(parents=PARENTS, tokens=tokens).compile()
    state = model.new_cache(1, 64)
    model.forward(torch.tensor([prefix[:-1]]), state)
    state.commit(0, len(prefix) - 1)
    logits = model.forward(torch.tensor([tokens]), state, tree_mask=buffers.ancestor_mask,
                           depths=buffers.depths)[0]
    assert state.length == len(prefix) - 1  # nothing committed by the pass
    for node in range(len(PARENTS)):
        path = _path_to(node)
        expected = reference_logits(model, prefix[:-1] + [tokens[i] for i in path])[-1]
        torch.testing.assert_close(logits[node], expected, atol=1e-4, rtol=1e-4)
    # Refresh a path through second children, then check the committed state.
    path = _path_to(11)  # 0 -> 1 -> 3 -> 6 -> 9 -> 11
    state.compact(0, [state.length + node for node in path])
    assert_state_matches_prefill(model, state, prefix[:-1] + [tokens[i] for i in path])
    assert state.materialised_count == 1  # only the prefill's path was already in place


def test_tree_mask_alone_is_not_enough():
    """The naive model (compressed rows from the flattened node order, tree mask on raw KV only) agrees on
    chains but gives wrong logits in a tree whose branches diverge inside a block."""
    model = random_model(*CONFIGS["csa4_hca8"])
    naive = naive_twin(model)
    generator = torch.Generator().manual_seed(2)
    prefix = torch.randint(0, VOCAB, (13,), generator=generator).tolist()
    tokens = [prefix[-1]] + torch.randint(0, VOCAB, (len(PARENTS) - 1,), generator=generator).tolist()
    buffers = TokenTree(parents=PARENTS, tokens=tokens).compile()
    outputs = []
    for candidate in (model, naive):
        state = candidate.new_cache(1, 64)
        candidate.forward(torch.tensor([prefix[:-1]]), state)
        state.commit(0, len(prefix) - 1)
        chain = candidate.forward(torch.tensor([tokens[:6]]), state)[0]
        state.pending = None
        tree = candidate.forward(torch.tensor([tokens]), state, tree_mask=buffers.ancestor_mask,
                                 depths=buffers.depths)[0]
        outputs.append((chain, tree))
    torch.testing.assert_close(outputs[0][0], outputs[1][0])
    assert (outputs[0][1] - outputs[1][1]).abs().max() > 0.1


def test_rollback_rebuilds_the_open_blocks():
    model = random_model(*CONFIGS["csa3_hca6_w9"])
    tokens = torch.randint(0, VOCAB, (23,), generator=torch.Generator().manual_seed(3)).tolist()
    state = model.new_cache(1, 64)
    model.forward(torch.tensor([tokens]), state)
    state.commit(0, len(tokens))
    for length in (20, 17, 12, 5):
        state.set_length(0, length)
        assert_state_matches_prefill(model, state, tokens[:length])
    with pytest.raises(ValueError):
        state.set_length(0, 6)  # forward over slots that are no longer committed


def test_refresh_refuses_a_path_that_is_not_one():
    model = random_model(*CONFIGS["csa4"])
    state = model.new_cache(1, 32)
    model.forward(torch.tensor([[1, 2, 3]]), state)
    state.commit(0, 3)
    buffers = TokenTree(parents=[-1, 0, 0], tokens=[3, 4, 5]).compile()
    model.forward(torch.tensor([[3, 4, 5]]), state, tree_mask=buffers.ancestor_mask, depths=buffers.depths)
    with pytest.raises(RuntimeError):
        state.compact(0, [3, 4, 5])  # 1 and 2 are siblings, not a path


# ---- speculation on it: greedy equality with plain decoding -----------------------------------------

class ScriptedDrafter(DrafterBase):
    """Drafts from the known plain greedy continuation ``reference`` (prompt + output). Round r's chain
    is right for r % (K + 1) positions, then wrong; round r's tree has a right and a wrong child per level
    (their order alternates), wrong children grow a branch of their own, and every third round the right
    path stops one level early."""

    def __init__(self, reference: list[int], vocab: int, depth: int = 5):
        self.reference, self.vocab, self.depth, self.round = reference, vocab, depth, 0

    def reset(self) -> None:
        self.round = 0

    def commit(self, context: list[int]) -> None:
        pass  # drafts come from the reference, whatever was committed (a wrong model goes off it)

    def _wrong(self, token: int, salt: int) -> int:
        return (token + 1 + salt % (self.vocab - 1)) % self.vocab

    def propose(self, context, num_drafts, sampling, generator) -> Proposal:
        self.round += 1
        good = self.round % (num_drafts + 1)
        truth = self.reference[len(context):len(context) + num_drafts]
        tokens = [t if i < good else self._wrong(t, i) for i, t in enumerate(truth)]
        return Proposal(torch.tensor(tokens, dtype=torch.long), None)

    def propose_tree(self, context, shape, mode, sampling, generator) -> Proposal:
        self.round += 1
        truth = self.reference[len(context):len(context) + self.depth]
        parents, tokens, right = [-1], [context[-1]], 0
        stop_at = len(truth) - 1 if self.round % 3 == 0 else len(truth)
        for level, token in enumerate(truth):
            correct = token if level < stop_at else self._wrong(token, 7)
            children = [correct, self._wrong(token, level)]
            if (self.round + level) % 2:
                children.reverse()
            first = len(tokens)
            parents += [right, right]
            tokens += children
            wrong = first + children.index(self._wrong(token, level))
            right = first + children.index(correct)
            if level + 1 < len(truth):  # the wrong child's own branch, one more level down
                parents.append(wrong)
                tokens.append(self._wrong(truth[level + 1], level + 3))
        order = sorted(range(len(parents)), key=lambda i: (_depth(parents, i), i))  # parent-first order
        index = {old: new for new, old in enumerate(order)}
        tree = TokenTree(parents=[-1] + [index[parents[i]] for i in order[1:]], tokens=[tokens[i] for i in order])
        return Proposal(torch.tensor(tree.tokens[1:], dtype=torch.long), None, tree)


def _depth(parents: list[int], node: int) -> int:
    depth = 0
    while parents[node] >= 0:
        node, depth = parents[node], depth + 1
    return depth


def _path_to(node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = PARENTS[node]
    return path[::-1]


def plain(model, prompt: list[int], tokens: int) -> list[int]:
    stop = StopRules(max_tokens=tokens, ignore_eos=True)
    return SpecEngine(model).generate(prompt, GREEDY, SpecConfig(method="none"), stop).tokens


PROMPT = [3, 17, 5, 9, 22, 1, 30, 8, 14]


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("method", ["chain", "tree"])
def test_scripted_speculation_equals_plain(name, method):
    model = random_model(*CONFIGS[name])
    expected = plain(model, PROMPT, 40)
    drafter = ScriptedDrafter(PROMPT + expected, VOCAB)
    spec = SpecConfig(method=method, gamma=5) if method == "chain" else SpecConfig(method="tree", tree="s5_k2_d10")
    engine = SpecEngine(model, drafter)
    generation = engine.stream(PROMPT, GREEDY, spec, StopRules(max_tokens=40, ignore_eos=True))
    for _ in generation:
        pass
    assert generation.result.tokens == expected
    stats = generation.result.stats
    assert stats.committed_per_round > 2.5  # deep paths were accepted, so blocks completed inside rounds
    assert_state_matches_prefill(model, generation.cache, (PROMPT + expected)[:generation.cache.length])
    if method == "tree":
        assert generation.cache.materialised_count < generation.cache.refresh_count  # some paths moved


@pytest.mark.parametrize("method", ["chain", "tree"])
def test_naive_model_diverges_under_tree_speculation_only(method):
    model = random_model(*CONFIGS["csa4_hca8"])
    naive = naive_twin(model)
    expected = plain(model, PROMPT, 40)
    assert plain(naive, PROMPT, 40) == expected  # plain decoding never branches: the twins agree
    drafter = ScriptedDrafter(PROMPT + expected, VOCAB)
    spec = SpecConfig(method=method, gamma=5) if method == "chain" else SpecConfig(method="tree", tree="s5_k2_d10")
    result = SpecEngine(naive, drafter).generate(PROMPT, GREEDY, spec, StopRules(max_tokens=40, ignore_eos=True))
    if method == "chain":
        assert result.tokens == expected
    else:
        assert result.tokens != expected


@pytest.fixture(scope="module")
def draft_model(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("draft") / "draft", VOCAB, hidden=32, layers=1, heads=2,
                           kv_heads=1, seed=5, via_transformers=False)
    return load_llama(path)


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("spec", [SpecConfig(method="chain", gamma=4), SpecConfig(method="tree", tree="s3_k2_d6"),
                                  SpecConfig(method="tree", tree="dynamic:6"),
                                  SpecConfig(method="chain", gamma=4, drafter="ngram")],
                         ids=["chain", "tree-static", "tree-dynamic", "ngram"])
def test_real_drafters_equal_plain(name, spec, draft_model):
    model = random_model(*CONFIGS[name])
    prompt = PROMPT * 3  # repeats give the n-gram drafter matches
    expected = plain(model, prompt, 32)
    drafter = NgramDrafter(spec.ngram_max, spec.ngram_min) if spec.drafter == "ngram" else DraftModelDrafter(draft_model)
    result = SpecEngine(model, drafter).generate(prompt, GREEDY, spec, StopRules(max_tokens=32, ignore_eos=True))
    assert result.tokens == expected
    summary = result.stats.summary()
    assert summary["time_split"]["refresh_ms"] > 0
    assert summary["time_split"]["refresh_ms"] <= summary["time_split"]["state_ms"]


def test_compressed_draft_model_rolls_back_like_a_llama_draft(draft_model):
    """A compressed model can also draft (chains, static trees): the draft protocol's set_length works."""
    llama_target = draft_model  # any Llama with the same vocabulary will do as the target here
    drafter_model = random_model(*CONFIGS["csa4_hca8"], seed=9)
    expected = plain(llama_target, PROMPT, 24)
    for spec in (SpecConfig(method="chain", gamma=3), SpecConfig(method="tree", tree="s3_k2_d5")):
        result = SpecEngine(llama_target, DraftModelDrafter(drafter_model)).generate(
            PROMPT, GREEDY, spec, StopRules(max_tokens=24, ignore_eos=True))
        assert result.tokens == expected


# ---- sampling: the output distribution is the target's ----------------------------------------------

@pytest.mark.parametrize("spec,sampling", [
    (SpecConfig(method="chain", gamma=3), SamplingParams(temperature=1.0)),
    (SpecConfig(method="tree", tree="s2_k2_d4", sibling_mode="iid"), SamplingParams(temperature=0.8, top_k=3)),
    (SpecConfig(method="tree", tree="s3_k2_d5", sibling_mode="without_replacement"),
     SamplingParams(temperature=1.0, top_p=0.9)),
], ids=["chain-t1", "tree-iid-topk", "tree-wor-topp"])
def test_sampled_speculation_matches_target_distribution(spec, sampling, tmp_path):
    """Auditor on a 4-token compressed target (blocks of 2, HCA of 4, so blocks complete in every round)."""
    target = random_model(window=3, block=2, hca_block=4, seed=11, vocab=4)
    draft = load_llama(make_checkpoint(tmp_path / "draft", 4, hidden=16, layers=1, heads=2, kv_heads=1, seed=12,
                                       via_transformers=False))
    engine = SpecEngine(target, DraftModelDrafter(draft))
    report = run_audit(engine, [[1, 2, 3, 0, 2]], sampling, spec, AuditConfig(tokens=3, samples=300, seed=0))
    assert report.verdict == "pass", report.as_dict()
    assert report.prompts[0].drafted > 0


# ---- loading and refusals ---------------------------------------------------------------------------

def test_checkpoint_round_trip_and_loader(tmp_path):
    from verispec.loading import build_engine, load_model, load_pair
    from verispec.testing import make_byte_tokenizer

    path = make_compressed_checkpoint(tmp_path / "compressed", 300, seed=4)
    vocab = make_byte_tokenizer(path)
    assert vocab <= 300
    model = load_model(path)
    assert isinstance(model, CompressedForCausalLM)
    again = load_checkpoint(path)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
    torch.testing.assert_close(model.train_forward(ids)[0], again.train_forward(ids)[0])
    with pytest.raises(CheckpointError, match="transformers cannot load it"):
        load_model(path, backend="hf")
    pair = load_pair(path, None, need_draft=False)
    with pytest.raises(CheckpointError, match="early exit"):
        build_engine(pair, SpecConfig(method="chain", drafter="early_exit", exit_layer=1))
    with pytest.raises(ContextError, match="batch 1"):
        model.new_cache(4, 32)


def test_generate_cli_on_a_compressed_target(tmp_path, capsys, byte_pair):
    """`verispec generate --target <compressed dir>` with a Llama draft: greedy spec == plain, refresh timed."""
    import json

    from verispec.cli import main
    from verispec.testing import make_byte_tokenizer

    _, draft = byte_pair
    target = tmp_path / "compressed"
    vocab = make_byte_tokenizer(target)
    make_compressed_checkpoint(target, vocab, seed=6)
    common = ["generate", "abcabc", "--target", str(target), "--max-tokens", "20", "--ignore-eos", "--json"]
    outputs = {}
    for name, extra in {"plain": ["--no-spec"], "chain": ["--draft", str(draft)],
                        "tree": ["--draft", str(draft), "--method", "tree", "--tree", "s3_k2_d6"]}.items():
        assert main(common + extra) == 0
        outputs[name] = json.loads(capsys.readouterr().out)
    assert outputs["chain"]["tokens"] == outputs["plain"]["tokens"] == outputs["tree"]["tokens"]
    assert outputs["tree"]["stats"]["time_split"]["refresh_ms"] > 0
    assert main(common + ["--method", "self", "--exit-layer", "1"]) == 2
    assert "early exit" in capsys.readouterr().err
