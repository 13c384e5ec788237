"""Throughput of `verispec serve` in one process against `verispec serve --ray` with replicas, closed loop.

    OMP_NUM_THREADS=1 python experiments/ray_replicas.py                      # the tiny pair, concurrency 16
    OMP_NUM_THREADS=1 python experiments/ray_replicas.py --serve-args "--target smollm2 --adaptive"

Each setup is started fresh (`verispec serve ...` as a subprocess), warmed up with one pass over the
prompts, then ``--rounds`` timed rounds each send every prompt once from ``--concurrency`` client threads
(non-streamed greedy completions of ``--max-tokens`` tokens, ``ignore_eos``). A round's throughput is its
output tokens over its wall time; the median round is reported per setup, with the ratio to the first
setup. The greedy texts of every setup are compared with the first setup's: they must be identical.
Setups (``--setups``): ``one:T`` is one process with T torch threads; ``ray:N`` is N Ray Serve replicas
with the default threads (cores // N); ``ray:N:T`` sets T threads per replica. The load generator runs on
the same machine, so it takes CPU from the servers as well.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from verispec.bench.serving import launched_server

PROMPTS = Path(__file__).resolve().parent.parent / "verispec" / "data" / "heldout_prompts.json"


def serve_args_for(setup: str, serve_args: list[str]) -> list[str]:
    kind, *numbers = setup.split(":")
    if kind == "one" and len(numbers) == 1:
        return [*serve_args, "--threads", numbers[0]]
    if kind == "ray" and len(numbers) in (1, 2):
        threads = ["--threads", numbers[1]] if len(numbers) == 2 else []
        return [*serve_args, "--ray", "--ray-address", "local", "--replicas", numbers[0], *threads]
    raise SystemExit(f"ray_replicas.py: error: a setup is one:T, ray:N or ray:N:T, got {setup!r}")


def post(url: str, body: dict) -> tuple[dict, str]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read()), response.headers.get("X-Verispec-Replica", "")


def run_setup(setup: str, args, prompts: list[str]) -> dict:
    with launched_server(serve_args_for(setup, shlex.split(args.serve_args)), ready_timeout_s=300,
                         env={"OMP_NUM_THREADS": "1"}) as url:

        def one(prompt: str):
            reply, replica = post(f"{url}/v1/completions", {"prompt": prompt, "max_tokens": args.max_tokens,
                                                            "temperature": 0, "ignore_eos": True})
            return reply["choices"][0]["text"], reply["usage"]["completion_tokens"], replica

        rates, replicas, texts = [], set(), {}
        with ThreadPoolExecutor(args.concurrency) as pool:
            for prompt, (text, _, _) in zip(prompts, pool.map(one, prompts)):  # warm-up
                texts[prompt] = text
            for _ in range(args.rounds):
                began = time.perf_counter()
                results = list(pool.map(one, prompts))
                rates.append(sum(tokens for _, tokens, _ in results) / (time.perf_counter() - began))
                replicas.update(replica.split(" host=")[0] for _, _, replica in results if replica)
        return {"setup": setup, "tok_s": statistics.median(rates), "rounds": rates, "replicas": len(replicas),
                "texts": texts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setups", default="one:1,one:2,ray:1,ray:2",
                        help="comma-separated one:T / ray:N / ray:N:T (default one:1,one:2,ray:1,ray:2)")
    parser.add_argument("--serve-args", default="--target tiny --method none --max-batch 16",
                        help="options for every `verispec serve` (default: the tiny pair, plain decoding)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=48, help="prompts per round (held-out, cycled)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    pool = [p for workload in json.loads(PROMPTS.read_text()).values() for p in workload]
    prompts = [f"{pool[i % len(pool)]}" + " " * (i // len(pool)) for i in range(args.prompts)]  # distinct
    results = [run_setup(setup, args, prompts) for setup in args.setups.split(",")]
    first = results[0]
    print(f"{len(prompts)} prompts x {args.max_tokens} tokens per round, concurrency {args.concurrency}, "
          f"{args.rounds} timed rounds; serve {args.serve_args}")
    for result in results:
        same = result["texts"] == first["texts"]
        rounds = ", ".join(f"{rate:.0f}" for rate in result["rounds"])
        print(f"{result['setup']:>8}: {result['tok_s']:7.1f} tok/s (rounds {rounds}), {result['tok_s'] / first['tok_s']:.2f}x "
              f"{first['setup']}, replicas seen {result['replicas'] or '-'}, greedy texts identical: {same}")


if __name__ == "__main__":
    main()
