"""Whole decoder layers in one native call (``kernels.decoder_layer``): the same logits and KV cache as
the per-op torch path for every kind of pass the engines make (prefill, decode, chain verification,
trees with staged nodes, ragged batches, early exit), row results independent of the pass, and the
fallbacks (edited weights, disabled, too many rows)."""

import pytest
import torch

from verispec import kernels
from verispec.config import SamplingParams, SpecConfig
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.engine import SpecEngine
from verispec.models.llama import LlamaConfig, LlamaForCausalLM
from verispec.stopping import StopRules

pytestmark = pytest.mark.skipif(kernels.library() is None,
                                reason=f"kernel unavailable here: {kernels.status()}")

CONFIGS = {
    "gqa": dict(num_attention_heads=4, num_key_value_heads=2),
    "mqa": dict(num_attention_heads=4, num_key_value_heads=1),
    "mha_bias": dict(num_attention_heads=2, num_key_value_heads=2, attention_bias=True, mlp_bias=True),
}


def _model(name: str, bf16: bool = True, seed: int = 0, layers: int = 3) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                         max_position_embeddings=128, **CONFIGS[name])
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))  # non-trivial norms and biases
            if bf16:
                parameter.copy_(parameter.to(torch.bfloat16).float())
    assert kernels.accelerate(model) > 0
    return model


class Fused:
    """Context: kernels.FUSED_LAYERS set to ``on``; counts layers run natively, whether one call per
    layer (``decoder_layer``), one for several (``decoder_layers``, a LayerPlan's layers) or one for the
    whole pass of a row (``model_pass``)."""

    def __init__(self, on: bool, monkeypatch):
        self.on, self.calls = on, 0
        one, several, whole = kernels.decoder_layer, kernels.decoder_layers, kernels.model_pass

        def counting_one(*args, **kwargs):
            self.calls += 1
            return one(*args, **kwargs)

        def counting_several(plan, *args, **kwargs):
            self.calls += len(plan.weights)
            return several(plan, *args, **kwargs)

        def counting_whole(pass_args, *args, **kwargs):
            self.calls += len(pass_args.plan.weights)
            return whole(pass_args, *args, **kwargs)
        monkeypatch.setattr(kernels, "decoder_layer", counting_one)
        monkeypatch.setattr(kernels, "decoder_layers", counting_several)
        monkeypatch.setattr(kernels, "model_pass", counting_whole)
        self.monkeypatch = monkeypatch

    def __enter__(self):
        self.monkeypatch.setattr(kernels, "FUSED_LAYERS", self.on)
        return self

    def __exit__(self, *exc):
        self.monkeypatch.setattr(kernels, "FUSED_LAYERS", True)


def _passes(model, cache, fused_on, monkeypatch):
    """The engines' kinds of passes on one cache; returns every logits tensor and the context."""
    out = []
    with Fused(fused_on, monkeypatch) as fused:
        tokens = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(1))
        out.append(model.forward(tokens[:, :10], cache))  # prefill, causal mask over 10 rows
        cache.commit(0, 10)
        for step in range(10, 14):  # decode
            out.append(model.forward(tokens[:, step:step + 1], cache))
            cache.commit(0, 1)
        out.append(model.forward(tokens[:, 14:19], cache))  # chain verification, 2 accepted
        cache.commit(0, 2)
        # a tree: root, two children, a grandchild under the second child
        tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
        out.append(model.forward(tokens[:, 20:24], cache, tree_mask=tree, depths=torch.tensor([0, 1, 1, 2])))
        cache.compact(0, [cache.lengths[0], cache.lengths[0] + 2, cache.lengths[0] + 3])
        # staged drafting: two nodes of this round already in the cache, two new siblings
        cache.commit(0, 0)
        out.append(model.forward(tokens[:, 24:26], cache))
        cache.commit(0, 2)
        staged_mask = torch.tensor([[1, 0, 1, 0], [0, 1, 0, 1]], dtype=torch.bool)
        out.append(model.forward(tokens[:, 26:28], cache, tree_mask=staged_mask, depths=torch.tensor([1, 1]),
                                 staged=2))
        # early exit: 1 layer, then the rest resumed from its hidden states
        hidden = model.run_layers(model.embed(tokens[:, 28:31]), cache, 0, 1)
        out.append(model.run_layers(hidden, cache, 1, model.config.num_hidden_layers))
        calls = fused.calls
    return out, cache, calls


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("bf16", [False, True])
def test_fused_layers_match_the_torch_path(name, bf16, monkeypatch, kernel_path):
    model = _model(name, bf16)
    reference, reference_cache, unfused_calls = _passes(model, model.new_cache(1), False, monkeypatch)
    got, cache, calls = _passes(model, model.new_cache(1), True, monkeypatch)
    assert unfused_calls == 0
    assert calls == 10 * model.config.num_hidden_layers  # every layer of every pass above (9 + early exit)
    for want, have in zip(reference, got):
        torch.testing.assert_close(have, want, rtol=1e-4, atol=1e-4)
    assert cache.lengths == reference_cache.lengths
    written = cache.lengths[0] + 3  # the last pass's uncommitted slots too
    torch.testing.assert_close(cache.keys[:, :, :, :written], reference_cache.keys[:, :, :, :written],
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache.values[:, :, :, :written], reference_cache.values[:, :, :, :written],
                               rtol=1e-5, atol=1e-5)


