"""SmolLM2-135M-Instruct on this CPU: verispec (plain, chain with the shipped draft, chain with the shipped
EAGLE head, alone and behind a context lookup) against transformers
(``generate()`` plain and with ``assistant_model=`` the same draft) and llama.cpp (``llama-cpp-python``
on the very same GGUF file, plain and with its prompt-lookup drafting), one process, one run.

    python experiments/smollm2_peers.py --threads 1 --out docs/results/smollm2-peers-t1.json
    python experiments/smollm2_peers.py --threads 2 --skip transformers
    python experiments/smollm2_peers.py --gguf runs/smollm2-q4_k_m.gguf --skip transformers

``--gguf PATH`` runs another GGUF file of SmolLM2 (say llama.cpp's Q4_K_M of it) instead of the shipped one:
verispec plain decoding only (the shipped drafts belong to the shipped file), llama.cpp on the same file.

Greedy, held-out code and chat prompts (verispec/data/smollm2_heldout_prompts.json), ``--tokens`` new
tokens at most (every system stops at EOS). Per system: tokens/s = generated tokens / wall time over all
prompts, median over ``--repeats`` (each repeat runs every prompt once, systems interleaved per repeat so
drifting machine load hits all alike). llama.cpp is a benchmark dependency only
(``pip install llama-cpp-python==0.3.36`` builds it from source, ~10 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from verispec import kernels
from verispec.config import SamplingParams, SpecConfig, StopRules
from verispec.demo import demo_prompts
from verispec.loading import build_engine, eos_ids, load_pair, resolve_draft_vocab, smollm2_path


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def verispec_systems(pair, tokens: int, plain_only: bool = False):
    specs = {"verispec plain": SpecConfig(method="none")}
    if not plain_only:
        vocab = resolve_draft_vocab(pair, "auto")
        specs |= {
                  "verispec chain g4": SpecConfig(method="chain", gamma=4, draft_vocab=vocab),
                  "verispec eagle g2": SpecConfig(method="chain", gamma=2, drafter="eagle"),
                  "verispec eagle+lookup3 g2": SpecConfig(method="chain", gamma=2, drafter="eagle", lookup=3)}
    stop = StopRules(max_tokens=tokens, eos_ids=tuple(eos_ids(pair.tokenizer, pair.target)))
    systems = {}
    for name, spec in specs.items():
        engine = build_engine(pair, spec)

        def run(ids, engine=engine, spec=spec):
            return engine.generate(ids, SamplingParams(temperature=0), spec, stop).tokens
        systems[name] = run
    return systems


def transformers_systems(pair, tokens: int):
    from transformers import AutoModelForCausalLM

    from verispec.train.gguf_draft import export_hf_draft

    path = smollm2_path()
    target = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    folder = Path(tempfile.mkdtemp(prefix="smollm2-draft-hf-"))
    draft = AutoModelForCausalLM.from_pretrained(str(export_hf_draft(pair.draft, pair.tokenizer, folder)),
                                                 dtype=torch.float32).eval()
    eos = list(eos_ids(pair.tokenizer, pair.target))

    def make(assistant):
        def run(ids):
            with torch.no_grad():
                out = target.generate(torch.tensor([ids]), max_new_tokens=tokens, do_sample=False, eos_token_id=eos,
                                      pad_token_id=eos[0], assistant_model=assistant)
            return out[0, len(ids):].tolist()
        return run
    return {"transformers plain": make(None), "transformers assisted": make(draft)}


def llama_cpp_systems(threads: int, tokens: int, path: str):
    try:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError as err:
        print(f"llama.cpp skipped: {err} (pip install llama-cpp-python==0.3.36)", file=sys.stderr)
        return {}
    models = {"llama.cpp plain": Llama(model_path=path, n_threads=threads, n_ctx=2048, verbose=False),
              "llama.cpp prompt lookup": Llama(model_path=path, n_threads=threads, n_ctx=2048, verbose=False,
                                               draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10))}
    systems = {}
    for name, model in models.items():
        def run(ids, model=model):
            model.reset()
            out = []
            for token in model.generate(ids, temp=0.0, top_k=1, reset=True):
                if model.token_eos() == token or token in (0, 2) or len(out) >= tokens:
                    break
                out.append(token)
            return out
        systems[name] = run
    return systems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=2, help="prompts per workload (code, chat)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip", action="append", default=[], choices=["transformers", "llama.cpp"])
    parser.add_argument("--out", default=None, help="write the JSON record here")
    parser.add_argument("--gguf", default=None, help="another GGUF file of SmolLM2 (plain decoding only)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = args.gguf or str(smollm2_path())
    pair = load_pair(path, need_draft=False) if args.gguf else load_pair("smollm2", need_eagle=True)
    prompts = demo_prompts(args.prompts, "smollm2")
    jobs = [(w, pair.tokenizer.encode(p, add_special_tokens=False)) for w in ("code", "chat") for p in prompts[w]]
    systems = verispec_systems(pair, args.tokens, plain_only=bool(args.gguf))
    if "transformers" not in args.skip and not args.gguf:
        systems.update(transformers_systems(pair, args.tokens))
    if "llama.cpp" not in args.skip:
        systems.update(llama_cpp_systems(args.threads, args.tokens, path))
    for run in systems.values():  # warm-up: one-off allocations out of the timings
        run(jobs[0][1][:16])
    timings = {name: {w: [] for w in ("code", "chat")} for name in systems}
    outputs = {name: {} for name in systems}
    for repeat in range(args.repeats):
        for name, run in systems.items():
            for index, (workload, ids) in enumerate(jobs):
                start = time.perf_counter()
                out = run(ids)
                timings[name][workload].append((len(out), time.perf_counter() - start, repeat))
                outputs[name][index] = out
        print(f"repeat {repeat + 1}/{args.repeats} done", file=sys.stderr)
    reference = outputs["verispec plain"]
    rows = {}
    for name in systems:
        row = {}
        for workload in ("code", "chat"):
            per_repeat = []
            for repeat in range(args.repeats):
                done = [(n, s) for n, s, r in timings[name][workload] if r == repeat]
                per_repeat.append(sum(n for n, _ in done) / sum(s for _, s in done))
            row[workload] = {"tokens_per_s": statistics.median(per_repeat), "repeats": per_repeat}
        row["same_tokens_as_verispec_plain"] = sum(outputs[name][i] == reference[i] for i in reference) / len(reference)
        rows[name] = row
    base = rows["verispec plain"]
    for name, row in rows.items():
        for workload in ("code", "chat"):
            row[workload]["x_verispec_plain"] = row[workload]["tokens_per_s"] / base[workload]["tokens_per_s"]
    record = {"cpu": cpu_name(), "file": Path(path).name, "kernels": kernels.status(pair.target),
              "threads": args.threads,
              "tokens": args.tokens, "prompts_per_workload": args.prompts, "repeats": args.repeats,
              "command": "python experiments/smollm2_peers.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "systems": rows}
    print(json.dumps(record, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
