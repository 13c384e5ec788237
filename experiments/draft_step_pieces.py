"""Where one decoding step of the embedded pair goes, in a tight loop (context 200, one token; medians of
7 timings of 200 calls, microseconds):

1. the draft (int8 weights, 2048-id head) and the target: a whole step (``forward``, one native call
   since ``kernels.model_pass``), the same step taken piece by piece (embedding, ``run_layers``, final
   norm and LM head: the path before that change), ``run_layers`` alone, and the bare native call
   (``model_pass``'s C function called with its arguments built beforehand: the floor for any Python
   around it; since ``kernels.PassArgs`` a step prepares them once, so ``forward`` nears it);
2. the AVX2 loop's int8 rows against its bf16 weights for the draft's nine linear layers in sequence at
   one row (what ``kernels.INT8_ROWS`` rests on), with AMX switched off for the packing.

    OMP_NUM_THREADS=1 python experiments/draft_step_pieces.py
"""
import ctypes
import statistics
import time

import torch

from verispec import kernels
from verispec.loading import EMBEDDED_DRAFT_VOCAB, load_pair

torch.set_num_threads(1)


def timed(call, n=200):
    for _ in range(50):
        call()
    runs = []
    for _ in range(7):
        began = time.perf_counter()
        for _ in range(n):
            call()
        runs.append((time.perf_counter() - began) / n * 1e6)
    return statistics.median(runs)


pair = load_pair("tiny")
for name, model, limit in (("draft", pair.draft, EMBEDDED_DRAFT_VOCAB), ("target", pair.target, None)):
    cache = model.new_cache(1, 400)
    with torch.inference_mode():
        model.forward(torch.tensor([list(range(5, 205))]), cache, last_only=True)
        cache.commit(0, 200)
        token = torch.tensor([[7]])
        layers = model.config.num_hidden_layers

        def pieces():
            hidden = model.run_layers(model.embed(token), cache, 0, layers)
            return model.logits(hidden[:, -1:], limit)

        step = timed(lambda: model.forward(token, cache, last_only=True, vocab_limit=limit))
        stepwise = timed(pieces)
        alone = timed(lambda: model.run_layers(model.embed(token), cache, 0, layers))
    args = model._pass_args[(True, limit)]  # what the steps above prepared
    logits, offset = torch.empty(1, 1, args.vocab), 200 * args.row_bytes
    args.lengths[0] = 200
    arguments = (token.data_ptr(), 1, *args.layers, ctypes.addressof(args.plan.array_for(1)), len(args.plan.weights),
                 args.cos + offset, args.sin + offset, *args.kv, args.lengths_ptr, 201, *args.norm,
                 *args.head_for(1), args.vocab, 1, logits.data_ptr(), 1)
    native = kernels.library().model_pass
    bare = timed(lambda: native(*arguments))
    print(f"{name:6s}: one call {step:6.1f} us, piece by piece {stepwise:6.1f} us, run_layers alone {alone:6.1f} us, "
          f"bare native call {bare:6.1f} us")

shapes = [(384, 256), (256, 256), (1536, 256), (256, 768)] * 2 + [(2048, 256)]  # the draft's linears + head
generator = torch.Generator().manual_seed(0)
weights = [(torch.randn(n, k, generator=generator) * 0.02).to(torch.bfloat16).float() for n, k in shapes]
kernels.library()
saved, kernels._amx_reason = kernels._amx_reason, "switched off for this comparison"
try:
    variants = {"bf16": [w.to(torch.bfloat16) for w in weights], "int8 rows": [kernels.quantize_int8(w) for w in weights]}
finally:
    kernels._amx_reason = saved
inputs = {k: torch.randn(1, k) for _, k in shapes}
for name, packed in variants.items():
    print(f"AVX2 loop, the draft's linears at one row, {name:9s}: "
          f"{timed(lambda: [kernels.linear(inputs[k], p) for (_, k), p in zip(shapes, packed)]):6.1f} us")
