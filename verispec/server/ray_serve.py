"""``verispec serve --ray``: the same OpenAI app, one engine per Ray Serve replica, behind Ray's HTTP proxy.

    verispec serve --ray --replicas 2 --target tiny --port 8000
    verispec serve --ray --autoscale 1:4 --adaptive          # Serve adds replicas as requests queue up

Each replica builds the whole app of ``verispec.server.app.create_app`` (its own model pair, batch engine,
scheduler, metrics) with ``--threads`` torch threads (default: the cores divided among the replicas, at
least 1), reserves as many CPUs from Ray, and stamps every response with the header
``X-Verispec-Replica: <replica id> pid=<pid> host=<hostname>``. Ray's proxy (on ``--host``/``--port``,
one per node) routes each request to a replica with few requests in flight.

Ray: an existing cluster is joined when there is one (``--ray-address``, ``RAY_ADDRESS``, or a local
``ray start``); otherwise a local instance is started. SIGTERM or SIGINT deletes the application; a
local instance started here is then shut down with Serve, a joined cluster is left running (and its
Serve too, unless this application was its last one).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from verispec.config import SpecConfig
from verispec.errors import VerispecError
from verispec.server.scheduler import ServerConfig

APP_NAME = "verispec"
REPLICA_HEADER = "X-Verispec-Replica"
RAY_INSTALL = "pip install 'verispec[ray]'"
AUTOSCALE_TARGET = 8  # requests in flight per replica that autoscaling aims at, unless --autoscale says
LOCAL_OBJECT_STORE_BYTES = 256 << 20  # a local instance's object store: requests and replies only


@dataclass(frozen=True)
class ReplicaOptions:
    """What a replica needs to build its app: the model options of ``verispec serve``, resolved on the
    driver (paths made absolute, the profile read), picklable."""

    target: str | None
    draft: str | None
    device: str
    backend: str
    draft_weights: str
    draft_vocab: str
    eagle: str | None
    spec: SpecConfig
    config: ServerConfig
    adaptive: bool
    model_name: str | None
    profile: dict | None
    threads: int


@dataclass(frozen=True)
class Scaling:
    """A fixed number of replicas (``minimum == maximum``) or Serve's autoscaling between the two."""

    minimum: int
    maximum: int
    target_ongoing: int = AUTOSCALE_TARGET

    @property
    def fixed(self) -> bool:
        return self.minimum == self.maximum

    def options(self) -> dict:
        if self.fixed:
            return {"num_replicas": self.minimum}
        return {"autoscaling_config": {"min_replicas": self.minimum, "max_replicas": self.maximum,
                                       "initial_replicas": self.minimum,
                                       "target_ongoing_requests": self.target_ongoing}}