def test_ragged_batch_matches_torch_path(monkeypatch, kernel_path):
    """Rows of different lengths (the batch engine): each new token goes after its own row's prefix."""
    model = _model("gqa")
    results = []
    for on in (False, True):
        cache = model.new_cache(3)
        with Fused(on, monkeypatch) as fused:
            for row, length in enumerate((5, 9, 2)):
                view = cache.row_view(row)
                model.forward(torch.arange(length)[None] + row, view)
                view.commit(0, length)
                cache.sync_row(row, view)
            first = model.forward(torch.tensor([[7], [8], [9]]), cache)
            for row in range(3):
                cache.commit(row, 1)
            second = model.forward(torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]]), cache)
        results.append((first, second, fused.calls))
    (want1, want2, _), (got1, got2, calls) = results
    assert calls > 0
    torch.testing.assert_close(got1, want1, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got2, want2, rtol=1e-4, atol=1e-4)


def test_a_token_gets_the_same_bits_alone_or_verified_with_others(monkeypatch, kernel_path):
    """Every row is computed on its own in a fixed order: decoding a token alone and verifying it
    among others give bit-identical logits (speculation sees exactly plain decoding's numbers)."""
    model = _model("gqa")
    tokens = torch.randint(0, 96, (1, 14), generator=torch.Generator().manual_seed(3))
    with Fused(True, monkeypatch):
        together_cache = model.new_cache(1)
        model.forward(tokens[:, :8], together_cache)
        together_cache.commit(0, 8)
        together = model.forward(tokens[:, 8:14], together_cache)
        alone_cache = model.new_cache(1)
        model.forward(tokens[:, :8], alone_cache)
        alone_cache.commit(0, 8)
        for step in range(8, 14):
            alone = model.forward(tokens[:, step:step + 1], alone_cache)
            alone_cache.commit(0, 1)
            assert torch.equal(alone[0, 0], together[0, step - 8])



def test_a_tree_node_gets_the_same_bits_as_its_path_decoded_alone(monkeypatch, kernel_path):
    """With a tree mask a node sees only the prefix and its ancestors: its logits are bit-identical to
    decoding its root-to-node path one token at a time, whatever its siblings (the kernel's softmax
    runs over each query's own visible slots, compacted, not over the slots the whole pass sees)."""
    model = _model("gqa")
    tokens = torch.randint(0, 96, (1, 8), generator=torch.Generator().manual_seed(5))
    nodes = torch.tensor([[11, 12, 13, 14, 15]])  # parents: -, 0, 0, 2, 3
    parents = [-1, 0, 0, 2, 3]
    mask = torch.zeros(5, 5, dtype=torch.bool)
    depths = torch.zeros(5, dtype=torch.long)
    for node, parent in enumerate(parents):
        mask[node, node] = True
        if parent >= 0:
            mask[node] |= mask[parent]
            depths[node] = depths[parent] + 1
    with Fused(True, monkeypatch) as fused:
        cache = model.new_cache(1)
        model.forward(tokens, cache)
        cache.commit(0, 8)
        tree = model.forward(nodes, cache, tree_mask=mask, depths=depths)
        for node in (1, 4):
            path = [n for n in range(5) if mask[node, n]]
            alone_cache = model.new_cache(1)
            model.forward(tokens, alone_cache)
            alone_cache.commit(0, 8)
            for index in path:
                alone = model.forward(nodes[:, index:index + 1], alone_cache)
                alone_cache.commit(0, 1)
            assert torch.equal(alone[0, 0], tree[0, node]), node
    assert fused.calls > 0


