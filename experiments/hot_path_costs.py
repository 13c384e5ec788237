"""Per-round costs outside the model: the greedy argmax (torch's against numpy's, as
``sampling.greedy_ids`` takes it) and the adaptive policy's choose + observe at batch 1 (a request's own
acceptance blended in) and batch 16, microseconds, medians of 5 timings of 2,000 calls.

    OMP_NUM_THREADS=1 python experiments/hot_path_costs.py
"""
import random, statistics, time
import torch
torch.set_num_threads(1)
from verispec.adaptive import AcceptanceCounts, AdaptiveGamma


def timed(call, n=2000):
    for _ in range(50):
        call()
    runs = []
    for _ in range(5):
        began = time.perf_counter()
        for _ in range(n):
            call()
        runs.append((time.perf_counter() - began) / n * 1e6)
    return statistics.median(runs)


logits = torch.randn(16, 8192)
print(f"argmax of 16 x 8192: torch {timed(lambda: logits.argmax(-1).tolist()):.1f} us, "
      f"numpy {timed(lambda: logits.numpy().argmax(-1).tolist()):.1f} us")

rng = random.Random(0)
for batch in (1, 16):
    policy, request = AdaptiveGamma(max_gamma=8), AcceptanceCounts()

    def round_():
        gamma = policy.choose(batch, request if batch == 1 else None)
        accepted = [rng.randint(0, gamma) for _ in range(batch)]
        policy.observe(batch, gamma, 0.002 * (1 + 0.1 * gamma) * (1 + batch / 8), accepted, [gamma] * batch)
        request.add(accepted[0], gamma)
    for _ in range(300):  # past the climb, into steady choices
        round_()
    print(f"adaptive choose + observe at batch {batch}: {timed(round_):.1f} us per round")
