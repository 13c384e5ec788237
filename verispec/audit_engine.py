"""What ``verispec audit`` samples with (``audit_engine``): the batched engine over a pair, its target
replaying each prompt's prefill (``SharedPrefill``), or ``SpecEngine`` one generation at a time.

    engine = audit_engine(pair, SpecConfig(gamma=4), rows=64, context=longest_prompt + tokens)
    report = verispec.audit.run_audit(engine, prompts, sampling, spec, config)
"""

from __future__ import annotations

from verispec.config import SpecConfig

DEFAULT_ROWS = 64  # generations the batched engine runs at once (--rows)


def audit_engine(pair, spec: SpecConfig, rows: int = DEFAULT_ROWS, context: int = 0):
    """What ``verispec audit`` samples with: a ``BatchEngine`` of ``rows`` rows over ``pair`` (its draft
    model, EAGLE head or per-row drafter, and for chains the gamma policy ``spec`` names), whose target
    computes each prompt's prefill once (``SharedPrefill``); ``context`` is the longest prompt plus the
    tokens per continuation. ``SpecEngine`` (``build_engine``), one generation at a time, with ``rows`` 1."""
    from verispec.adaptive import make_policy
    from verispec.batch import BatchEngine
    from verispec.loading import build_engine, check_backend_supports, row_drafter

    if rows <= 1:
        return build_engine(pair, spec)
    draft_model = spec.enabled and spec.drafter == "model"
    check_backend_supports(pair, spec)
    # Room for a full round after the longest context, so rounds draft what SpecEngine's draft.
    headroom = max(spec.gamma, spec.tree_shape.cache_positions) + 1
    # A native cache replays each prompt's prefill; a one-sequence cache (RowLoop) runs it per row.
    target = SharedPrefill(pair.target) if pair.target.capabilities.batching else pair.target
    return BatchEngine(target, pair.draft if draft_model else None, spec, max_batch=rows,
                       max_len=min(pair.target.config.max_context, context + headroom), eagle=pair.eagle,
                       gamma_policy=make_policy(spec.gamma_policy, spec.gamma) if spec.method == "chain" else None,
                       make_drafter=row_drafter(pair, spec))


class SharedPrefill:
    """A target whose prefill of a prompt into an empty one-row cache (what ``BatchEngine.add`` runs) is
    computed once and replayed: the same logits (and features), the same keys and values copied into the
    row. Every audit request repeats its prompt, and a prefill is a pure function of the prompt, so the
    replay is what the pass would compute; any other call goes to the target. Holds one prompt's pass."""

    def __init__(self, target):
        self.target = target
        self.prompt: tuple | None = None  # (token ids, with_features) of the pass held
        self.keys = self.values = self.output = None

    def __getattr__(self, name):  # config, capabilities, new_cache, run_layers, ...: the target's
        if name == "target":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.target, name)

    def forward(self, tokens, cache, last_only: bool = False, with_features: bool = False, **options):
        from verispec.cache import KVCache

        if options or not last_only or type(cache) is not KVCache or cache.lengths != [0] or tokens.shape[0] != 1:
            return self.target.forward(tokens, cache, last_only=last_only, with_features=with_features, **options)
        prompt, width = (tuple(tokens[0].tolist()), with_features), tokens.shape[1]
        if prompt != self.prompt:
            self.output = self.target.forward(tokens, cache, last_only=True, with_features=with_features)
            self.keys = cache.keys[:, :, :, :width].clone()  # (L, 1, Hkv, P, D)
            self.values = cache.values[:, :, :, :width].clone()
            self.prompt = prompt
        else:
            cache.keys[:, :, :, :width] = self.keys
            cache.values[:, :, :, :width] = self.values
        return tuple(t.clone() for t in self.output) if with_features else self.output.clone()
