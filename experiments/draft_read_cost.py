"""What the embedded draft pays to read a backlog (a prompt, or tokens committed at gamma 0) before it
can draft: one prefill pass of L tokens on one row, median of 15, in ms and ms per token
(verispec/adaptive.py prices switches from gamma 0 with this, measured online).

    OMP_NUM_THREADS=1 python experiments/draft_read_cost.py
"""
import statistics, time, torch
torch.set_num_threads(1)
from verispec.loading import load_pair

draft = load_pair("tiny").draft

def median_ms(fn, n=15):
    times = []
    for _ in range(n):
        began = time.perf_counter(); fn(); times.append(time.perf_counter() - began)
    return 1e3 * statistics.median(times)

with torch.inference_mode():
    for length in (16, 64, 256):
        cache = draft.new_cache(1, 1024)
        tokens = torch.randint(0, draft.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
        def read():
            cache.set_length(0, 0)
            draft.forward(tokens, cache.row_view(0), last_only=True)
        ms = median_ms(read)
        print(f"{length:4d} tokens: {ms:6.2f} ms  {ms / length:.3f} ms/token")