def test_a_prompt_longer_than_a_fused_pass_runs_in_chunks(monkeypatch, kernel_path):
    """With AMX, a causal pass of one row beyond max_fused() rows (a long prompt) runs as consecutive
    fused passes: logits match torch's per-op path, every token has the bits of decoding it alone, and
    the cache's length is what it was (a pass commits nothing). On the AVX2 loop (slower than torch's
    one big pass there) it takes torch's path."""
    model = _model("gqa")
    monkeypatch.setattr(kernels, "max_fused", lambda: 8)
    tokens = torch.randint(0, 96, (1, 30), generator=torch.Generator().manual_seed(4))
    with Fused(False, monkeypatch):
        reference_cache = model.new_cache(1)
        reference_cache.commit(0, 0)
        model.forward(tokens[:, :3], reference_cache)
        reference_cache.commit(0, 3)
        reference = model.forward(tokens[:, 3:], reference_cache)
    with Fused(True, monkeypatch) as fused:
        cache = model.new_cache(1)
        model.forward(tokens[:, :3], cache)
        cache.commit(0, 3)
        chunked = model.forward(tokens[:, 3:], cache)  # 27 rows: passes of 8, 8, 8, 3 with AMX
        assert cache.lengths == [3]
        assert fused.calls == (1 + (4 if kernel_path == "amx" else 0)) * model.config.num_hidden_layers
        torch.testing.assert_close(chunked, reference, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(cache.keys[:, :, :, :30], reference_cache.keys[:, :, :, :30], rtol=1e-5, atol=1e-5)
        if kernel_path != "amx":
            return
        # Bits: compare hidden states (the LM head of 27 rows may take torch's path on the AVX2 loop).
        layers = model.config.num_hidden_layers
        hidden = model.run_layers(model.embed(tokens[:, 3:]), cache, 0, layers)
        alone_cache = model.new_cache(1)
        model.forward(tokens[:, :3], alone_cache)
        alone_cache.commit(0, 3)
        for step in range(3, 30):
            alone = model.run_layers(model.embed(tokens[:, step:step + 1]), alone_cache, 0, layers)
            alone_cache.commit(0, 1)
            assert torch.equal(alone[0, 0], hidden[0, step - 3]), step

def test_threads_do_not_change_results(monkeypatch):
    model = _model("mqa")
    tokens = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(4))
    before = torch.get_num_threads()
    outputs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            with Fused(True, monkeypatch):
                outputs.append(model.forward(tokens, model.new_cache(1)))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outputs[0], outputs[1])


def test_weights_edited_in_place_reach_the_fused_path(monkeypatch):
    model = _model("gqa")
    tokens = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(5))
    with Fused(True, monkeypatch):
        model.forward(tokens, model.new_cache(1))  # pointers taken
        with torch.no_grad():
            model.model.layers[1].mlp.down_proj.weight.mul_(3.0)
            model.model.layers[0].input_layernorm.weight.mul_(0.5)
            model.model.layers[2].self_attn.k_proj.weight.add_(0.1)
        got = model.forward(tokens, model.new_cache(1))
    with Fused(False, monkeypatch):
        want = model.forward(tokens, model.new_cache(1))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not kernels.amx(), reason="the 128-row limit applies with AMX tiles only")
def test_with_amx_passes_up_to_128_rows_are_fused_and_match_torch(monkeypatch):
    model = _model("gqa")
    tokens = torch.randint(0, 96, (1, 100), generator=torch.Generator().manual_seed(5))
    outputs = []
    for on in (False, True):
        with Fused(on, monkeypatch) as fused:
            outputs.append(model.forward(tokens, model.new_cache(1, 128)))
        assert (fused.calls > 0) == on
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-4, atol=1e-4)


def test_passes_beyond_the_row_limit_and_disabled_use_torch(monkeypatch):
    """A batch of several rows beyond the limit in all takes torch's path (one row is chunked)."""
    model = _model("gqa")
    tokens = torch.randint(0, 96, (2, kernels.max_fused() // 2 + 1))
    with Fused(True, monkeypatch) as fused:
        model.forward(tokens, model.new_cache(2, kernels.max_fused() + 8))
    assert fused.calls == 0
    with Fused(False, monkeypatch) as fused:
        model.forward(tokens[:1, :4], model.new_cache(1))
    assert fused.calls == 0


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=20)])
def test_speculation_with_fused_layers_matches_unfused(sampling, monkeypatch):
    """The same seed gives the same tokens with and without fused layers (greedy: equal to plain)."""
    target, draft = _model("gqa", seed=0, layers=3), _model("mqa", seed=1, layers=1)
    prompt = list(range(1, 9))
    spec = SpecConfig(gamma=3)
    outputs = []
    for on in (False, True):
        with Fused(on, monkeypatch):
            engine = SpecEngine(target, DraftModelDrafter(draft))
            outputs.append(engine.generate(prompt, sampling, spec, StopRules(max_tokens=30), seed=11).tokens)
            if sampling.temperature == 0:
                plain = engine.generate(prompt, sampling, SpecConfig(method="none"), StopRules(max_tokens=30)).tokens
                assert outputs[-1] == plain
    assert outputs[0] == outputs[1]


