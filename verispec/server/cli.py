"""``verispec serve``: load the pair, build the app, run uvicorn.

    verispec serve --target DIR --draft DIR --gamma 4 --max-batch 16 --port 8000
    verispec serve --method ngram --adaptive          # SmolLM2, drafts from the context
"""

from __future__ import annotations

import argparse
import os
import sys

from verispec.config import COMMAND_CHAIN_POLICY, SpecConfig
from verispec.errors import VerispecError
from verispec.server.scheduler import ServerConfig

METHODS = ("model", "chain", "tree", "ngram", "self", "eagle", "none")  # as generate's --method, and none


def add_parser(commands) -> None:
    defaults, spec = ServerConfig(), SpecConfig()
    serve = commands.add_parser(
        "serve", help="OpenAI-compatible HTTP server with batched speculative decoding",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics. Requests "
                    "are batched continuously; each round drafts for every running request and verifies all "
                    "of them in one target pass. With no --target, SmolLM2-135M-Instruct and its shipped draft. "
                    "Greedy output never depends on the batch; seeded sampled output is exact for a seed and a "
                    "batch size, and may differ (never in distribution) with the batch size (docs/serving.md).")
    from verispec.options import add_model_options, add_threads_option

    add_model_options(serve)
    add_threads_option(serve)
    serve.add_argument("--method", choices=METHODS, default="model",
                       help="model (default): the draft model proposes a chain of --gamma tokens, or with --tree "
                            "a candidate tree (chain and tree name those two); ngram: continuations found earlier "
                            "in the context (no draft model; a chain, or a tree with --tree); self: the target's "
                            "first --exit-layer layers draft; eagle: the target's feature head (--eagle DIR, "
                            "default the head shipped for the named target), a chain or with --tree a tree; "
                            "none: plain decoding. Every method is batched: one target pass verifies every "
                            "running request's chain or tree")
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on every request but /health (default: the "
                            "VERISPEC_API_KEY environment variable; unset: no key)")
    serve.add_argument("--metrics-public", action="store_true", help="serve /metrics without the API key")
    serve.add_argument("--max-body-bytes", type=int, default=defaults.max_body_bytes,
                       help=f"larger request bodies get HTTP 413 (default {defaults.max_body_bytes})")
    serve.add_argument("--no-spec", action="store_true", help="plain decoding, as --method none (and as generate)")
    serve.add_argument("--gamma", type=int, default=spec.gamma,
                       help=f"drafts per round; with --adaptive the most tried (default {spec.gamma})")
    serve.add_argument("--adaptive", action="store_true",
                       help="(the default for chains; --gamma-policy fixed turns it off) "
                            "choose gamma per round from measured round times and acceptance for the load "
                            "(the largest batch of the last 16 rounds), including 0 (speculation off) when the "
                            "batch is large; the draft catches up on what it missed only where that pays. "
                            "A lone request's depth follows its runs (+2 after a fully accepted round, -1 "
                            "otherwise, up to --gamma)")
    serve.add_argument("--gamma-policy", choices=("fixed", "adaptive"), default=None,
                       help="generate's spelling: adaptive is --adaptive (the default for chains), fixed "
                            "always --gamma (the default for trees)")
    from verispec.options import add_draft_options, add_shape_options

    add_shape_options(serve)
    add_draft_options(serve)
    serve.add_argument("--profile", metavar="JSON",
                       help="with the adaptive policy: start batch 1 at the gamma a calibrated profile predicts best "
                            "(verispec profile --calibrate N --out FILE) instead of climbing from 0; the "
                            "server's own rounds then replace the profile's estimates")
    serve.add_argument("--trace-rounds", metavar="FILE",
                       help="append one JSON line per round to FILE: batch size, the load chosen for, the gamma "
                            "chosen and the one run after the draft's reads were priced, round time, rows that "
                            "drafted, drafts accepted (to see why the server speculated or did not)")
    serve.add_argument("--logprobs-mode", choices=("raw", "processed"), default=defaults.logprobs_mode,
                       help="logprobs requests get: raw (the target's log-softmax before temperature and filters, "
                            "vLLM's default) or processed (the log of the distribution each token was sampled "
                            "from: penalties, grammar mask, temperature, top-k/p, min-p applied; -9999.0 for an "
                            f"excluded token) (default {defaults.logprobs_mode})")
    serve.add_argument("--max-batch", type=int, default=defaults.max_batch,
                       help=f"requests decoded together (default {defaults.max_batch})")
    serve.add_argument("--max-model-len", type=int, default=defaults.max_model_len,
                       help=f"prompt + output tokens per request, at most the model's context; the KV cache is "
                            f"preallocated for --max-batch requests of this length (default {defaults.max_model_len})")
    serve.add_argument("--max-queue", type=int, default=defaults.max_queue,
                       help=f"requests that may wait for a batch row; more get HTTP 429 (default {defaults.max_queue})")
    serve.add_argument("--timeout", type=float, default=defaults.timeout_s,
                       help=f"seconds a request may take before it is aborted with HTTP 504 (default "
                            f"{defaults.timeout_s:g})")
    serve.add_argument("--shutdown-grace", type=float, default=defaults.shutdown_s, metavar="SECONDS",
                       help=f"on SIGTERM or SIGINT: answer new requests with HTTP 503, give running ones this long "
                            f"to finish, then abort them (a 503 body, or an error event in a stream) and exit 0 "
                            f"(default {defaults.shutdown_s:g})")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    serve.add_argument("--served-model-name", default=None,
                       help="model id clients send and /v1/models lists (default: the target file's or directory's name, "
                            "verispec-default for the embedded pair)")
    serve.add_argument("--verbose", action="store_true", help="log requests and progress")
    from verispec.server import ray_serve

    ray_serve.add_options(serve)
    serve.set_defaults(run=run_serve)


