"""Choosing gamma at run time from measured costs and acceptance. Pure Python, no torch.

``AdaptiveGamma`` keeps, per batch-size bucket (1, 2, 4, ..., 64), the wall time and rows of the last
``window`` (15) rounds of each candidate gamma, plus per-position conditional acceptance shared by all
buckets. It predicts committed tokens per second for each gamma as the median over those rounds of

    rows * E[N](gamma) / seconds,   E[N] = 1 + a_1 + a_1 a_2 + ...

(each round's rate at its own batch size; once 20 drafting rounds are in, E[N] is corrected for how
rounds start, ``costmodel.expected_tokens_by_start``: right after a rejection the draft is right less
often, and a larger gamma starts more rounds there) and picks the best. Gamma 0 (plain decoding) is a
candidate, so speculation switches itself off when the batch is large enough that verifying extra
positions costs more than the accepted tokens bring; speculation must beat it by ``margin`` (3%).

- Climbing: a new bucket tries the candidates from gamma 0 upwards while the largest tried is the best or
  within ``climb_tolerance`` (10%) of it, and never past the best gamma of the nearest smaller bucket
  already decided (``_cap``). A candidate is judged on at least ``min_samples`` (3) rounds.
- Re-measuring: a neighbour of the current best is re-measured ``explore_every`` rounds after the best
  last changed, then after 2x, 4x, ... (up to 64x) while the best stays; its ``min_samples`` fresh rounds
  replace its old window.
- The load: a choice is made for the largest batch of the last ``hold_rounds`` (16) rounds, not for one
  round's dip (requests finishing together), so the draft does not read rows' prompts for a dip.
- The draft's reads: leaving gamma 0 makes the draft read what every row committed meanwhile. Engines
  ask ``afford`` before such a round with its ``Backlog`` (tokens to read, tokens the rows may still
  generate), priced at the measured seconds per read token (``reads``). Switching to the bucket's best
  gamma must save, over the remaining tokens, at least the reads; a first climb in a bucket must pay
  even if the untried gamma gained what the smaller buckets' gains trend to (``_smaller_gain``; batch 1,
  with no smaller bucket, climbs at once); a re-measure from gamma 0, or a gamma beyond the smaller
  bucket's, is exploration whose reads may take at most ``switch_budget`` (0.5%) of the time the bucket
  spent at gamma 0 since it last speculated. A re-measure between two speculating gammas is no switch.
  Round times exclude these reads: they are a cost of switching, paid once.
- Prompt reads: the draft reads every new request's prompt once it speculates at all, a cost plain
  decoding never pays. Engines report it (``charge``, ``finished``), and a speculative gamma's predicted
  time carries it per committed token: the mean seconds of a prompt read over the mean output of a
  finished request (``prompt_seconds_per_token``).
- Per request: one request's own acceptance (an ``AcceptanceCounts`` passed to ``choose``) is blended
  with the shared rates, which weigh as ``prior_rounds`` (8) rounds of prior evidence. Round times stay
  shared: a round's cost does not depend on whose tokens it verifies.
- Batch 1 follows runs (``follow_runs``): once the cost model says speculation pays with a chain of 2 or
  more, a request's depth starts at the cost model's gamma, gains ``RUN_UP`` (2) after a round that
  accepted every draft and loses 1 after any other, within [1, 2 x the largest candidate]; the round
  drafts min(depth, largest candidate). Whether to speculate is re-checked every ``FOLLOW_CHECK_ROUNDS``
  rounds. Where the cost model's gamma is 1 the drafts are too rarely right for one accepted draft to
  say the next ones will be: such requests stay at the model's gamma (SmolLM2's draft model, accepted
  about 0.2 a draft: 0.99x plain following runs, 1.03x not; the tiny pair, gamma 4-5: 2.19x following,
  2.04x not; experiments/policy_variants.py).

docs/algorithms.md gives the measurements behind these choices and the experiments that re-measure them.
The policy protocol, ``AcceptanceCounts``, ``Backlog`` and the simple policies (``FixedGamma``,
``HFHeuristicGamma``, ``CycleGamma``) live in ``gamma_policies`` and are importable from here too.
"""

