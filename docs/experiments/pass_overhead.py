"""How much of a one-row pass is Python: ``model.forward`` for a draft step (last position, the draft's
limited vocabulary) and a target decode step, against the bare native call (``kernels.model_pass``'s C
function called with the same arguments prepared beforehand, the floor any Python around it can reach).
Microseconds, medians of 7 timings of 300 passes, interleaved twice.

    OMP_NUM_THREADS=1 python docs/experiments/pass_overhead.py
"""
import ctypes, statistics, time
import torch
torch.set_num_threads(1)
from verispec import kernels
from verispec.drafters.base import head_args
from verispec.loading import load_pair, resolve_draft_vocab


def timed(call, n=300):
    for _ in range(200):
        call()
    runs = []
    for _ in range(7):
        began = time.perf_counter()
        for _ in range(n):
            call()
        runs.append((time.perf_counter() - began) / n * 1e6)
    return statistics.median(runs)


pair = load_pair()
vocab = resolve_draft_vocab(pair, "auto")
for name, model, limit in (("draft", pair.draft, vocab), ("target", pair.target, None)):
    cache = model.new_cache(1, 512)
    model.forward(torch.tensor([list(range(1, 100))]), cache, last_only=True)
    cache.commit(0, 99)
    token = torch.tensor([[5]])

    def step():
        model.forward(token, cache, last_only=True, **head_args(limit))
        cache.set_length(0, 99)

    head = model._limited_head(limit) if limit is not None and limit < model.config.vocab_size else model.lm_head
    weight = kernels.head_weight(head, 1)
    plan = kernels.LayerPlan.for_layers(model.model.layers, 0, len(model.model.layers))
    cos, sin = (t.contiguous() for t in model._rotary_rows(99, 1))
    embedding, norm, size = model.model.embed_tokens.weight, model.model.norm, model.config.vocab_size
    heads, kv_heads, head_dim, intermediate = plan.shape
    lengths, logits = torch.tensor([99]), torch.empty(1, 1, size)
    arguments = (token.data_ptr(), 1, embedding.data_ptr(), embedding.shape[0], embedding.shape[1], heads, kv_heads,
                 head_dim, intermediate, plan.eps, ctypes.addressof(plan.array_for(1)), len(plan.weights),
                 cos.data_ptr(), sin.data_ptr(), cache.keys.data_ptr(), cache.values.data_ptr(), cache.keys.stride(0),
                 cache.max_len, lengths.data_ptr(), 100, norm.weight.data_ptr(), norm.eps, weight.data_ptr(),
                 kernels.WEIGHT_TYPES[weight.dtype], weight.shape[0], size, 1, logits.data_ptr(), 1)
    native = kernels.library().model_pass

    def bare():
        native(*arguments)

    figures = [(timed(step), timed(bare)) for _ in range(2)]
    print(f"{name}: forward " + " / ".join(f"{f:.1f}" for f, _ in figures) + " us, bare native call "
          + " / ".join(f"{b:.1f}" for _, b in figures) + " us")
