"""What a benchmark run measures, defined once: frozen settings built from TOML, ``--quick`` and flags.

Layers, later wins: these dataclass defaults < the TOML file < the ``--quick`` preset (sizes only) <
command-line flags. Everything resolved here is written into the result JSON.

    config = load_config(toml_path=None, quick=True, overrides={"models": {"target": "ckpt/t"}})
    config.variants()   # [Variant("off", ...), Variant("chain", ...), ...]

A TOML file has the same sections and keys as the dataclasses below (see docs/benchmarking.md)::

    [models]
    target = "path/to/target"
    draft = "path/to/draft"
    [spec]
    budget = 5                      # verified nodes D per round: chain gamma D - 1, trees with d = D
    variants = ["off", "chain", "tree:s3_k2_d5", "hf", "hf_assisted"]
    [offline]
    concurrency = [1, 2, 4]
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from verispec.bench.config_values import arguments, check_serve_arguments, check_type, environment, listify, number
from verispec.config import SIBLING_MODES, SamplingParams, SpecConfig, TreeShape
from verispec.errors import VerispecError

WORKLOADS: tuple[str, ...] = ("sharegpt", "code", "math")
TEMPLATES: tuple[str, ...] = ("auto", "raw", "chat")
PRECISIONS: tuple[str, ...] = ("float32", "bfloat16", "float16")
PEER_KINDS = {"hf": "plain", "hf_assisted": "assisted", "hf_prompt_lookup": "prompt_lookup"}
CACHE_POLICY = ("native: preallocated per request (prompt + max_tokens + drafts + 1 slots; batched: max_batch "
                "x longest request), rollback by length (chains), accepted-path compaction (trees), no prefix "
                "reuse across requests; peer: transformers DynamicCache, cropped after each round")


@dataclass(frozen=True)
class ModelSettings:
    target: str | None = None  # a name (smollm2, tiny) or path; None: smollm2
    draft: str | None = None
    eagle: str | None = None  # the EAGLE head for eagle variants; None: the one shipped for a named target
    tokenizer: str | None = None  # None: the target's
    precision: str = "float32"
    device: str = "cpu"
    backend: str = "auto"  # auto | native | hf (our engine over the transformers adapter)
    threads: int = 0  # torch threads; 0 = torch's default


@dataclass(frozen=True)
class PromptSettings:
    workloads: tuple[str, ...] = WORKLOADS
    per_workload: int = 8
    seed: int = 0
    sharegpt_path: str | None = None  # a ShareGPT-format JSON; None: the packaged dataset's held-out split
    template: str = "auto"  # auto: chat template for ShareGPT (if the tokenizer has one), raw for code/math
    min_input_tokens: int = 4
    max_input_tokens: int = 512
    min_output_tokens: int = 4  # ShareGPT references shorter than this are skipped (as vLLM does)
    max_output_tokens: int = 128  # ShareGPT: min(reference length, this); code and math: this


@dataclass(frozen=True)
class SamplingSettings:
    temperature: float = 0.0  # greedy, so outputs can be compared token for token
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    ignore_eos: bool = False


@dataclass(frozen=True)
class SpecSettings:
    variants: tuple[str, ...] = ("off", "chain", "tree:s3_k2_d5", "tree:dynamic:5", "ngram",
                                 "hf", "hf_assisted", "hf_prompt_lookup")
    baseline: str = "off"
    budget: int = 5  # matched verification budget D: verified nodes per round, the root included
    sibling_mode: str = SpecConfig.sibling_mode
    exit_layer: int = SpecConfig.exit_layer
    ngram_max: int = SpecConfig.ngram_max
    ngram_min: int = SpecConfig.ngram_min
    draft_vocab: str | int = "auto"  # draft-model variants: ids the draft proposes (verispec generate --draft-vocab)
    draft_weights: str = "auto"  # the drafter's own weights in offline runs (--draft-weights; config.DRAFT_WEIGHTS)
    hf_assistant_schedule: str = "constant"  # transformers' num_assistant_tokens_schedule
    hf_assistant_confidence_threshold: float = 0.0  # 0: the assistant always drafts D - 1 tokens


@dataclass(frozen=True)
class OfflineSettings:
    enabled: bool = True
    concurrency: tuple[int, ...] = (1, 2, 4)
    repeats: int = 3
    warmup: int = 1  # unrecorded requests per variant before measuring
    slice_waves: int = 2  # interleaving unit at concurrency c: c * slice_waves prompts
    timeout_s: float = 300.0


@dataclass(frozen=True)
class Endpoint:
    name: str
    url: str
    model: str | None = None  # None: the first id /v1/models lists


@dataclass(frozen=True)
class LaunchSpec:
    """A ``verispec serve`` this run starts (on a free local port) with these extra arguments, and these
    environment variables set on top of the bench's own (``env = { PYTHONPATH = "/tmp/old-worktree" }``
    serves another checkout of verispec: two versions measured side by side in one run)."""

    name: str
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class ServingSettings:
    endpoints: tuple[Endpoint, ...] = ()
    launch: tuple[LaunchSpec, ...] = ()
    request_rates: tuple[float, ...] = (1.0,)  # Poisson arrivals per second (inf: all at once)
    burstiness: float = 1.0  # gamma shape of inter-arrival times; 1 = Poisson, < 1 burstier
    max_concurrency: tuple[int, ...] = (1, 4)  # closed-loop load points (no arrival schedule)
    repeats: int = 1
    # Fresh launched servers for every repeat (repeats outermost, every load point inside each): one
    # server process can be ~15% faster or slower than another of the same code on a shared machine,
    # for its whole life, so with one process per variant that factor never averages out.
    relaunch: bool = False
    timeout_s: float = 120.0
    server_stats: bool | None = None  # ask for spec_stats (our server); None: only from launched servers
    api_key: str = "unused"


@dataclass(frozen=True)
class Variant:
    """One compared configuration. ``verified_nodes`` is D (root + drafts verified per round)."""

    name: str
    kind: Literal["native", "peer"]
    spec: SpecConfig | None = None  # native
    peer: str | None = None  # plain | assisted | prompt_lookup
    num_drafts: int = 0
    verified_nodes: int = 1
    matched_budget: bool = True

    @property
    def batchable(self) -> bool:
        """Runs batched at concurrency > 1: every native variant (``BatchEngine`` runs every method)."""
        return self.kind == "native"

    @property
    def needs_draft(self) -> bool:
        if self.kind == "peer":
            return self.peer == "assisted"
        return self.spec.enabled and self.spec.drafter == "model"

    @property
    def needs_eagle(self) -> bool:
        return self.kind == "native" and self.spec.enabled and self.spec.drafter == "eagle"


@dataclass(frozen=True)
class BenchConfig:
    name: str = "bench"
    out: str = "bench-results"
    mode: str = "auto"  # auto: offline, plus serving when endpoints or launch are configured
    plots: bool = True
    models: ModelSettings = field(default_factory=ModelSettings)
    prompts: PromptSettings = field(default_factory=PromptSettings)
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    spec: SpecSettings = field(default_factory=SpecSettings)
    offline: OfflineSettings = field(default_factory=OfflineSettings)
    serving: ServingSettings = field(default_factory=ServingSettings)

    def __post_init__(self):
        _validate(self)

    @property
    def run_offline(self) -> bool:
        return self.mode in ("offline", "both") or (self.mode == "auto" and self.offline.enabled)

    @property
    def run_serving(self) -> bool:
        has_servers = bool(self.serving.endpoints or self.serving.launch)
        return self.mode in ("serving", "both") or (self.mode == "auto" and has_servers)

    def variants(self) -> list[Variant]:
        names = list(dict.fromkeys(self.spec.variants))
        if self.spec.baseline not in names:
            names.insert(0, self.spec.baseline)
        return [parse_variant(name, self.spec) for name in names]

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


# Sizes only: which models, variants and sampling to use stay as configured.
QUICK_PRESET = {
    "prompts": {"per_workload": 2, "max_output_tokens": 32, "max_input_tokens": 256},
    "offline": {"concurrency": [1, 4], "repeats": 1, "warmup": 1},
    "serving": {"request_rates": [2.0], "max_concurrency": [4], "repeats": 1},
}


def parse_variant(name: str, spec: SpecSettings) -> Variant:
    """``off | chain[:G] | tree:SHAPE | ngram[:G] | self[:G][@E] | eagle[:G] | eagle-tree:SHAPE | hf |
    hf_assisted | hf_prompt_lookup`` (eagle: the target's feature head, ``--method eagle``).
    Chains default to G = budget - 1 drafts, i.e. the same D verified nodes per round as the trees;
    ``self@E`` drafts from exit layer E (default: spec.exit_layer), so one run can sweep E.
    ``chain+N``, ``self+N``, ``eagle+N`` (then ``:G``, ``@E``): lookup first (``--lookup N``); ``+N/L``
    lets a lookup draft up to L (``--lookup-drafts L``)."""
    gamma = spec.budget - 1
    head, _, arg = name.partition(":")
    exit_layer = spec.exit_layer
    if name.startswith("self") and "@" in name:
        name_part, _, exit_text = name.partition("@")
        head, _, arg = name_part.partition(":")
        if head.partition("+")[0] != "self" or not exit_text.isdigit() or int(exit_text) < 1:
            raise VerispecError(f"bad variant {name!r}: write self@E or self:G@E with exit layer E >= 1")
        exit_layer = int(exit_text)
    head, plus, lookup_text = head.partition("+")
    lookup_text, slash, drafts_text = lookup_text.partition("/")
    if plus and (head not in ("chain", "self", "eagle") or not lookup_text.isdigit() or int(lookup_text) < 1
                 or (slash and not drafts_text.isdigit())):
        raise VerispecError(f"bad variant {name!r}: lookup first is chain+N, self+N or eagle+N with N >= 1 "
                            "(+N/L: lookups draft up to L)")
    lookup, lookup_drafts = (int(lookup_text) if plus else 0), (int(drafts_text) if slash else 0)
    try:
        if name == "off":
            return Variant(name, "native", SpecConfig(method="none"))
        if head in ("chain", "ngram", "self", "eagle"):
            gamma = int(arg) if arg else gamma
            drafter = {"chain": "model", "ngram": "ngram", "self": "early_exit", "eagle": "eagle"}[head]
            config = SpecConfig(method="chain", gamma=gamma, drafter=drafter, ngram_max=spec.ngram_max,
                                ngram_min=spec.ngram_min, exit_layer=exit_layer, lookup=lookup,
                                lookup_drafts=lookup_drafts)
            return Variant(name, "native", config, None, gamma, gamma + 1, gamma + 1 == spec.budget)
        if head in ("tree", "eagle-tree") and arg:
            shape = TreeShape.parse(arg)
            config = SpecConfig(method="tree", tree=arg, sibling_mode=spec.sibling_mode,
                                drafter="eagle" if head == "eagle-tree" else "model")
            return Variant(name, "native", config, None, shape.num_drafts, shape.budget, shape.budget == spec.budget)
        if name in PEER_KINDS:
            peer = PEER_KINDS[name]
            drafts = 0 if peer == "plain" else gamma
            return Variant(name, "peer", None, peer, drafts, drafts + 1, True)
    except ValueError:
        pass
    raise VerispecError(f"unknown variant {name!r}; use off, chain[+N[/L]][:G], tree:sN_kK_dD, tree:dynamic:D, "
                        "ngram[:G], self[+N[/L]][:G][@E], eagle[+N[/L]][:G], eagle-tree:SHAPE, hf, hf_assisted or "
                        "hf_prompt_lookup")


def _validate(config: BenchConfig) -> None:
    p, o, s, m = config.prompts, config.offline, config.serving, config.models
    bad = [w for w in p.workloads if w not in WORKLOADS]
    checks = [
        (not bad, f"unknown workload(s) {bad}; choose from {', '.join(WORKLOADS)}"),
        (p.template in TEMPLATES, f"template must be one of {', '.join(TEMPLATES)}, got {p.template!r}"),
        (m.precision in PRECISIONS, f"precision must be one of {', '.join(PRECISIONS)}, got {m.precision!r}"),
        (p.per_workload >= 1, "prompts.per_workload must be >= 1"),
        (1 <= p.min_input_tokens <= p.max_input_tokens, "need 1 <= min_input_tokens <= max_input_tokens"),
        (1 <= p.min_output_tokens <= p.max_output_tokens, "need 1 <= min_output_tokens <= max_output_tokens"),
        (all(c >= 1 for c in o.concurrency), "offline.concurrency values must be >= 1"),
        (o.repeats >= 1 and o.warmup >= 0 and o.slice_waves >= 1, "offline: repeats, slice_waves >= 1, warmup >= 0"),
        (o.timeout_s > 0 and s.timeout_s > 0, "timeouts must be > 0 seconds"),
        (all(r > 0 for r in s.request_rates), "serving.request_rates must be > 0 (inf = all at once)"),
        (s.burstiness > 0, "serving.burstiness must be > 0"),
        (all(c >= 1 for c in s.max_concurrency) and s.repeats >= 1, "serving: max_concurrency, repeats >= 1"),
        (config.mode in ("auto", "offline", "serving", "both"), "mode must be auto, offline, serving or both"),
        (config.mode not in ("serving", "both") or s.endpoints or s.launch,
         "serving needs endpoints: --url URL, --serve, or [[serving.endpoints]] / [[serving.launch]]"),
        (config.spec.budget >= 2, "spec.budget (verified nodes per round) must be >= 2"),
        (config.spec.sibling_mode in SIBLING_MODES, f"sibling_mode must be one of {', '.join(SIBLING_MODES)}"),
        (config.spec.hf_assistant_schedule in ("constant", "heuristic", "heuristic_transient"),
         "hf_assistant_schedule must be constant, heuristic or heuristic_transient"),
    ]
    draft_vocab = config.spec.draft_vocab
    checks += [
        (m.threads >= 0, f"models.threads must be >= 0, got {m.threads}"),
        (draft_vocab in ("auto", "all") or (str(draft_vocab).isdigit() and int(draft_vocab) >= 1),
         f"spec.draft_vocab must be auto, all or a number of token ids >= 1, got {draft_vocab!r}"),
    ]
    for ok, message in checks:
        if not ok:
            raise VerispecError(f"bench config: {message}")
    # Sampling values as the engine checks them, now rather than after the models load.
    SamplingParams(temperature=config.sampling.temperature, top_k=config.sampling.top_k,
                   top_p=config.sampling.top_p, min_p=config.sampling.min_p)
    names = [e.name for e in s.endpoints] + [l.name for l in s.launch]
    if len(set(names)) != len(names):
        raise VerispecError(f"bench config: serving endpoint names must be unique, got {names}")
    config.variants()  # parse every variant now, so a typo fails before any model loads


# ---- building from TOML / dicts (each value's checks: config_values.py) ---------------------------------


def load_config(toml_path: str | Path | None = None, quick: bool = False, overrides: dict | None = None) -> BenchConfig:
    data: dict = {}
    if toml_path is not None:
        data = read_toml(toml_path)
        for name in _NESTED:  # before merging, which would replace a non-table with the flags' table
            if name in data and not isinstance(data[name], dict):
                raise VerispecError(f"bench config: [{name}] must be a table, got {name} = {data[name]!r}")
    if quick:
        data = merge(data, QUICK_PRESET)
    config = from_dict(merge(data, overrides or {}))
    for index, launch in enumerate(config.serving.launch):
        if "PYTHONPATH" not in dict(launch.env):  # another checkout of verispec may take other options
            check_serve_arguments(launch.args, f"serving.launch[{index}] ({launch.name})")
    return config


def read_toml(path: str | Path) -> dict:
    import tomllib

    try:
        return tomllib.loads(Path(path).read_text())
    except OSError as err:
        raise VerispecError(f"cannot read bench config {str(path)!r}: {err}") from None
    except tomllib.TOMLDecodeError as err:
        raise VerispecError(f"bench config {str(path)!r} is not valid TOML: {err}") from None


def merge(base: dict, top: dict) -> dict:
    """Nested dict merge; ``top`` wins, None values in ``top`` mean "not given"."""
    out = dict(base)
    for key, value in top.items():
        if value is None:
            continue
        if isinstance(value, dict):
            out[key] = merge(out.get(key) if isinstance(out.get(key), dict) else {}, value)
        else:
            out[key] = value
    return out


def from_dict(data: dict) -> BenchConfig:
    return _build(BenchConfig, data, "")


_NESTED = {"models": ModelSettings, "prompts": PromptSettings, "sampling": SamplingSettings, "spec": SpecSettings,
           "offline": OfflineSettings, "serving": ServingSettings}


def _build(cls, data: dict, where: str):
    if not isinstance(data, dict):
        raise VerispecError(f"bench config: [{where}] must be a table")
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise VerispecError(f"bench config: unknown key(s) {unknown} in [{where or 'top level'}]; known: "
                            f"{', '.join(known)}")
    kwargs = {}
    for name, value in data.items():
        path = f"{where}.{name}" if where else name
        if cls is BenchConfig and name in _NESTED:
            kwargs[name] = _build(_NESTED[name], value, path)
        elif cls is ServingSettings and name == "endpoints":
            kwargs[name] = tuple(_build(Endpoint, e, path) for e in listify(value, path))
        elif cls is ServingSettings and name == "launch":
            kwargs[name] = tuple(_build(LaunchSpec, dict(e, args=arguments(e.get("args", []), path),
                                                          env=environment(e.get("env", {}), path)), path)
                                 for e in listify(value, path))
        elif isinstance(value, list):
            check_type(known[name], value, path)
            kwargs[name] = tuple(number(v, known[name]) for v in value)
        else:
            check_type(known[name], value, path)
            kwargs[name] = number(value, known[name])
    try:
        return cls(**kwargs)
    except TypeError as err:
        raise VerispecError(f"bench config [{where}]: {err}") from None
