"""What the pass-size A/B scripts share (isa_ab.py, amx_blocks_ab.py): their options, a cache holding a
prefilled context, and target passes timed in interleaved order. Imported by those scripts, which run
from this folder (``python experiments/isa_ab.py``), so it is on their import path."""

import argparse
import statistics
import time
from typing import Callable, Hashable

import torch


def parse_args(doc: str) -> argparse.Namespace:
    """--target, --positions (comma-separated pass sizes), --context, --repeats."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--positions", default="1,2,4,5,8,16")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=21)
    args = parser.parse_args()
    args.positions = [int(p) for p in args.positions.split(",")]
    return args


def prefilled(model, prompt: torch.Tensor, positions: list[int]):
    """A cache of ``model`` holding ``prompt`` (1, C) committed, with room for the largest pass after it."""
    context = prompt.shape[1]
    cache = model.new_cache(1, context + max(positions) + 1)
    model.forward(prompt, cache)
    cache.commit(0, context)
    return cache


def interleaved(units: list[Hashable], run: Callable[[Hashable], object], repeats: int):
    """Median ms of ``run(unit)`` per unit over ``repeats`` rounds, each round every unit once in an order
    rotated by one unit per round (a first round warms up and is not counted), and each unit's last
    result."""
    times: dict = {unit: [] for unit in units}
    results = {}
    for index in range(repeats + 1):
        shift = index % len(units)
        for unit in units[shift:] + units[:shift]:
            began = time.perf_counter()
            results[unit] = run(unit)
            if index:
                times[unit].append(1e3 * (time.perf_counter() - began))
    return {unit: statistics.median(values) for unit, values in times.items()}, results
