"""Held-out perplexity of the embedded target and draft on the same windows (the training runs each
report their own evaluation; this puts both models on identical tokens), per workload.

    OMP_NUM_THREADS=1 python docs/experiments/pair_perplexity.py [--windows 96] [--draft DIR] [--target DIR]
"""
import argparse, math
import torch
torch.set_num_threads(1)
from verispec.loading import DEFAULT_DRAFT, DEFAULT_TARGET
from verispec.models.llama import load_checkpoint
from verispec.train import corpus
from verispec.train.evaluate import evaluate_draft, evaluate_layers, heldout_windows
from verispec.train.recipes import EOS_TOKEN_ID
from verispec.train.tokenizer import batch_encoder, load_tokenizer

ap = argparse.ArgumentParser()
ap.add_argument("--windows", type=int, default=96, help="256-token held-out windows per workload")
ap.add_argument("--draft", default=str(DEFAULT_DRAFT))
ap.add_argument("--target", default=str(DEFAULT_TARGET))
args = ap.parse_args()
target = load_checkpoint(args.target, dtype=torch.float32, kernels=False).eval()
draft = load_checkpoint(args.draft, dtype=torch.float32, kernels=False).eval()
encode = batch_encoder(load_tokenizer(args.target))  # the pair shares it
with torch.no_grad():
    for name in corpus.WORKLOADS:
        windows = heldout_windows(encode, name, 256, args.windows, EOS_TOKEN_ID)
        t = evaluate_layers(target, windows, 16, exit_layers=[])["final"]["loss"]
        d = evaluate_draft(draft, target, windows, 16)["loss"]
        print(f"{name}: {windows.numel() - windows.shape[0]} tokens; target loss {t:.4f} (ppl {math.exp(t):.1f}), "
              f"draft loss {d:.4f} (ppl {math.exp(d):.1f}), draft - target {d - t:+.4f} nats/token", flush=True)
