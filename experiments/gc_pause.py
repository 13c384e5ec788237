"""What a full garbage collection costs in a process that has loaded what `verispec serve` loads (the
server's modules and the embedded pair), before and after ``gc.freeze()`` (what the server now does
once it has started: ``verispec.loading.freeze_long_lived_objects``).

    OMP_NUM_THREADS=1 python experiments/gc_pause.py
"""
import gc, time
from verispec.server import app  # noqa: F401  (the server's imports: FastAPI, pydantic, ...)
from verispec.loading import freeze_long_lived_objects, load_pair

pair = load_pair("tiny")
print(f"objects tracked by the collector: {len(gc.get_objects()):,}")
for label in ("before freeze", "after freeze"):
    times = []
    for _ in range(5):
        began = time.perf_counter()
        gc.collect()
        times.append(1000 * (time.perf_counter() - began))
    print(f"full collection {label}: median {sorted(times)[2]:.1f} ms")
    if label == "before freeze":
        freeze_long_lived_objects()