def config_from_args(args) -> tuple[SpecConfig, ServerConfig]:
    from verispec.options import drafts_tree, spec_from_args

    if args.max_batch < 1:
        raise VerispecError(f"--max-batch must be >= 1, got {args.max_batch}")
    if not 0 <= args.port <= 65535:
        raise VerispecError(f"--port must be in 0..65535, got {args.port}")
    if args.max_model_len < 16:
        raise VerispecError(f"--max-model-len must be >= 16, got {args.max_model_len}")
    if args.max_queue < 0:
        raise VerispecError(f"--max-queue must be >= 0, got {args.max_queue}")
    if not args.timeout > 0:
        raise VerispecError(f"--timeout must be > 0 seconds, got {args.timeout}")
    if not 0 <= args.shutdown_grace < float("inf"):
        raise VerispecError(f"--shutdown-grace must be a finite number of seconds >= 0, got {args.shutdown_grace}")
    if args.gamma_policy == "adaptive":
        args.adaptive = True
    if args.no_spec:
        args.method = "none"
    tree = drafts_tree(args)
    if args.method != "none" and not tree and args.gamma_policy is None:
        args.adaptive = args.adaptive or COMMAND_CHAIN_POLICY == "adaptive"  # chains' default
    if args.profile and not args.adaptive:
        raise VerispecError("--profile seeds the adaptive policy: add --adaptive")
    if args.method == "none":
        if args.adaptive:
            raise VerispecError("--adaptive chooses how many drafts to verify; it needs speculation "
                                "(drop --method none)")
        spec = SpecConfig(method="none")
    else:
        if args.adaptive and tree:
            raise VerispecError("--adaptive chooses a chain's length; a tree drafts its shape "
                                "(drop --adaptive or --tree)")
        args.gamma_policy = "adaptive" if args.adaptive else "fixed"
        spec = spec_from_args(args)
    if args.max_body_bytes < 1024:
        raise VerispecError(f"--max-body-bytes must be >= 1024, got {args.max_body_bytes}")
    api_key = args.api_key if args.api_key is not None else os.environ.get("VERISPEC_API_KEY") or None
    return spec, ServerConfig(max_batch=args.max_batch, max_queue=args.max_queue, timeout_s=args.timeout,
                              shutdown_s=args.shutdown_grace,
                              max_model_len=args.max_model_len, api_key=api_key,
                              metrics_public=args.metrics_public, max_body_bytes=args.max_body_bytes,
                              logprobs_mode=args.logprobs_mode)


def run_serve(args: argparse.Namespace) -> int:
    spec, config = config_from_args(args)
    from verispec.server import ray_serve

    ray_serve.check_options(args)
    if args.ray:
        return ray_serve.run(args, spec, config)
    try:
        import uvicorn

        from verispec.server.app import GracefulServer, create_app, load_served_pair
    except ImportError as err:
        raise VerispecError(f"serving needs the 'server' extra ({err}); pip install 'verispec[server]'") from None
    from verispec.loading import freeze_long_lived_objects

    pair, spec = load_served_pair(args.target, args.draft, spec, device=args.device, backend=args.backend,
                                  draft_weights=args.draft_weights, draft_vocab=args.draft_vocab, eagle=args.eagle)
    from verispec import profile as profiler

    profile = profiler.load_option(args.profile)
    app = create_app(pair, spec, config, adaptive=args.adaptive, model_name=args.served_model_name, profile=profile,
                     trace_rounds=args.trace_rounds)
    freeze_long_lived_objects()
    if not pair.target.capabilities.batching:
        print("note: this target keeps one sequence per cache (compressed attention, or a transformers-backed "
              "model): the batched engine runs its rows' passes one after another, none shared", file=sys.stderr)
    log_level = "info" if args.verbose else "warning"
    server = GracefulServer(uvicorn.Config(app, host=args.host, port=args.port, log_level=log_level,
                                           timeout_graceful_shutdown=int(config.shutdown_s) + 5))
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled, after the graceful shutdown
        pass
    return 0
