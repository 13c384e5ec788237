"""One row's whole pass in one native call (``LlamaForCausalLM._one_call``, ``kernels.model_pass``): the same
bits as the step-by-step path (embedding, fused layers, final norm, LM head) for prefill, decode,
verification, a limited draft vocabulary and int8 draft weights, and the fallbacks to the steps."""

import pytest
import torch

from verispec import kernels
from verispec.models.llama import LlamaConfig, LlamaForCausalLM

pytestmark = pytest.mark.skipif(kernels.library() is None,
                                reason=f"kernel unavailable here: {kernels.status()}")


def _model(seed: int = 0, tied: bool = False) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=tied)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
            parameter.copy_(parameter.to(torch.bfloat16).float())
    kernels.accelerate(model)
    return model


def _steps(model, tokens, cache, last_only=False, vocab_limit=None):
    """The step-by-step path the one call replaces (in inference mode, as ``forward`` runs)."""
    with torch.inference_mode():
        hidden = model.run_layers(model.embed(tokens), cache, 0, model.config.num_hidden_layers)
        return model.logits(hidden[:, -1:] if last_only else hidden, vocab_limit)


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("tied", [False, True])
def test_one_call_gives_the_steps_bits(int8, tied, kernel_path, monkeypatch):
    model = _model(tied=tied)
    if int8:
        kernels.quantize(model)
    calls = []
    real = kernels.model_pass
    monkeypatch.setattr(kernels, "model_pass", lambda *a, **k: calls.append(1) or real(*a, **k))
    tokens = torch.randint(0, 96, (1, 20), generator=torch.Generator().manual_seed(3))
    fast_cache, slow_cache = model.new_cache(1, 64), model.new_cache(1, 64)
    passes = [(slice(0, 9), dict(last_only=True)),                      # prefill
              (slice(9, 10), dict(last_only=True, vocab_limit=40)),     # a draft step, limited ids
              (slice(10, 11), {}),                                      # plain decode
              (slice(11, 16), {}),                                      # verification of 4 drafts
              (slice(16, 18), dict(last_only=True, vocab_limit=40))]    # a draft's backlog
    for part, kwargs in passes:
        fast = model.forward(tokens[:, part], fast_cache, **kwargs)
        slow = _steps(model, tokens[:, part], slow_cache, **kwargs)
        assert torch.equal(fast, slow), (part, kwargs)
        commit = part.stop - part.start - (1 if part.stop == 16 else 0)
        fast_cache.commit(0, commit)
        slow_cache.commit(0, commit)
    assert len(calls) == len(passes)
    length = fast_cache.lengths[0]
    assert torch.equal(fast_cache.keys[:, :, :, :length], slow_cache.keys[:, :, :, :length])


def test_passes_the_one_call_does_not_take_run_the_steps(monkeypatch):
    model = _model()
    calls = []
    real = kernels.model_pass
    monkeypatch.setattr(kernels, "model_pass", lambda *a, **k: calls.append(1) or real(*a, **k))
    tokens = torch.randint(0, 96, (2, 6), generator=torch.Generator().manual_seed(4))
    model.forward(tokens, model.new_cache(2, 32))  # two rows: the batch path
    cache = model.new_cache(1, 32)
    model.forward(tokens[:1], cache, num_layers=1)  # early exit
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    model.forward(tokens[:1, :3], cache, tree_mask=tree, depths=torch.tensor([0, 1, 1]))
    monkeypatch.setattr(kernels, "FUSED_LAYERS", False)
    model.forward(tokens[:1], model.new_cache(1, 32))
    assert calls == []
    monkeypatch.setattr(kernels, "FUSED_LAYERS", True)
    with torch.no_grad():
        model.lm_head.weight.mul_(2.0)  # the head repacks in its own forward first: the steps run
    model.forward(tokens[:1], model.new_cache(1, 32))
    assert calls == []
    model.forward(tokens[:1], model.new_cache(1, 32))  # repacked: the one call again
    assert calls == [1]


def test_a_token_outside_the_vocabulary_raises_and_leaves_the_cache():
    model = _model()
    cache = model.new_cache(1, 32)
    with pytest.raises(IndexError):
        model.forward(torch.tensor([[3, 96]]), cache)
    assert cache.lengths == [0]


def test_prepared_arguments_follow_the_cache_the_tables_and_the_weights(monkeypatch):
    """The one call's prepared arguments (``kernels.PassArgs``) are rebuilt whenever what they were built
    from changes: another cache, rotary tables grown past their rows, an embedding or final norm replaced,
    a head weight edited in place. Every pass still gives the steps' bits."""
    model = _model()
    calls = []
    real = kernels.model_pass
    monkeypatch.setattr(kernels, "model_pass", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    tokens = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(5))

    def check(cache, reference, part, **kwargs):
        fast = model.forward(tokens[:, part], cache, **kwargs)
        slow = _steps(model, tokens[:, part], reference, **kwargs)
        assert torch.equal(fast, slow)
        for each in (cache, reference):
            each.commit(0, part.stop - part.start)

    first, first_ref = model.new_cache(1, 200), model.new_cache(1, 200)
    second, second_ref = model.new_cache(1, 200), model.new_cache(1, 200)
    check(first, first_ref, slice(0, 5))
    check(second, second_ref, slice(0, 7))  # another cache: its own KV pointers
    check(first, first_ref, slice(5, 6))
    assert calls[1] is not calls[0] and calls[2] is not calls[1]
    model._tables = None  # tables rebuilt (as when a sequence outgrows them): new pointers
    check(first, first_ref, slice(6, 8))
    assert calls[-1] is not calls[-2]
    with torch.no_grad():
        model.model.embed_tokens.weight = torch.nn.Parameter(model.model.embed_tokens.weight * 0.5,
                                                             requires_grad=False)
    check(first, first_ref, slice(8, 9))
    assert calls[-1] is not calls[-2]
    with torch.no_grad():
        model.model.norm.weight.mul_(1.5)  # edited in place: read live, nothing to rebuild
    check(first, first_ref, slice(9, 10))
    check(first, first_ref, slice(10, 11))  # the same kind of pass, nothing changed: the same arguments
    assert calls[-1] is calls[-2]
    assert len(calls) == 7
    # A batch engine's per-round views of one cache (new objects, the same storage) share the arguments.
    batch, batch_ref = model.new_cache(3, 200), model.new_cache(1, 200)
    for part in (slice(0, 4), slice(4, 5), slice(5, 6)):
        view = batch.prefix_view(1)
        check(view, batch_ref, part)
        batch.sync_prefix(view)
    assert calls[-1] is calls[-2] is calls[-3] and calls[-3] is not calls[-4]
