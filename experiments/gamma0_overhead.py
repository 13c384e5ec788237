"""What a round at gamma 0 costs in each engine: off (no draft), a chain engine pinned to gamma 0, and
the adaptive policy at a batch where it decided plain decoding, 16 rows, step() timed in-process,
interleaved blocks of rounds (the serving trace showed the adaptive server's gamma-0 rounds 14% slower
than off's at the same batch size).

    OMP_NUM_THREADS=1 python experiments/gamma0_overhead.py [--rows 16] [--blocks 12]
"""
import argparse, statistics, time
import torch
from verispec.adaptive import AdaptiveGamma, FixedGamma
from verispec.batch import BatchEngine, BatchRequest
from verispec.config import SamplingParams, SpecConfig, StopRules
from verispec.loading import load_pair, resolve_draft_vocab

parser = argparse.ArgumentParser()
parser.add_argument("--rows", type=int, default=16)
parser.add_argument("--blocks", type=int, default=12)
parser.add_argument("--rounds", type=int, default=20, help="rounds per block")
args = parser.parse_args()
torch.set_num_threads(1)
pair = load_pair("tiny")
vocab = resolve_draft_vocab(pair, "auto")
G = SamplingParams(temperature=0.0)


class AskedButPlain(AdaptiveGamma):
    """The adaptive policy's per-round work as serving does it at a batch where the draft's reads are
    refused: ``choose`` (it wants to climb), then ``afford`` with the round's backlog (refused), and
    the round runs at gamma 0."""

    engine = None

    def choose(self, batch_size=1, request=None):
        gamma = super().choose(batch_size, request)
        if gamma:
            self.afford(batch_size, gamma, self.engine._backlog())
        return 0


def engines():
    off = BatchEngine(pair.target, None, SpecConfig(method="none"), max_batch=64, max_len=1024)
    pinned = BatchEngine(pair.target, pair.draft, SpecConfig(gamma=4, draft_vocab=vocab), max_batch=64,
                         max_len=1024, gamma_policy=FixedGamma(0))
    policy = AskedButPlain(max_gamma=4)
    adaptive = policy.engine = BatchEngine(pair.target, pair.draft, SpecConfig(gamma=4, draft_vocab=vocab), max_batch=64,
                           max_len=1024, gamma_policy=policy)
    return {"off": off, "chain pinned to 0": pinned, "adaptive": adaptive}


def fill(engine, tag):
    for i in range(args.rows):
        prompt = [5 + (i * 7 + j) % 4000 for j in range(60)]
        engine.add(BatchRequest(f"{tag}{i}", prompt, G, StopRules(max_tokens=900, ignore_eos=True)))


def price_reads(policy):
    """Smaller buckets decided (gamma 2 gains 30%) and a read price known, as after a c8 phase."""
    for b in (1, 2, 4, 8):
        for _ in range(5):
            policy.observe(b, 0, 0.002, [0] * b, [0] * b)
            policy.observe(b, 2, 0.003, [2] * b, [2] * b)
        policy.recent_sizes.clear()
        for _ in range(40):
            policy.choose(b)
    policy.recent_sizes.clear()
    policy.reads(1000, 0.025)


all_engines = engines()
for name, engine in all_engines.items():
    fill(engine, name)
price_reads(all_engines["adaptive"].gamma_policy)
times = {name: [] for name in all_engines}
for block in range(args.blocks):
    for name, engine in all_engines.items():
        for _ in range(args.rounds):
            began = time.perf_counter()
            engine.step()
            times[name].append(time.perf_counter() - began)
for name, values in times.items():
    gammas = ""
    print(f"{name:>20}: median step {1e3 * statistics.median(values):.3f} ms over {len(values)} rounds")
policy = all_engines["adaptive"].gamma_policy
print("adaptive rounds observed per gamma at this batch:", {g: policy.samples.get((policy.bucket(args.rows), g)) for g in policy.candidates})
