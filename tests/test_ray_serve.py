"""``verispec serve --ray``: the OpenAI app on Ray Serve, end to end.

One ``verispec serve --ray --ray-address local --replicas 2 --target tiny`` process (a fresh local Ray
instance of its own) serves the whole module; the tests talk to it with the official openai client and
read the ``X-Verispec-Replica`` header. They run in file order: spread and exact greedy output, a replica
killed mid-run, then SIGTERM, which must stop every Ray process that command started. The command-line
checks at the top need no Ray.
"""

from __future__ import annotations

import collections
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest

from verispec.server import ray_serve

MODEL = "verispec-default"  # the embedded pair's served name
PROMPTS = ["Hello", "The cat sat on", "def add(a, b):", "Once upon a time", "1, 2, 3,", "Name three primes."]
TOKENS = 16
STREAMS = 12  # at most, started one by one
LONG = 900  # tokens of the streams a replica is killed under: still running when it dies (context 1024)


# ---- the command line, without Ray --------------------------------------------------------------------------


def _error(capsys, argv: list[str]) -> str:
    from verispec.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line, no traceback
    return err


def test_missing_ray_is_a_one_line_error(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    err = _error(capsys, ["serve", "--ray", "--replicas", "2", "--target", "tiny"])
    assert "pip install 'verispec[ray]'" in err


@pytest.mark.parametrize("argv, message", [
    (["--replicas", "2"], "--replicas needs --ray"),
    (["--autoscale", "1:2"], "--autoscale needs --ray"),
    (["--ray-address", "auto"], "--ray-address needs --ray"),
    (["--ray", "--replicas", "0"], "--replicas must be >= 1"),
    (["--ray", "--replicas", "2", "--autoscale", "1:2"], "not both"),
    (["--ray", "--autoscale", "3:2"], "MIN:MAX"),
    (["--ray", "--autoscale", "1:x"], "MIN:MAX"),
    (["--ray", "--autoscale", "1:2:0"], "MIN:MAX"),
    (["--ray", "--trace-rounds", "t.jsonl"], "--trace-rounds"),
], ids=lambda value: value if isinstance(value, str) else " ".join(value))
def test_bad_ray_options_are_one_line_errors(capsys, argv, message):
    assert message in _error(capsys, ["serve", "--target", "tiny", *argv])


def test_scaling_and_threads():
    fixed, auto = ray_serve.parse_scaling(3, None), ray_serve.parse_scaling(None, "0:4:2")
    assert fixed.options() == {"num_replicas": 3} and ray_serve.parse_scaling(None, None).options() == {"num_replicas": 1}
    assert auto.options()["autoscaling_config"] == {"min_replicas": 0, "max_replicas": 4, "initial_replicas": 0,
                                                    "target_ongoing_requests": 2}
    assert ray_serve.replica_threads(0, fixed, cores=2) == 1  # never 0 threads, even with more replicas than cores
    assert ray_serve.replica_threads(0, ray_serve.parse_scaling(2, None), cores=16) == 8
    assert ray_serve.replica_threads(0, auto, cores=16) == 4  # divided among the most replicas there can be
    assert ray_serve.replica_threads(3, auto, cores=16) == 3  # --threads wins


# ---- a live deployment ----------------------------------------------------------------------------------------


@dataclass
class Served:
    proc: subprocess.Popen
    url: str
    stderr: list[str] = field(default_factory=list)
    ray_processes: dict[int, str] = field(default_factory=dict)  # pid -> command line, Ray's processes under proc

    def client(self):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=60)

    def log(self) -> str:
        return "".join(self.stderr[-30:])


def _descendants(root: int) -> dict[int, str]:
    """pid -> command line of every process under ``root`` (Linux /proc)."""
    children = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    children[int(stat.read().rsplit(")", 1)[1].split()[1])].append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    found, todo = {}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            command = _command(child)
            if command is not None:
                found[child] = command
                todo.append(child)
    return found


def _command(pid: int) -> str | None:
    """The process's command line, or None when it is gone (or a zombie, which has none)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return cmdline.read().replace(b"\0", b" ").decode(errors="replace").strip() or None
    except OSError:
        return None


@pytest.fixture(scope="module")
def served():
    pytest.importorskip("ray.serve", reason="needs Ray Serve: pip install 'verispec[ray]'")
    pytest.importorskip("openai")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    proc = subprocess.Popen([sys.executable, "-m", "verispec.cli", "serve", "--ray", "--ray-address", "local",
                             "--replicas", "2", "--target", "tiny", "--max-batch", "8", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**env, "OMP_NUM_THREADS": "1"})
    live = Served(proc, f"http://127.0.0.1:{port}")
    ready = threading.Event()

    def read():
        for line in proc.stderr:
            live.stderr.append(line)
            if line.startswith("verispec: serving on"):
                ready.set()
        ready.set()  # the process ended

    threading.Thread(target=read, daemon=True).start()
    try:
        assert ready.wait(180) and proc.poll() is None, f"verispec serve --ray did not start:\n{live.log()}"
        live.ray_processes = _descendants(proc.pid)
        yield live
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


def _replica(headers) -> tuple[str, int]:
    """(replica id, pid) from the X-Verispec-Replica header."""
    match = re.fullmatch(r"(\S+) pid=(\d+) host=\S+", headers.get("x-verispec-replica", ""))
    assert match, dict(headers)
    return match.group(1), int(match.group(2))


@pytest.fixture(scope="module")
def reference():
    """prompt -> the tiny target's own greedy text of TOKENS tokens, plain decoding in this process."""
    from verispec.config import SamplingParams, SpecConfig, StopRules
    from verispec.engine import SpecEngine
    from verispec.loading import load_pair

    pair = load_pair("tiny", need_draft=False)
    engine = SpecEngine(pair.target)
    texts = {}
    for prompt in PROMPTS:
        ids = list(pair.tokenizer.encode(prompt, add_special_tokens=False))
        result = engine.generate(ids, SamplingParams(temperature=0), SpecConfig(method="none"),
                                 StopRules(max_tokens=TOKENS, ignore_eos=True))
        texts[prompt] = pair.tokenizer.decode(result.tokens, skip_special_tokens=True)
    return texts