def add_options(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("Ray Serve (pip install 'verispec[ray]')")
    group.add_argument("--ray", action="store_true",
                       help="serve through Ray Serve: one engine per replica behind Ray's HTTP proxy on --host/"
                            "--port; joins a running Ray cluster (--ray-address, RAY_ADDRESS, or a local 'ray "
                            "start'), else starts a local instance that SIGTERM/SIGINT shuts down again. Every "
                            "response carries the header X-Verispec-Replica: <replica id> pid=<pid> host=<host>")
    group.add_argument("--replicas", type=int, default=None, metavar="N",
                       help="with --ray: N replicas (default 1); each runs --threads torch threads (default "
                            "here: this machine's cores divided among the replicas, at least 1) and reserves "
                            "as many CPUs from Ray")
    group.add_argument("--autoscale", default=None, metavar="MIN:MAX[:TARGET]",
                       help="with --ray, instead of --replicas: Serve's autoscaling between MIN and MAX replicas, "
                            f"aiming at TARGET requests in flight per replica (default {AUTOSCALE_TARGET}); the "
                            "default --threads divides the cores among MAX")
    group.add_argument("--ray-address", default=None, metavar="ADDR",
                       help="with --ray: the cluster to join, as for 'ray start --address', or 'local' for a new "
                            "local instance in any case (default: RAY_ADDRESS, else a cluster started on this "
                            "machine with 'ray start', else a new local instance)")


def check_options(args: argparse.Namespace) -> None:
    """Refuse Ray options without --ray, or --ray with options it cannot honour (one-line errors)."""
    if not args.ray:
        for flag, value in (("--replicas", args.replicas), ("--autoscale", args.autoscale),
                            ("--ray-address", args.ray_address)):
            if value is not None:
                raise VerispecError(f"{flag} needs --ray")
        return
    if args.trace_rounds:
        raise VerispecError("--trace-rounds traces one engine; it is not available with --ray")


def parse_scaling(replicas: int | None, autoscale: str | None) -> Scaling:
    if replicas is not None and autoscale is not None:
        raise VerispecError("give --replicas N or --autoscale MIN:MAX, not both")
    if autoscale is None:
        count = 1 if replicas is None else replicas
        if count < 1:
            raise VerispecError(f"--replicas must be >= 1, got {count}")
        return Scaling(count, count)
    parts = autoscale.split(":")
    try:
        numbers = [int(part) for part in parts]
    except ValueError:
        numbers = []
    if len(numbers) not in (2, 3) or not 0 <= numbers[0] <= numbers[1] or numbers[1] < 1 \
            or (len(numbers) == 3 and numbers[2] < 1):
        raise VerispecError(f"--autoscale takes MIN:MAX[:TARGET] with 0 <= MIN <= MAX, MAX >= 1 and TARGET >= 1, "
                            f"got {autoscale!r}")
    return Scaling(*numbers)


def local_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def replica_threads(threads: int, scaling: Scaling, cores: int) -> int:
    """Torch threads per replica: ``--threads`` when given, else the cores divided among the most
    replicas there can be, at least 1."""
    if threads > 0:
        return threads
    return max(1, cores // scaling.maximum)


def _absolute(path: str | None, names: tuple[str, ...] = ()) -> str | None:
    """A path option made absolute (replicas do not run in this directory); names such as ``tiny`` stay."""
    if path is None or path in names and not Path(path).exists():
        return path
    return str(Path(path).expanduser().resolve())


def replica_options(args: argparse.Namespace, spec: SpecConfig, config: ServerConfig, threads: int) -> ReplicaOptions:
    from verispec.loading import TARGET_NAMES

    from verispec import profile as profiler

    profile = profiler.load_option(args.profile)
    return ReplicaOptions(target=_absolute(args.target, TARGET_NAMES), draft=_absolute(args.draft, ("tiny",)),
                          device=args.device, backend=args.backend, draft_weights=args.draft_weights,
                          draft_vocab=args.draft_vocab, eagle=_absolute(args.eagle), spec=spec, config=config,
                          adaptive=args.adaptive, model_name=args.served_model_name, profile=profile,
                          threads=threads)


# ---- in a replica --------------------------------------------------------------------------------------------


def replica_label() -> str:
    """This replica's id (Serve's, when running in a replica), process id and host."""
    try:
        from ray import serve

        replica = serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - outside a replica (a test): the process is the replica
        replica = "local"
    return f"{replica} pid={os.getpid()} host={socket.gethostname()}"


class ReplicaHeader:
    """ASGI middleware: adds ``X-Verispec-Replica: <label>`` to every HTTP response, streams included."""

    def __init__(self, app, label: str):
        self.app, self.header = app, (REPLICA_HEADER.lower().encode(), label.encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_header(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), self.header]}
            await send(message)

        return await self.app(scope, receive, send_with_header)


def build_replica_app(options: ReplicaOptions):
    """The FastAPI app of one replica: the pair loaded as ``verispec serve`` loads it, ``create_app``
    around it, the replica header outermost."""
    import torch

    from verispec.loading import freeze_long_lived_objects
    from verispec.server.app import create_app, load_served_pair

    torch.set_num_threads(options.threads)
    pair, spec = load_served_pair(options.target, options.draft, options.spec, device=options.device,
                                  backend=options.backend, draft_weights=options.draft_weights,
                                  draft_vocab=options.draft_vocab, eagle=options.eagle)
    app = create_app(pair, spec, options.config, adaptive=options.adaptive, model_name=options.model_name,
                     profile=options.profile)
    app.add_middleware(ReplicaHeader, label=replica_label())
    freeze_long_lived_objects()
    return app


def deployment(options: ReplicaOptions, scaling: Scaling):
    """The Serve application: an ingress deployment whose replicas each build their app on start."""
    from ray import serve

    def build():
        return build_replica_app(options)

    config = options.config
    ingress = serve.deployment(
        serve.ingress(build)(), name=APP_NAME,
        ray_actor_options={"num_cpus": options.threads},
        # the app queues and answers 429 itself: let every request it could hold reach it
        max_ongoing_requests=config.max_batch + config.max_queue,
        graceful_shutdown_timeout_s=config.shutdown_s + 5,
        **scaling.options())
    return ingress.bind()


# ---- the driver ------------------------------------------------------------------------------------------------


def run(args: argparse.Namespace, spec: SpecConfig, config: ServerConfig) -> int:
    """Deploy on Ray Serve and wait for SIGTERM/SIGINT; then tear down what this process started."""
    from verispec.loading import check_model_args

    scaling = parse_scaling(args.replicas, args.autoscale)
    check_model_args(args.target, args.draft, spec.enabled and spec.drafter == "model")
    if args.draft_vocab not in ("auto", "all") and not args.draft_vocab.isdigit():
        raise VerispecError(f"--draft-vocab takes N, auto or all, got {args.draft_vocab!r}")
    try:
        import ray
        from ray import serve
    except ImportError as err:
        raise VerispecError(f"--ray needs Ray Serve ({err}); {RAY_INSTALL}") from None
    cores = local_cores()
    threads = replica_threads(args.threads, scaling, cores)
    options = replica_options(args, spec, config, threads)

    stop, serving = threading.Event(), threading.Event()

    def on_signal(*_):
        stop.set()
        if not serving.is_set():  # still starting: interrupt that, then tear down what was started
            raise KeyboardInterrupt

    signals = (signal.SIGTERM, signal.SIGINT)
    previous = {number: signal.signal(number, on_signal) for number in signals}
    started: list[bool] = []  # holds True once this process has started a local instance
    try:
        _connect(ray, args.ray_address, max(cores, threads * scaling.maximum), args.verbose, started)
        for number in signals:  # ray.init installs its own SIGTERM handler (sys.exit)
            signal.signal(number, on_signal)
        serve.start(http_options={"host": args.host, "port": args.port}, proxy_location="EveryNode")
        _check_capacity(ray, threads, scaling)
        try:
            serve.run(deployment(options, scaling), name=APP_NAME, route_prefix="/", blocking=False)
        except RuntimeError as err:
            raise VerispecError(_deploy_error(err, serve)) from None
        serving.set()
        where = "a local Ray instance" if started else "the Ray cluster"
        print(f"verispec: serving on http://{args.host}:{args.port} through Ray Serve on {where}: "
              f"{_describe(scaling)}, {threads} torch thread(s) each", file=sys.stderr, flush=True)
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:  # a signal while starting: stopped on request, as when serving
        pass
    finally:
        _teardown(ray, serve, bool(started))
        for number, handler in previous.items():
            signal.signal(number, handler)
    return 0


def _connect(ray, address: str | None, cores: int, verbose: bool, started: list[bool]) -> None:
    """Join a cluster (``address``, else RAY_ADDRESS, else one 'ray start' left on this machine) or, with
    none found or ``address`` ``local``, start a local instance of ``cores`` CPUs and append True to
    ``started``."""
    common = {"log_to_driver": verbose, "logging_level": logging.INFO if verbose else logging.WARNING}
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address != "local":
        try:
            ray.init(address=address or "auto", **common)
            return
        except (ConnectionError, ValueError) as err:
            if address is not None:
                raise VerispecError(f"cannot join the Ray cluster at {address}: {err}") from None
    ray.init(address="local", num_cpus=cores, include_dashboard=False, object_store_memory=LOCAL_OBJECT_STORE_BYTES,
             **common)
    started.append(True)


def _check_capacity(ray, threads: int, scaling: Scaling) -> None:
    """Refuse replicas that could never be placed (each reserves ``threads`` CPUs), instead of waiting."""
    available = ray.cluster_resources().get("CPU", 0)
    needed = threads * max(scaling.minimum, 1)
    if needed > available:
        raise VerispecError(f"{max(scaling.minimum, 1)} replica(s) of {threads} CPU(s) each do not fit the Ray "
                            f"cluster's {available:g} CPUs: lower --threads or the replicas")


def _deploy_error(err: RuntimeError, serve) -> str:
    """One line for a failed deployment: the replica's own error when it was a VerispecError (read from
    the deployment's status message, which holds the replica's traceback)."""
    texts = [str(err)]
    try:
        application = serve.status().applications.get(APP_NAME)
        if application is not None:
            texts += [application.message] + [d.message for d in application.deployments.values()]
    except Exception:  # noqa: BLE001 - the status is a bonus; the error itself is reported below
        pass
    for text in texts:
        for line in reversed([line.strip() for line in (text or "").splitlines()]):
            for marker in ("VerispecError: ", "CheckpointError: "):
                if marker in line:
                    return line.split(marker, 1)[1]
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    last = lines[-1] if lines else type(err).__name__
    return f"the Ray Serve deployment failed: {last} (replica logs: the Ray session's logs/serve/)"


def _describe(scaling: Scaling) -> str:
    if scaling.fixed:
        return f"{scaling.minimum} replica(s)"
    return f"{scaling.minimum} to {scaling.maximum} replicas ({scaling.target_ongoing} requests in flight each)"


def _teardown(ray, serve, started: bool) -> None:
    """Delete the application; shut Serve down with a Ray instance started here (or when no other
    application is left on a joined cluster); then stop, or disconnect from, Ray."""
    if not ray.is_initialized():
        return
    try:
        if started:
            serve.shutdown()
        else:
            serve.delete(APP_NAME)
            if not serve.status().applications:
                serve.shutdown()
    except Exception as err:  # noqa: BLE001 - shutting down: report and go on stopping Ray
        print(f"verispec: warning: stopping Ray Serve: {type(err).__name__}: {err}", file=sys.stderr)
    ray.shutdown()