def test_layers_run_in_one_native_call_unless_one_does_not_qualify(monkeypatch):
    """All layers of a batched pass go to ``decoder_layers`` at once (a LayerPlan; one row's pass goes
    to ``model_pass``); where one layer cannot be fused (here its output projection is a plain
    nn.Linear) the others still run natively one by one and that one takes torch's path, with the same
    logits."""
    model, reference = _model("gqa"), _model("gqa")
    tokens = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(6))
    plans = []
    several = kernels.decoder_layers
    monkeypatch.setattr(kernels, "decoder_layers", lambda plan, *a: plans.append(len(plan.weights)) or several(plan, *a))
    model.forward(tokens, model.new_cache(2))
    assert plans == [model.config.num_hidden_layers]
    plans.clear()
    model.model.layers[1].self_attn.o_proj.__class__ = torch.nn.Linear
    with Fused(True, monkeypatch) as fused:
        got = model.forward(tokens, model.new_cache(2))
        model.forward(tokens[:1], model.new_cache(1))  # one row: no plan, so no one-call pass either
    assert plans == [] and fused.calls == 2 * (model.config.num_hidden_layers - 1)
    with Fused(False, monkeypatch):
        want = reference.forward(tokens, reference.new_cache(2))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def _buffers(model) -> set[int]:
    """The storages every kernel layer's packed (and int8) weights are views of."""
    layers = [m for m in model.modules() if isinstance(m, kernels.SmallRowsLinear)]
    weights = [layer.packed for layer in layers] + [layer.quantized for layer in layers if layer.quantized is not None]
    return {w.untyped_storage().data_ptr() for w in weights}


@pytest.mark.parametrize("quantized", [False, True])
def test_gathered_weights_are_one_block_and_compute_the_same(quantized, monkeypatch):
    monkeypatch.setattr(kernels, "GATHER", False)
    separate = _model("gqa")
    monkeypatch.setattr(kernels, "GATHER", True)
    gathered = _model("gqa")
    if quantized:
        kernels.quantize(gathered)
        monkeypatch.setattr(kernels, "GATHER", False)
        kernels.quantize(separate)
        monkeypatch.setattr(kernels, "GATHER", True)
    assert len(_buffers(gathered)) == 1 and len(_buffers(separate)) > 1
    for module in gathered.modules():  # group members are the group's rows, in order, in the block
        group = getattr(module, "group", None)
        if group is not None:
            offset = group.packed.data_ptr()
            for layer in group.layers:
                assert layer.packed.data_ptr() == offset and layer.group is group
                offset += layer.packed.numel() * layer.packed.element_size()
    tokens = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(2))
    with Fused(True, monkeypatch) as fused:
        for rows in (1, 5):
            want = separate.forward(tokens[:, :rows], separate.new_cache(1))
            assert torch.equal(gathered.forward(tokens[:, :rows], gathered.new_cache(1)), want)
        assert fused.calls > 0


def test_gathering_again_replaces_the_pointers_fused_passes_hold(monkeypatch):
    model = _model("mha_bias")
    tokens = torch.randint(0, 96, (1, 4), generator=torch.Generator().manual_seed(3))
    with Fused(True, monkeypatch):
        want = model.forward(tokens, model.new_cache(1))  # plans and pass arguments hold pointers now
        before = _buffers(model)
        assert kernels.gather(model) > 0
        after = _buffers(model)
        assert len(after) == 1 and not after & before  # a new block; the old one is no longer read
        got = model.forward(tokens, model.new_cache(1))
        qkv = model.model.layers[0].self_attn.q_proj.group
        assert model.model.layers[0]._fused_weights.pointers[1] == qkv.packed.data_ptr()
    assert torch.equal(got, want)
    limited = model._limited_head(32)
    assert limited.packed.untyped_storage().data_ptr() in after
    assert torch.equal(model.head_logits(torch.ones(1, 64), 32)[:, :32], limited(torch.ones(1, 64)))