def _greedy(client, prompt: str, max_tokens: int = TOKENS, **extra):
    return client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                                        temperature=0, extra_body={"ignore_eos": True}, **extra)


def test_concurrent_requests_spread_over_both_replicas_with_one_process_outputs(served, reference):
    client = served.client()
    assert [model.id for model in client.models.list().data] == [MODEL]
    seen: collections.Counter = collections.Counter()
    with ThreadPoolExecutor(12) as pool:
        for _ in range(3):  # both replicas serve 12 concurrent requests; a few rounds allow for Serve's routing
            raws = list(pool.map(lambda prompt: _greedy(client, prompt), PROMPTS * 2))
            for prompt, raw in zip(PROMPTS * 2, raws):
                reply = raw.parse()
                assert reply.choices[0].text == reference[prompt], (prompt, _replica(raw.headers))
                assert reply.usage.completion_tokens == TOKENS
                seen[_replica(raw.headers)] += 1
            if len(seen) == 2:
                break
    assert len(seen) == 2, f"every request went to one replica: {seen}"
    assert len({pid for _, pid in seen}) == 2
    # a stream passes through the proxy chunk by chunk, with the header, and ends as the one-process server's
    raw = _greedy(client, PROMPTS[0], stream=True)
    assert _replica(raw.headers)[1] in {pid for _, pid in seen}
    assert "".join(chunk.choices[0].text for chunk in raw.parse()) == reference[PROMPTS[0]]


def test_a_killed_replica_fails_its_requests_and_the_other_serves_on(served, reference):
    import httpx
    import openai

    client = served.client()
    streams: dict[int, tuple[str, int]] = {}  # request -> the replica serving it
    outcomes: dict[int, object] = {}  # request -> finish reason and token count, or the exception

    def stream(index: int):
        try:
            raw = _greedy(client, PROMPTS[index % len(PROMPTS)], LONG, stream=True,
                          stream_options={"include_usage": True})
            streams[index] = _replica(raw.headers)
            finish, tokens = None, None
            for chunk in raw.parse():
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
                if chunk.usage:
                    tokens = chunk.usage.completion_tokens
            outcomes[index] = (finish, tokens)
        except (openai.APIError, httpx.HTTPError) as err:
            outcomes[index] = err

    threads = []
    for index in range(STREAMS):  # until both replicas hold some (Serve's router may put several on one)
        threads.append(threading.Thread(target=stream, args=(index,)))
        threads[-1].start()
        deadline = time.monotonic() + 30
        while index not in streams and index not in outcomes and time.monotonic() < deadline:
            time.sleep(0.02)
        assert index in streams, f"stream {index} did not start: {outcomes.get(index)}"
        if index >= 3 and len(set(streams.values())) == 2:
            break
    by_replica = collections.Counter(streams.values())
    assert len(by_replica) == 2, f"{len(streams)} streams all went to one replica"
    running = collections.Counter(r for i, r in streams.items() if i not in outcomes)  # not finished yet
    victim = max(by_replica, key=lambda r: (running.get(r, 0), by_replica[r]))
    cut = {i for i, r in streams.items() if r == victim and i not in outcomes}  # a loaded machine may finish some
    assert cut, "every stream on the chosen replica finished before the kill"
    os.kill(victim[1], signal.SIGKILL)
    for thread in threads:
        thread.join(60)
    assert len(outcomes) == len(threads)
    for index, replica in streams.items():
        if index in cut:  # cut mid-stream: the client gets an error, never a short answer taken as whole
            assert isinstance(outcomes[index], (openai.APIError, httpx.HTTPError)), outcomes[index]
        else:
            assert outcomes[index] == ("length", LONG), outcomes[index]
    # new requests: after at most a few seconds while Serve drops the dead replica, every one succeeds
    failures, deadline = 0, time.monotonic() + 30
    while True:
        try:
            raw = _greedy(client, PROMPTS[1])
            break
        except openai.APIError:
            failures += 1
            assert time.monotonic() < deadline, f"no request succeeded after the kill ({failures} failed)"
            time.sleep(0.5)
    for prompt in PROMPTS:
        raw = _greedy(client, prompt)
        assert raw.parse().choices[0].text == reference[prompt]
        assert _replica(raw.headers) != victim


def test_sigterm_shuts_down_serve_and_the_ray_processes_it_started(served):
    started = {**served.ray_processes, **_descendants(served.proc.pid)}
    kinds = " ".join(started.values())
    assert "gcs_server" in kinds and "raylet" in kinds and "ServeReplica" in kinds, kinds
    served.proc.send_signal(signal.SIGTERM)
    assert served.proc.wait(60) == 0, served.log()
    deadline = time.monotonic() + 15
    alive = started
    while alive and time.monotonic() < deadline:
        alive = {pid: command for pid, command in started.items() if _command(pid) == command}
        time.sleep(0.2)
    assert not alive, f"left running after SIGTERM: {alive}"
