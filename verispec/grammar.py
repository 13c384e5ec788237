"""Structured outputs: a grammar's token mask as one more sampling transform, exact under speculation.

    compiler = GrammarCompiler(tokenizer, vocab_size=49152, eos_ids=[2])
    guide = compiler.constraint(GrammarSpec("json_schema", schema_text))
    result = engine.generate(prompt, replace(sampling, guide=guide), spec, stop)

A request's grammar (any JSON object, a JSON schema, a regex or a Lark grammar) compiles through
llguidance into a matcher over the target's token ids. At every position the matcher's mask sends the
logits of the tokens the grammar forbids to -inf before the sampling pipeline (temperature, top-k,
top-p, min-p) runs, for the target and the drafter alike, so the constrained distribution is the
target's distribution restricted to the grammar and renormalised, whatever the method.

Under speculation the matcher runs ahead of what is committed, and rolls back:
- a drafter draws each draft from its masked q and *stages* it (``draw_draft`` does both);
- the engine stages the drafts that were not drawn that way (n-gram lookups, point masses), cutting the
  proposal at the first one the grammar forbids (its target probability is 0: it could never be
  accepted), appends the tokens the grammar forces next (llguidance's fast-forward tokens: point-mass
  drafts that cost no drafting, verified like any other, so plain decoding gains them too), and takes
  one mask per verified row: K + 1 for K drafts;
- the staged drafts are rolled back, and the committed tokens then advance the matcher for good.
Trees: each node's children are drafted under the mask of the state after the node's path (static
trees: the main path; dynamic trees: every expanded node), and each node's row is verified under it (a
node the grammar forbids is never accepted, so the rows below it are never used).

JSON is compact (no free whitespace between tokens), so a constrained answer ends with EOS, which the
mask allows once the grammar is complete and forces once nothing else can follow; past EOS the mask
allows EOS alone (so ``ignore_eos`` pads a finished answer with EOS, a fixed-length sequence that the
audit can score exactly).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy
import torch

from verispec.errors import VerispecError
from verispec.tree import path_nodes

KINDS = ("json_object", "json_schema", "regex", "lark")
FORCED_DRAFTS = 16  # at most this many tokens the grammar forces are appended to a round's drafts


class GrammarError(VerispecError):
    """A grammar (schema, regex, Lark text) that cannot be compiled, or a token it cannot take."""


@dataclass(frozen=True)
class GrammarSpec:
    """What to constrain to: ``kind`` in KINDS and its source text (a JSON schema, a regex, a Lark
    grammar; empty for ``json_object``)."""

    kind: str
    source: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise GrammarError(f"grammar kind must be one of {', '.join(KINDS)}; got {self.kind!r}")
        if self.kind != "json_object" and not self.source.strip():
            raise GrammarError(f"a {self.kind} grammar needs a non-empty source")

    @classmethod
    def json_schema(cls, schema: dict | str) -> "GrammarSpec":
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as err:
                raise GrammarError(f"the JSON schema is not valid JSON: {err}") from None
        if not isinstance(schema, dict):
            raise GrammarError(f"a JSON schema must be a JSON object; got {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema))


def grammar_text(spec: GrammarSpec) -> str:
    """The llguidance grammar for ``spec`` (unchecked; ``GrammarCompiler`` validates it)."""
    import llguidance

    compact = {"whitespace_flexible": False}
    if spec.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=compact)
    if spec.kind == "json_schema":
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(spec.source, defaults=compact)
        except ValueError as err:
            raise GrammarError(f"invalid JSON schema: {err}") from None
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.source)
    return llguidance.LLMatcher.grammar_from_lark(spec.source)


class GrammarCompiler:
    """Compiles grammars against one tokenizer (building llguidance's view of the vocabulary once:
    seconds for a 49k-token vocabulary) and makes a fresh ``Constraint`` per request."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: list[int] | tuple[int, ...]):
        try:
            import llguidance.hf
        except ImportError:
            raise GrammarError("structured outputs need llguidance: pip install 'verispec[server]' "
                               "(or pip install llguidance)") from None
        if not eos_ids:
            raise GrammarError("structured outputs need an EOS token id to end the output")
        self.vocab_size = vocab_size
        self.eos_ids = tuple(eos_ids)
        self.info = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos_ids))

    def check(self, spec: GrammarSpec) -> str:
        """The validated grammar text; ``GrammarError`` with llguidance's reason if it does not compile."""
        import llguidance

        text = grammar_text(spec)
        error = llguidance.LLMatcher.validate_grammar(text, self.info)
        if error:
            reason = " ".join(error.split())
            raise GrammarError(f"the {spec.kind.replace('_', ' ')} does not compile: {reason[:300]}")
        return text

    def constraint(self, spec: GrammarSpec) -> "Constraint":
        import llguidance

        matcher = llguidance.LLMatcher(self.info, self.check(spec), log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the {spec.kind.replace('_', ' ')} does not compile: {matcher.get_error()[:300]}")
        return Constraint(matcher, self.vocab_size, self.eos_ids, spec)


class Constraint:
    """One request's matcher: the mask at its current state, tokens staged ahead (drafts) and rolled
    back, tokens committed. Masks are bool (V,) tensors, True where the grammar allows the token."""

    def __init__(self, matcher, vocab_size: int, eos_ids: tuple[int, ...], spec: GrammarSpec):
        import llguidance.torch

        self.matcher, self.vocab_size, self.eos_ids, self.spec = matcher, vocab_size, eos_ids, spec
        self._bits = llguidance.torch.allocate_token_bitmask(1, vocab_size)
        self._fill = llguidance.torch.fill_next_token_bitmask
        self._mask: torch.Tensor | None = None  # the current state's, computed on demand
        self.staged: list[int] = []  # drafts consumed ahead of the committed tokens
        self.staged_masks: list[torch.Tensor] = []  # the mask each staged draft was drawn under
        self._staged_consumed = 0  # of the staged drafts, those the matcher consumed (rollback count)

    # ---- the mask at the current state ---------------------------------------------------------------

    def reset(self) -> None:
        """Back to the grammar's start, nothing staged (a constraint serves one request at a time)."""
        self.matcher.reset()
        self._mask = None
        self.staged, self.staged_masks, self._staged_consumed = [], [], 0

    def mask(self) -> torch.Tensor:
        """The allowed tokens now; never empty: past the end of the grammar (EOS consumed), EOS."""
        if self._mask is None:
            self._fill(self.matcher, self._bits, 0)
            packed = self._bits[0].numpy().view(numpy.uint8)
            mask = torch.from_numpy(numpy.unpackbits(packed, bitorder="little")[:self.vocab_size].astype(bool))
            if not mask.any():
                mask[list(self.eos_ids)] = True
            self._mask = mask
        return self._mask

    def allows(self, token: int) -> bool:
        return 0 <= token < self.vocab_size and bool(self.mask()[token])

    def _consume(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise GrammarError(f"the grammar matcher refused token {token}: {self.matcher.get_error()[:200]}")
        self._mask = None

    @property
    def finished(self) -> bool:
        """The grammar is complete and nothing but EOS may follow."""
        return self.matcher.is_stopped()

    # ---- drafts: staged ahead, then rolled back ------------------------------------------------------

    def stage(self, token: int) -> bool:
        """Consume a draft ahead of the committed tokens if the grammar allows it; False otherwise."""
        mask = self.mask()
        if not (0 <= token < self.vocab_size and bool(mask[token])):
            return False
        self.staged_masks.append(mask)
        if not self.finished:  # past the end (EOS after EOS) the matcher takes nothing more
            self._consume(token)
            self._staged_consumed += 1
        self.staged.append(token)
        return True

    def round_masks(self, drafts: list[int], forced_limit: int = 0) -> tuple[int, list[int], torch.Tensor]:
        """Stage ``drafts`` (the drafter may have staged a prefix of them already) up to the first one the
        grammar forbids, then, if all were allowed, up to ``forced_limit`` tokens the grammar forces after
        them (llguidance's fast-forward tokens: free drafts). Returns how many drafts it allows (n), the
        forced tokens (f), and the n + f + 1 masks of the rows that verify them."""
        if self.staged != drafts[:len(self.staged)]:  # the drafter staged something else: start over
            self.unstage()
        allowed = len(self.staged)
        while allowed < len(drafts) and self.stage(int(drafts[allowed])):
            allowed += 1
        forced: list[int] = []
        while allowed == len(drafts) and len(forced) < forced_limit and not self.finished:
            run = self.matcher.compute_ff_tokens()[:forced_limit - len(forced)]
            taken = next((i for i, token in enumerate(run) if not self.stage(token)), len(run))
            forced += run[:taken]
            if not run or taken < len(run):
                break
        masks = torch.stack(self.staged_masks[:allowed + len(forced)] + [self.mask()])
        return allowed, forced, masks

    def unstage(self) -> None:
        if self._staged_consumed:
            self.matcher.rollback(self._staged_consumed)
            self._mask = None
        self.staged, self.staged_masks, self._staged_consumed = [], [], 0

    def mask_after(self, tokens: list[int]) -> torch.Tensor:
        """The mask after ``tokens`` staged past the committed state (a tree node's path), nothing left
        staged; all False if the grammar forbids the path."""
        self.unstage()
        allowed = all(self.stage(token) for token in tokens)
        mask = self.mask() if allowed else torch.zeros(self.vocab_size, dtype=torch.bool)
        self.unstage()
        return mask

    def tree_masks(self, parents: list[int], tokens: list[int]) -> torch.Tensor:
        """Masks (N + 1, V) for a tree's rows: row 0 the root's (the committed state), row i the state
        after node i's path. Rows under a node the grammar forbids are never used: they allow everything."""
        rows = []
        for node in range(len(tokens)):
            mask = self.mask_after([tokens[i] for i in path_nodes(parents, node)])
            rows.append(mask if mask.any() else torch.ones(self.vocab_size, dtype=torch.bool))
        return torch.stack(rows)

    def path_masks(self, tokens: list[int]) -> tuple[torch.Tensor, int]:
        """From the grammar's start: masks (len(tokens) + 1, V), row i the state after tokens[:i], and how
        many leading tokens the grammar allows (rows past the first forbidden one allow everything).
        Leaves the constraint at its start."""
        self.reset()
        rows, allowed = [], 0
        for token in tokens:
            rows.append(self.mask())
            if not self.stage(token):
                break
            allowed += 1
        if allowed == len(tokens):
            rows.append(self.mask())
        rows += [torch.ones(self.vocab_size, dtype=torch.bool)] * (len(tokens) + 1 - len(rows))
        self.reset()
        return torch.stack(rows), allowed

    # ---- committed tokens ----------------------------------------------------------------------------

    def advance(self, tokens: list[int]) -> None:
        """Commit tokens (each one the grammar allows: they were sampled under its mask)."""
        self.unstage()
        for token in tokens:
            if self.finished:  # EOS consumed or the grammar complete: nothing more to match
                return
            if not self.allows(token):
                raise GrammarError(f"token {token} is outside the grammar at this point")
            self._consume(token)