def test_an_arena_places_parts_in_order_and_refuses_what_does_not_fit():
    parts = [torch.arange(12, dtype=torch.int16).view(3, 4), torch.arange(8, dtype=torch.int16).view(2, 4)]
    arena = kernels.Arena(kernels.Arena.size(parts) + kernels.Arena.size(parts[:1]))
    joined = arena.cat(parts)
    assert torch.equal(joined, torch.cat(parts)) and joined.data_ptr() % kernels.packing.HUGE_PAGE == 0
    single = arena.cat(parts[:1])
    assert torch.equal(single, parts[0]) and single.data_ptr() == joined.data_ptr() + kernels.Arena.ALIGN
    with pytest.raises(ValueError, match="more bytes"):
        arena.cat(parts[:1])
    with pytest.raises(ValueError, match="mixed"):
        kernels.Arena(1024).cat([parts[0], parts[1].float()])


ATTENTION_SHAPES = {  # hidden size, q heads, KV heads: head_dim 72 (16-lane chunks and a tail of 8),
    "d72_group3": (216, 3, 1),  # 128 (two 64-wide chunks), 64, 16 (short chunks); groups 3 (a pair and
    "d128_group3": (384, 3, 1),  # a single head), 2 (one pair) and 4
    "d64_group2": (256, 4, 2),
    "d16_group4": (64, 4, 1),
}


def _attention_model(shape: str) -> LlamaForCausalLM:
    """A random 2-layer model of one of ATTENTION_SHAPES (up to 256 positions), accelerated."""
    hidden, heads, kv_heads = ATTENTION_SHAPES[shape]
    config = LlamaConfig(vocab_size=96, hidden_size=hidden, intermediate_size=96, num_hidden_layers=2,
                         max_position_embeddings=256, num_attention_heads=heads, num_key_value_heads=kv_heads)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    assert kernels.accelerate(model) > 0
    return model


@pytest.mark.skipif(not kernels.avx512(), reason=f"attention pairs run with the AVX-512 loop only "
                    f"({kernels._avx512_reason or 'kernel unavailable'})")
@pytest.mark.parametrize("shape", list(ATTENTION_SHAPES))
def test_attention_pairs_give_the_bits_of_one_query_at_a_time(shape, monkeypatch):
    """Two queries per 512-bit register (set_attention_pairs, the default with AVX-512) do each query's
    arithmetic exactly as the 8-lane code does: every kind of pass (a long causal prefill crossing value
    blocks, decode, verification, a tree mask, a ragged batch of two rows) gives the same bits both ways."""
    model = _attention_model(shape)
    tokens = torch.randint(0, 96, (2, 80), generator=torch.Generator().manual_seed(4))
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)

    def passes(pairs: bool) -> list[torch.Tensor]:
        assert kernels.set_attention_pairs(pairs) == pairs
        try:
            cache, out = model.new_cache(2), []
            out.append(model.forward(tokens[:, :45], cache))
            cache.commit(0, 45)
            cache.commit(1, 37)  # ragged: row 1 keeps fewer slots
            out.append(model.forward(tokens[:, 45:46], cache))
            cache.commit(0, 1)
            cache.commit(1, 1)
            out.append(model.forward(tokens[:, 46:51], cache))
            cache.commit(0, 3)
            cache.commit(1, 5)
            out.append(model.forward(tokens[:1, 60:64], model.new_cache(1), tree_mask=tree,
                                     depths=torch.tensor([0, 1, 1, 2])))
            return out
        finally:
            kernels.set_attention_pairs(True)

    with Fused(True, monkeypatch) as fused:
        paired, single = passes(True), passes(False)
        assert fused.calls > 0
    for a, b in zip(paired, single):
        assert torch.equal(a, b)


@pytest.mark.parametrize("shape", list(ATTENTION_SHAPES))
def test_native_attention_matches_torch_for_other_head_sizes(shape, monkeypatch, kernel_path):
    """Head sizes other than 64 (72: a whole 64-dimension chunk and a tail of 8; 128: two chunks; 16) and
    groups of 2-4 query heads per KV head: the native attention equals the torch path's (to rounding)
    after a prefill long enough to cross several value blocks and the prefetch distance, for a decode
    step and a 5-token verification of a ragged batch."""
    model = _attention_model(shape)
    tokens = torch.randint(0, 96, (2, 160), generator=torch.Generator().manual_seed(5))

    def passes(on: bool) -> tuple[list[torch.Tensor], int]:
        with Fused(on, monkeypatch) as fused:
            cache = model.new_cache(2)
            model.forward(tokens[:, :140], cache)
            cache.commit(0, 140)
            cache.commit(1, 121)  # ragged: row 1 keeps fewer slots
            out = [model.forward(tokens[:, 140:141], cache)]
            cache.commit(0, 1)
            cache.commit(1, 1)
            out.append(model.forward(tokens[:, 141:146], cache))
            return out, fused.calls

    (want, unfused_calls), (got, calls) = passes(False), passes(True)
    assert unfused_calls == 0 and calls > 0
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
