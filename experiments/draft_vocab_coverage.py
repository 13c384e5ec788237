"""Share of the embedded target's greedy tokens whose ids lie below N (the draft vocabulary limit),
on the packaged held-out prompts (8 per workload, last 400 prompt tokens, 64 greedy tokens).

    OMP_NUM_THREADS=1 python experiments/draft_vocab_coverage.py
"""
import json
import torch
torch.set_num_threads(1)
from verispec.config import SamplingParams, SpecConfig, StopRules
from verispec.demo import PROMPTS_FILE
from verispec.loading import build_engine, load_pair

pair = load_pair("tiny")
engine = build_engine(pair, SpecConfig(method="none"))
tokens = []
for items in json.loads(PROMPTS_FILE.read_text()).values():
    for text in items:
        prompt = pair.tokenizer.encode(text, add_special_tokens=False)[-400:]
        tokens += engine.generate(prompt, SamplingParams(temperature=0), SpecConfig(method="none"),
                                  StopRules(max_tokens=64, ignore_eos=True)).tokens
ids = torch.tensor(tokens)
for limit in (1024, 2048, 3072, 4096):
    print(f"ids < {limit}: {(ids < limit).float().mean().item():.3f} of {len(tokens)} tokens "
          f"(vocabulary {pair.target.config.vocab_size})")