from __future__ import annotations

from collections import deque

from verispec.costmodel import expected_tokens, expected_tokens_by_start
from verispec.gamma_policies import (POLICY_MEMBERS, AcceptanceCounts, Backlog, CycleGamma, FixedGamma,
                                     GammaPolicy, GammaPolicyBase, HFHeuristicGamma, check_policy,
                                     report_draft_reads)

__all__ = ["DEFAULT_CANDIDATES", "POLICY_MEMBERS", "AcceptanceCounts", "AdaptiveGamma", "Backlog", "CycleGamma",
           "FixedGamma", "GammaPolicy", "GammaPolicyBase", "HFHeuristicGamma", "check_policy", "make_policy",
           "report_draft_reads"]

DEFAULT_CANDIDATES = (0, 1, 2, 3, 4, 6, 8)


class AdaptiveGamma(GammaPolicyBase):
    RUN_UP = 2  # batch 1: depth added after a fully accepted round (one is taken off after any other)
    FOLLOW_CHECK_ROUNDS = 16  # batch 1: rounds between re-checks that following the run still beats plain decoding
    RATE_REFRESH_ROUNDS = 4  # a bucket's rounds between recomputations of the candidates' rates (``_rates``)

    def __init__(self, max_gamma: int = 8, candidates: tuple[int, ...] = DEFAULT_CANDIDATES,
                 explore_every: int = 50, window: int = 15, margin: float = 0.03, min_samples: int = 3,
                 prior_rounds: float = 8.0, switch_budget: float = 0.005, hold_rounds: int = 16,
                 climb_tolerance: float = 0.1, follow_runs: bool = True):
        self.candidates = tuple(sorted({c for c in candidates if c <= max_gamma} | {0}))
        self.explore_every, self.window, self.margin = explore_every, window, margin
        self.switch_budget, self.climb_tolerance = switch_budget, climb_tolerance
        self.recent_sizes: deque[int] = deque(maxlen=max(1, hold_rounds))  # batch sizes of the last rounds
        self.read_log: deque[tuple[int, float]] = deque(maxlen=window)  # recent draft reads: (tokens, seconds)
        self.plain_seconds: dict[int, float] = {}  # per bucket: time at gamma 0 since it last speculated
        self.min_samples, self.prior_rounds = min_samples, prior_rounds
        self.min_rounds_for_start = 20  # drafting rounds before E[N] is corrected for round starts
        self.samples: dict[tuple[int, int], int] = {}  # (bucket, gamma) -> rounds since last (re)start
        # (bucket, gamma) -> the last ``window`` rounds as (seconds, rows), and their medians
        self.recent: dict[tuple[int, int], tuple[deque[float], deque[int]]] = {}  # (seconds, rows)
        # (their medians are taken when read, not every round: ``_settle``)
        self._round_seconds: dict[tuple[int, int], float] = {}
        self._round_rows: dict[tuple[int, int], float] = {}
        self._stale: set[tuple[int, int]] = set()  # keys observed since their medians were last taken
        self.counts = AcceptanceCounts(max(self.candidates))  # every request's rounds
        # The draft's prompt reads (``charge``) and finished requests' outputs (``finished``).
        self.prompt_read_seconds, self.prompts_read = 0.0, 0
        self.requests_finished = self.output_tokens = 0
        self.rounds_in_bucket: dict[int, int] = {}
        self.last_best: dict[int, int] = {}  # per bucket: the best gamma when last checked
        # Per (bucket, best gamma): rounds until the next re-measure of that best's neighbours. Keyed
        # by the best too, because requests with their own acceptance have different bests.
        self.interval: dict[tuple[int, int], int] = {}
        self.next_explore: dict[tuple[int, int], int] = {}
        self.explorations: dict[tuple[int, int], int] = {}
        # Batch-1 estimates from a profile (``seed``), and those not yet replaced by measured rounds.
        self.seeds: dict[tuple[int, int], float] = {}
        self.unmeasured_seeds: set[tuple[int, int]] = set()
        # Batch 1: the request whose depth follows its runs, and that depth (``_run_depth``).
        self.follow_runs = follow_runs
        self._run: tuple[AcceptanceCounts, int] | None = None
        self._follow_until = 0  # bucket 1's round count until which the run's depth is returned unchecked
        # Per bucket: (request, tried gammas, round count, rates) of the last ``_rates`` computation.
        self._rate_cache: dict[int, tuple] = {}

    @property
    def round_seconds(self) -> dict[tuple[int, int], float]:
        """(bucket, gamma) -> median wall time of its recent rounds."""
        if self._stale:
            self._settle()
        return self._round_seconds

    @property
    def round_rows(self) -> dict[tuple[int, int], float]:
        """(bucket, gamma) -> median batch size of its recent rounds."""
        if self._stale:
            self._settle()
        return self._round_rows

    def _settle(self) -> None:
        for key in self._stale:
            seconds, rows = self.recent[key]
            self._round_seconds[key], self._round_rows[key] = _median(seconds), _median(rows)
        self._stale.clear()

    def seed(self, round_seconds: dict[int, float], acceptance: list[float], rounds: float = 20.0) -> None:
        """Start batch 1 from a calibrated profile instead of climbing from gamma 0 (a fresh server
        spends its first requests climbing): ``round_seconds`` per gamma
        (0: a plain decoding step) are estimates of its rounds, and ``acceptance`` per position counts
        as ``rounds`` rounds of evidence (fractional counts that keep each conditional rate). The
        profile gives the costs' shape, the server's own rounds their level: once a seeded gamma has
        run, every gamma still unmeasured is rescaled by its measured / seeded ratio (the machine
        can be 10-30% faster or slower than when it was profiled)."""
        for gamma, seconds in round_seconds.items():
            key = (1, gamma)
            if gamma in self.candidates and seconds > 0:
                self.seeds[key] = self.round_seconds[key] = seconds
                self.round_rows[key] = 1.0
                self.unmeasured_seeds.add(key)
        reach = float(rounds)
        for position, rate in enumerate(acceptance[:len(self.counts.reached) - 1], start=1):
            self.counts.reached[position] += reach
            self.counts.accepted[position] += reach * rate
            reach *= rate

    @staticmethod
    def bucket(batch_size: int) -> int:
        size = 1
        while size < batch_size:
            size *= 2
        return size

    def acceptance(self, request: AcceptanceCounts | None = None) -> list[float]:
        """Conditional acceptance per draft position (1-based index i -> [i - 1]); optimistic 0.5
        until measured. With ``request``, that request's rates blended with the shared ones."""
        shared = self.counts.rates(max(self.candidates))
        return shared if request is None else request.rates(len(shared), shared, self.prior_rounds)

    def predicted_rate(self, batch_size: int, gamma: int, acceptance: list[float] | None = None,
                       tokens: float | None = None) -> float | None:
        """Committed tokens per second of ``gamma`` in ``batch_size``'s bucket, at the batch sizes its
        rounds were measured with (a bucket spans up to 2x in rows, and a round's time grows with its
        rows, so projecting every gamma onto the current batch size would favour whichever gamma
        happened to be measured on fewer rows). ``tokens``: E[N] if the caller has it already."""
        key = (self.bucket(batch_size), gamma)
        seconds = self.round_seconds.get(key)
        if seconds is None or seconds <= 0:
            return None
        if tokens is None:
            tokens = self.expected(acceptance if acceptance is not None else self.acceptance(), gamma)[gamma]
        per_token = self.prompt_seconds_per_token() if gamma else 0.0
        recent = self.recent.get(key)
        if recent and recent[0]:
            # The median of each round's own rate: medians of seconds and of rows taken apart pair one
            # round's time with another round's rows where a window mixes batch sizes.
            return _median([rows * tokens / (s + rows * tokens * per_token) for s, rows in zip(*recent)])
        committed = self.round_rows[key] * tokens  # a seeded estimate, no rounds yet
        return committed / (seconds + committed * per_token)

    def expected(self, acceptance: list[float], top: int) -> list[float]:
        """E[N] for gamma 0..``top``: with ``min_rounds_for_start`` drafting rounds seen and position 2
        tested, corrected for how rounds start (``costmodel.expected_tokens_by_start``: the first
        draft is accepted less often right after a rejection, and a larger gamma has more rounds
        that start there); before that, the product of the rates."""
        share = self.counts.full_share()
        tested = len(self.counts.reached) > 2 and self.counts.reached[2] > 0  # position 2 gives p11
        if self.counts.rounds >= self.min_rounds_for_start and tested and share is not None:
            return expected_tokens_by_start(acceptance, share, top)
        return [expected_tokens(g, acceptance=acceptance) if g else 1.0 for g in range(top + 1)]

    def charge(self, batch_size: int, seconds: float, prompts: int = 1) -> None:
        """Speculation's cost outside its rounds: the draft read ``prompts`` new requests' prompts in
        ``seconds``. Plain decoding never pays it, every gamma > 0 does, once per request: it enters
        the rates as ``prompt_seconds_per_token``, a per-request cost over a request's output. Not
        spread over the rounds it happened in: a re-measure after a long stretch at gamma 0 reads the
        prompts of every request admitted since, and charged to its few rounds that would lock
        speculation out for good; nor over all of a bucket's rounds (module docstring)."""
        if prompts > 0 and seconds > 0:
            self.prompt_read_seconds += seconds
            self.prompts_read += prompts

    def finished(self, output_tokens: int) -> None:
        """A request finished (by length or stop, not aborted) with ``output_tokens`` tokens."""
        if output_tokens > 0:
            self.requests_finished += 1
            self.output_tokens += output_tokens

    def prompt_seconds_per_token(self) -> float:
        """The draft's prompt reading per committed token while speculating: the mean seconds of a
        prompt read over the mean output of a finished request. 0 until both are known."""
        if not self.prompts_read or not self.output_tokens:
            return 0.0
        return (self.prompt_read_seconds / self.prompts_read) * (self.requests_finished / self.output_tokens)

    def reads(self, tokens: int, seconds: float) -> None:
        """The draft read ``tokens`` committed tokens (prompts, backlogs) in ``seconds``."""
        if tokens > 0:
            self.read_log.append((tokens, seconds))

    def read_seconds_per_token(self) -> float | None:
        tokens = sum(t for t, _ in self.read_log)
        return sum(s for _, s in self.read_log) / tokens if tokens else None

    def afford(self, batch_size: int, gamma: int, backlog: Backlog) -> int:
        """``gamma``, or 0 where the draft's reads before the round cost more than switching is worth
        (module docstring). Unpriced (no read measured yet) or a first climb: ``gamma``."""
        per_token = self.read_seconds_per_token()
        if not gamma or not backlog.tokens or per_token is None:
            return gamma
        batch_size = self.load(batch_size)
        cost, bucket = backlog.tokens * per_token, self.bucket(batch_size)
        if gamma != self.last_best.get(bucket):
            climbing = (bucket, gamma) not in self.round_seconds and gamma <= self._cap(bucket)
            measuring = 0 < self.samples.get((bucket, gamma), 0) < self.min_samples  # finish what began
            plain_s = self.plain_seconds.get(bucket, 0.0)  # 0: the bucket's last round speculated
            if measuring or not plain_s or cost <= self.switch_budget * plain_s:
                return gamma
            if climbing:  # untried here: at best as good as the nearest smaller bucket's speculation
                gain, plain_rate = self._smaller_gain(bucket), self.predicted_rate(batch_size, 0)
                if gain is None or not plain_rate or backlog.remaining * (1 - 1 / gain) / plain_rate >= cost:
                    return gamma
            return 0
        plain_rate, rate = self.predicted_rate(batch_size, 0), self.predicted_rate(batch_size, gamma)
        if not plain_rate or not rate:
            return gamma
        return gamma if backlog.remaining * (1 / plain_rate - 1 / rate) >= cost else 0

    def load(self, batch_size: int) -> int:
        """The batch size a choice is made for: the largest of the last ``hold_rounds`` rounds (module
        docstring), at least ``batch_size``."""
        return max(batch_size, max(self.recent_sizes, default=0))

    def choose(self, batch_size: int, request: AcceptanceCounts | None = None) -> int:
        self.recent_sizes.append(batch_size)
        batch_size = self.load(batch_size)
        bucket = self.bucket(batch_size)
        count = self.rounds_in_bucket.get(bucket, 0)
        self.rounds_in_bucket[bucket] = count + 1
        run = self._run
        if batch_size == 1 and run is not None and run[0] is request and count < self._follow_until:
            return min(run[1], self.candidates[-1])  # decided to follow this run: re-checked every few rounds
        sampling = [g for g in self.candidates if 0 < self.samples.get((bucket, g), 0) < self.min_samples]
        if sampling:
            return sampling[0]  # judge a candidate on the mean of min_samples rounds, not on one round
        tried = [g for g in self.candidates if (bucket, g) in self.round_seconds]
        if not tried:
            return self.candidates[0]
        rates = self._rates(bucket, batch_size, tried, request, count)
        rate = rates.__getitem__
        best = max(tried, key=rate)
        if best and 0 in tried and rate(best) < (1 + self.margin) * rate(0):
            best = 0  # speculation must clearly beat plain decoding to be chosen
        larger = [g for g in self.candidates if max(tried) < g <= self._cap(bucket)
                  and (bucket, g) not in self.round_seconds]
        if larger and rate(max(tried)) >= (1 - self.climb_tolerance) * rate(best):
            return larger[0]  # climb while the largest tried is the best so far, or nearly
        self.last_best[bucket] = best
        if self.follow_runs and best >= 2 and batch_size == 1 and request is not None:
            self._follow_until = count + self.FOLLOW_CHECK_ROUNDS
            return self._run_depth(request, best)
        key = (bucket, best)
        if key not in self.next_explore:  # a new best: re-measure its neighbours soon
            self.interval[key] = self.explore_every
            self.next_explore[key] = count + self.explore_every
        if count >= self.next_explore[key]:
            # Re-measure a neighbour of the best, backing off (doubling the interval) while it stays
            # the best: a neighbour that keeps losing costs ever fewer rounds.
            interval = self.interval[key]
            self.next_explore[key] = count + 2 * interval
            self.interval[key] = min(2 * interval, self.explore_every * 64)
            self.explorations[key] = self.explorations.get(key, 0) + 1
            index = self.candidates.index(best)
            neighbours = [self.candidates[i] for i in (index - 1, index + 1) if 0 <= i < len(self.candidates)]
            neighbour = neighbours[self.explorations[key] % len(neighbours)]
            # A fresh mean of min_samples rounds replaces its estimate: one round blended into an old
            # average barely moves it, so a neighbour measured slow once stayed slow for good.
            self.samples[(bucket, neighbour)] = 0
            return neighbour
        return best

    def _run_depth(self, request: AcceptanceCounts, best: int) -> int:
        """This request's depth under the run rule (module docstring): ``best`` (the cost model's choice)
        when the request is new, then +``RUN_UP`` after each fully accepted round and -1 after any other."""
        if self._run is None or self._run[0] is not request:
            self._run = (request, best)
        return min(self._run[1], self.candidates[-1])

    def _rates(self, bucket: int, batch_size: int, tried: list[int], request: AcceptanceCounts | None,
               count: int) -> dict[int, float]:
        """Each tried gamma's predicted rate for this bucket and request, recomputed every
        ``RATE_REFRESH_ROUNDS`` of the bucket's rounds, or sooner when the request or the tried gammas
        change. The estimates move by a round's worth of evidence at a time, while recomputing them
        before every round (E[N] per gamma from the blended rates, a rate per gamma) is a measurable
        share of a batch-1 round (``experiments/hot_path_costs.py``, ``pinned4`` in
        ``experiments/policy_variants.py``)."""
        cached = self._rate_cache.get(bucket)
        if cached is not None and cached[0] is request and cached[1] == tried \
                and count - cached[2] < self.RATE_REFRESH_ROUNDS:
            return cached[3]
        tokens = self.expected(self.acceptance(request), max(tried))
        rates = {g: self.predicted_rate(batch_size, g, tokens=tokens[g]) or 0.0 for g in tried}
        self._rate_cache[bucket] = (request, tried, count, rates)
        return rates

    def first_climb_gain(self, batch_size: int) -> float | None:
        """The gain a first climb is offered at ``batch_size``'s load (``_smaller_gain``)."""
        return self._smaller_gain(self.bucket(self.load(batch_size)))

    def _smaller_gain(self, bucket: int) -> float | None:
        """What speculation could gain in ``bucket`` at best, from the smaller buckets already decided
        (their best rate over their plain rate; 1: they chose gamma 0): the nearest one's gain, or, where
        the gain shrank from the second nearest to the nearest (it does as the batch doubles: extra
        verified positions cost relatively more), that shrinking carried one doubling further,
        1 + (g_near - 1)^2 / (g_second - 1). None where no smaller bucket has decided (batch 1).
        Example: buckets 4 and 8 gained 27% and 10%; bucket 16 is offered 1 + 0.1^2 / 0.27, ~3.7%,
        rather than bucket 8's 10%, which would let it climb and pay the draft's reads for rounds
        that lose."""
        smaller = sorted(b for b in self.last_best if b < bucket)
        if not smaller:
            return None
        gains = [self._gain(b) for b in smaller[-2:]]
        near = gains[-1]
        if near is not None and len(gains) == 2 and gains[0] is not None and gains[0] > near > 1:
            return 1 + (near - 1) ** 2 / (gains[0] - 1)
        return near

    def _gain(self, bucket: int) -> float | None:
        best, plain = self.predicted_rate(bucket, self.last_best[bucket]), self.predicted_rate(bucket, 0)
        return best / plain if best and plain else None

    def _cap(self, bucket: int) -> int:
        """The largest gamma worth climbing to in ``bucket``: the best of the nearest smaller bucket
        already decided (extra verified positions cost relatively more as the batch grows), else any."""
        smaller = [b for b in self.last_best if b < bucket]
        return self.last_best[max(smaller)] if smaller else max(self.candidates)

    def observe(self, batch_size: int, gamma: int, seconds: float, accepted_per_row: list[int],
                drafted_per_row: list[int]) -> None:
        """Record one round: its wall time and, per row, accepted and proposed drafts."""
        key = (self.bucket(batch_size), gamma)
        count = self.samples[key] = self.samples.get(key, 0) + 1
        self.plain_seconds[key[0]] = self.plain_seconds.get(key[0], 0.0) + seconds if gamma == 0 else 0.0
        recent = self.recent.get(key)
        if recent is None:
            recent = self.recent[key] = (deque(maxlen=self.window), deque(maxlen=self.window))
        elif count == 1:
            recent[0].clear()  # a fresh measurement replaces what was known
            recent[1].clear()
        recent[0].append(seconds)
        recent[1].append(batch_size)
        self._stale.add(key)
        if self.unmeasured_seeds and key in self.seeds:
            self.unmeasured_seeds.discard(key)
            level = self.round_seconds[key] / self.seeds[key]
            for other in self.unmeasured_seeds:
                self.round_seconds[other] = self.seeds[other] * level
        for accepted, drafted in zip(accepted_per_row, drafted_per_row):
            self.counts.add(accepted, drafted)
        if self._run is not None and batch_size == 1 and gamma and drafted_per_row[0]:
            request, depth = self._run
            full = accepted_per_row[0] == drafted_per_row[0]
            self._run = (request, min(depth + self.RUN_UP, 2 * self.candidates[-1]) if full else max(1, depth - 1))


def _median(values) -> float:
    """``statistics.median`` of a few values, without its generality (taken for every stale estimate)."""
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def make_policy(name: str, gamma: int):
    """``fixed`` | ``adaptive`` | ``hf`` -> a policy object (choose / observe)."""
    if name == "fixed":
        return FixedGamma(gamma)
    if name == "adaptive":
        return AdaptiveGamma(max_gamma=max(gamma, 1))
    if name == "hf":
        return HFHeuristicGamma(initial=gamma)
    raise ValueError(f"unknown gamma policy {name!r}")
