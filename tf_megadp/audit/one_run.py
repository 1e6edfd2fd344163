"""Privacy auditing with one training run (Steinke, Nasr and Jagielski, NeurIPS 2023).

The auditor makes m canaries and flips a fair coin for each: S_i = +1
("in": the canary takes part in training) or -1 ("out"). It trains ONCE,
scores every canary from what training released (higher = "looks in"),
guesses "in" for the k_in highest scores, "out" for the k_out lowest and
abstains on the rest. Of the r = k_in + k_out guesses, v are correct.

If training is (epsilon, delta)-DP with respect to adding or removing one
canary, the paper's Theorem 5.2 bounds how many guesses can be right:

    P[v >= w] <= f(w) + 2 m delta * max_{i = 1..w} (f(w - i) - f(w)) / i,
    f(w) = P[Binomial(r, e^eps / (1 + e^eps)) >= w].

(For delta = 0 the count is stochastically dominated by the binomial: each
guess is at best a randomized response with accuracy e^eps / (1 + e^eps).)
The right-hand side is the p-value of the observed count under the claim
"(epsilon, delta)-DP". The *lower bound* at confidence 1 - beta is the
largest epsilon that the count rejects at level beta: with probability at
least 1 - beta over the coin flips (and the training randomness), the true
epsilon of the run at that delta is at least the reported number.

What the theorem needs, and what this module enforces:

* the coins are independent and fair, and the scoring never sees them: they
  come from OS entropy and stay inside `CanaryCoins` until it scores, once;
* the guess rule (k_in, k_out) is fixed before the scores are seen. Trying
  several rules and keeping the best is a selection that must be paid for:
  `one_run_audit` evaluates a fixed family of rules, each at level
  beta / len(family) (Bonferroni), and reports the best;
* m is the number of canaries, not only those guessed on: the delta term
  grows with m, so an audit with m canaries certifies little beyond about
  log(m / 6) nats however good the attack (perfect guesses on half the
  canaries at 95 %), and needs delta far below 1 / m.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
import warnings
from typing import Any, Mapping, Sequence

import numpy as np
from scipy import stats

from tf_megadp.secret import Secret

__all__ = [
    "CanaryCoins",
    "OneRunResult",
    "default_guesses",
    "guesses_from_scores",
    "one_run_audit",
    "one_run_epsilon_lower_bound",
    "one_run_p_value",
]


def _check_counts(num_canaries: int, num_guesses: int, num_correct: int) -> tuple[int, int, int]:
    values = {"num_canaries": num_canaries, "num_guesses": num_guesses,
              "num_correct": num_correct}
    for name, value in values.items():
        if isinstance(value, bool) or int(value) != value:
            raise ValueError(f"`{name}` must be an integer, got {value!r}.")
    m, r, v = (int(num_canaries), int(num_guesses), int(num_correct))
    if not 0 <= v <= r <= m or m < 1:
        raise ValueError(
            "Need 0 <= num_correct <= num_guesses <= num_canaries and num_canaries >= 1, "
            f"got num_correct={v}, num_guesses={r}, num_canaries={m}."
        )
    return m, r, v


def _check_delta(delta: float) -> float:
    delta = float(delta)
    if not 0.0 <= delta < 1.0:
        raise ValueError(f"`delta` must be in [0, 1), got {delta!r}.")
    return delta


def _check_confidence(confidence: float) -> float:
    confidence = float(confidence)
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"`confidence` must be in (0, 1), got {confidence!r}.")
    return confidence


def _p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    # Accuracy of epsilon-DP randomized response, the most accurate guess an
    # epsilon-DP mechanism allows; expit avoids overflow at large epsilon.
    accuracy = float(1.0 / (1.0 + math.exp(-epsilon))) if epsilon < 700 else 1.0
    tail = float(stats.binom.sf(v - 1, r, accuracy))  # P[Binomial(r, accuracy) >= v]
    if delta == 0.0 or v == 0:
        return min(tail, 1.0)
    # f(v - i) - f(v) = P[v - i <= Binomial < v] = sum_{j=1..i} pmf(v - j).
    below = stats.binom.pmf(np.arange(v - 1, -1, -1), r, accuracy)
    ratio = float(np.max(np.cumsum(below) / np.arange(1, v + 1)))
    return min(tail + 2.0 * m * delta * ratio, 1.0)


def one_run_p_value(
    num_canaries: int,
    num_guesses: int,
    num_correct: int,
    epsilon: float,
    delta: float = 0.0,
) -> float:
    """Probability of at least `num_correct` right guesses if training were (epsilon, delta)-DP.

    The bound of Steinke, Nasr and Jagielski (2023, Theorem 5.2) on
    P[correct >= v] for any attack that makes `num_guesses` guesses about
    `num_canaries` canaries with independent fair inclusion coins.

    Args:
        num_canaries: m, all canaries (guessed on or not).
        num_guesses: r, guesses made (the rest abstain).
        num_correct: v, guesses that were right.
        epsilon: the epsilon of the claim under test (nats, >= 0).
        delta: the delta of the claim.

    Returns:
        The p-value, in [0, 1].

    Example:
    ```python
    one_run_p_value(1000, 100, 100, epsilon=2.0)   # 0.88^100 ~ 3e-6: rejects epsilon 2
    ```
    """
    m, r, v = _check_counts(num_canaries, num_guesses, num_correct)
    epsilon = float(epsilon)
    if not epsilon >= 0.0:
        raise ValueError(f"`epsilon` must be >= 0, got {epsilon!r}.")
    return _p_value(m, r, v, epsilon, _check_delta(delta))


def one_run_epsilon_lower_bound(
    num_canaries: int,
    num_guesses: int,
    num_correct: int,
    *,
    delta: float = 0.0,
    confidence: float = 0.95,
) -> float:
    """The largest epsilon that `num_correct` of `num_guesses` right guesses rejects.

    With probability at least `confidence`, a run that is (epsilon, delta)-DP
    for the canaries does not produce a count that rejects its epsilon; so the
    returned number is a lower bound on the run's epsilon at `delta`.
    Rejecting epsilon also rejects every smaller epsilon (a smaller-epsilon
    guarantee implies the larger), so the bound is the edge of the rejected
    region, found by bisection to 1e-6.

    Args:
        num_canaries: m.
        num_guesses: r.
        num_correct: v.
        delta: the delta the bound is stated for.
        confidence: 1 - the test's level.

    Returns:
        The lower bound in nats (0.0 when not even epsilon = 0 is rejected).

    Example:
    ```python
    one_run_epsilon_lower_bound(1000, 100, 100)            # 3.49
    one_run_epsilon_lower_bound(1000, 100, 70)             # 0.47
    ```
    """
    m, r, v = _check_counts(num_canaries, num_guesses, num_correct)
    delta = _check_delta(delta)
    level = 1.0 - _check_confidence(confidence)
    if _p_value(m, r, v, 0.0, delta) >= level:
        return 0.0
    low, high = 0.0, 1.0
    while _p_value(m, r, v, high, delta) < level:
        low, high = high, 2.0 * high
        if high > 1e4:  # Unreachable: the accuracy rounds to 1 (p-value 1) near 37 nats.
            return low
    while high - low > 1e-6:
        middle = 0.5 * (low + high)
        if _p_value(m, r, v, middle, delta) < level:
            low = middle
        else:
            high = middle
    return low


def guesses_from_scores(scores: Sequence[float] | np.ndarray, k_in: int, k_out: int = 0) -> np.ndarray:
    """Guesses +1 ("in") for the k_in highest scores, -1 for the k_out lowest, else 0.

    Ties are broken by canary index (a stable sort), an order fixed before
    the coins were flipped, so they cannot favour either answer.

    Args:
        scores: one finite score per canary, higher meaning "looks included".
        k_in: number of "in" guesses.
        k_out: number of "out" guesses.

    Returns:
        int8 array of the guesses, one per canary.

    Example:
    ```python
    guesses_from_scores([0.3, 2.0, -1.0, 0.9], k_in=1, k_out=1)   # [0, 1, -1, 0]
    ```
    """
    scores = _as_scores(scores)
    k_in, k_out = int(k_in), int(k_out)
    if k_in < 0 or k_out < 0 or k_in + k_out > scores.size:
        raise ValueError(
            f"Need k_in, k_out >= 0 and k_in + k_out <= {scores.size} canaries, got "
            f"k_in={k_in}, k_out={k_out}."
        )
    order = np.argsort(-scores, kind="stable")
    guesses = np.zeros(scores.size, np.int8)
    guesses[order[:k_in]] = 1
    if k_out:
        guesses[order[scores.size - k_out:]] = -1
    return guesses


def _as_scores(scores) -> np.ndarray:
    scores = np.asarray(scores, dtype=np.float64).reshape(-1)
    if scores.size < 1 or not np.all(np.isfinite(scores)):
        raise ValueError(
            f"`scores` must hold one finite score per canary, got {scores.size} "
            f"({int(np.isfinite(scores).sum())} finite)."
        )
    return scores


def default_guesses(num_canaries: int) -> tuple[tuple[int, int], ...]:
    """The family of (k_in, k_out) rules `one_run_audit` tries by default.

    Only "in" guesses, for the top 0.2 %, 0.5 %, 1 %, 2 %, 5 %, 10 %, 20 % and
    30 % of the canaries: in DP-SGD with sampling, an included canary that is
    rarely sampled looks excluded, so confident guesses are at the top.

    Args:
        num_canaries: m.

    Returns:
        The distinct rules, smallest first.
    """
    fractions = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3)
    return tuple(sorted({(max(1, int(round(f * num_canaries))), 0) for f in fractions}))


@dataclasses.dataclass(frozen=True)
class OneRunResult:
    """The outcome of a one-run audit.

    Attributes:
        epsilon_lower_bound: the bound (nats) at `delta`, holding with
            probability `confidence` for the whole family of guess rules.
        delta: the delta it is stated for.
        confidence: its confidence.
        num_canaries: m.
        num_included: canaries whose coin said "in".
        k_in, k_out: the rule that gave the bound.
        num_guesses: r = k_in + k_out of that rule.
        num_correct: v of that rule.
        rules: for every rule tried, (k_in, k_out, correct, bound at the
            Bonferroni level).
        seeded: the coins came from an explicit seed: whoever knows it knows
            the answers, so the bound certifies nothing against them.
        kind: what was audited (e.g. "white-box gradient canaries").
        scores: the canaries' scores (functions of what training released).
    """

    epsilon_lower_bound: float
    delta: float
    confidence: float
    num_canaries: int
    num_included: int
    k_in: int
    k_out: int
    num_guesses: int
    num_correct: int
    rules: tuple
    seeded: bool = False
    kind: str = ""
    scores: tuple = ()

    def as_dict(self, *, with_scores: bool = False) -> dict[str, Any]:
        """A JSON-ready dict (per-canary scores only on request)."""
        result = dataclasses.asdict(self)
        result["rules"] = [list(rule) for rule in self.rules]
        if not with_scores:
            result.pop("scores")
        else:
            result["scores"] = list(self.scores)
        return result


def one_run_audit(
    scores: Sequence[float] | np.ndarray,
    included: Sequence[bool] | np.ndarray,
    *,
    delta: float,
    confidence: float = 0.95,
    guesses: Sequence[tuple[int, int]] | None = None,
    kind: str = "",
    seeded: bool = False,
) -> OneRunResult:
    """Scores the guesses of a fixed family of rules against the coins.

    Each rule (k_in, k_out) guesses from `scores` (see
    `guesses_from_scores`); its bound is computed at level
    (1 - confidence) / len(guesses), so that all of them hold together and
    the best may be reported.

    Prefer `CanaryCoins.score`, which keeps the coins secret until this
    point; this function is for coins managed elsewhere.

    Args:
        scores: one score per canary (higher = "looks included").
        included: the coins, True where the canary was included.
        delta: the delta of the claim the bound is set against.
        confidence: the bound's confidence.
        guesses: the family of (k_in, k_out) rules, fixed in advance;
            default `default_guesses(m)`.
        kind: a label carried into the result.
        seeded: carried into the result (see `OneRunResult`).

    Returns:
        A `OneRunResult`.

    Example:
    ```python
    rng = np.random.default_rng(0)
    included = rng.random(1000) < 0.5
    scores = rng.normal(size=1000) + 3.0 * included
    one_run_audit(scores, included, delta=1e-6).epsilon_lower_bound   # about 3.7
    ```
    """
    scores = _as_scores(scores)
    included = np.asarray(included).reshape(-1)
    if included.shape != scores.shape or included.dtype != bool:
        raise ValueError(
            f"`included` must be a boolean array with one entry per score ({scores.size}), "
            f"got dtype {included.dtype} and shape {included.shape}."
        )
    delta = _check_delta(delta)
    confidence = _check_confidence(confidence)
    m = scores.size
    rules = tuple((int(a), int(b)) for a, b in (guesses or default_guesses(m)))
    if not rules:
        raise ValueError("`guesses` must name at least one (k_in, k_out) rule.")
    per_rule = 1.0 - (1.0 - confidence) / len(rules)
    truth = np.where(included, 1, -1)
    evaluated = []
    for k_in, k_out in rules:
        guess = guesses_from_scores(scores, k_in, k_out)
        correct = int(np.sum(guess == truth))  # abstentions (0) never match +-1
        bound = one_run_epsilon_lower_bound(
            m, k_in + k_out, correct, delta=delta, confidence=per_rule)
        evaluated.append((k_in, k_out, correct, bound))
    best = max(evaluated, key=lambda rule: rule[3])
    return OneRunResult(
        epsilon_lower_bound=best[3],
        delta=delta,
        confidence=confidence,
        num_canaries=m,
        num_included=int(included.sum()),
        k_in=best[0],
        k_out=best[1],
        num_guesses=best[0] + best[1],
        num_correct=best[2],
        rules=tuple(evaluated),
        seeded=seeded,
        kind=kind,
        scores=tuple(float(s) for s in scores),
    )


class CanaryCoins:
    """The auditor's secret fair coins, one per canary, revealed only to score.

    The coins come from OS entropy (128 bits; `seed=` makes them
    reproducible for tests and warns). Code that builds the audited run
    (the canary injection, the training set) reads them through
    `_included()`; nothing else can see them before `score`: they are not in
    the repr, cannot be pickled or copied, and `reveal()` refuses until the
    audit has been scored. `score` runs once: scoring the same coins with a
    second attack would be a second look that the confidence does not cover.

    Args:
        num_canaries: m >= 1.
        seed: None (OS entropy) or an int for reproducible, NOT secret coins.

    Example:
    ```python
    coins = CanaryCoins(1000)
    ...  # train with the canaries coins._included() selects
    result = coins.score(scores, delta=1e-6)
    result.epsilon_lower_bound
    ```
    """

    def __init__(self, num_canaries: int, *, seed: int | None = None):
        if isinstance(num_canaries, bool) or int(num_canaries) != num_canaries or num_canaries < 1:
            raise ValueError(f"`num_canaries` must be an integer >= 1, got {num_canaries!r}.")
        if seed is not None:
            if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
                raise ValueError(f"`seed` must be None or a non-negative int, got {seed!r}.")
            warnings.warn(
                f"CanaryCoins(seed={seed}): whoever knows the seed knows which canaries "
                "were included, so the audit's bound certifies nothing against them. "
                "Use seed=None (OS entropy) for an audit you report.",
                UserWarning,
                stacklevel=2,
            )
        self.num_canaries = int(num_canaries)
        self.seeded = seed is not None
        self._scored = False
        entropy = secrets.randbits(128) if seed is None else seed
        # Like the samplers' randomness: in a holder that no vars(), repr or
        # pickle shows.
        self._coins = Secret(np.random.default_rng(entropy).random(self.num_canaries) < 0.5)

    def _included(self) -> np.ndarray:
        """The coins, for the code that builds the audited run (a copy)."""
        return self._coins.value.copy()

    @property
    def scored(self) -> bool:
        """Whether `score` has run (the coins are then revealed)."""
        return self._scored

    def reveal(self) -> np.ndarray:
        """The coins (True = included), once the audit has been scored.

        Raises:
            RuntimeError: before `score`.
        """
        if not self._scored:
            raise RuntimeError(
                "The coins stay secret until the audit is scored: call score(scores) "
                "first. Guesses made after seeing the coins would not be a test."
            )
        return self._coins.value.copy()

    def score(
        self,
        scores: Sequence[float] | np.ndarray,
        *,
        delta: float,
        confidence: float = 0.95,
        guesses: Sequence[tuple[int, int]] | None = None,
        kind: str = "",
    ) -> OneRunResult:
        """Turns the attack's scores into the lower bound (once).

        Args:
            scores: one score per canary, computed from what training
                released, higher = "looks included".
            delta: the delta of the claim (e.g. the run's delta).
            confidence: the bound's confidence.
            guesses: the family of (k_in, k_out) rules, fixed in advance.
            kind: a label for the result.

        Returns:
            A `OneRunResult`.

        Raises:
            RuntimeError: the coins were already scored.
        """
        if self._scored:
            raise RuntimeError(
                "These coins were already scored. A second attack on the same run is a "
                "second test, which the stated confidence does not cover; audit another "
                "run with fresh coins."
            )
        scores = _as_scores(scores)
        if scores.size != self.num_canaries:
            raise ValueError(
                f"Got {scores.size} scores for {self.num_canaries} canaries.")
        result = one_run_audit(
            scores, self._coins.value, delta=delta, confidence=confidence, guesses=guesses,
            kind=kind, seeded=self.seeded)
        self._scored = True
        return result

    def score_attacks(
        self,
        attacks: Mapping[str, Sequence[float] | np.ndarray],
        *,
        delta: float,
        confidence: float = 0.95,
        guesses: Sequence[tuple[int, int]] | None = None,
        kind: str = "",
    ) -> dict[str, OneRunResult]:
        """Scores several attacks on the same canaries (once), all bounds holding together.

        Each attack is a second look at the same coins, so each gets level
        (1 - confidence) / len(attacks) (Bonferroni): every reported bound,
        and so their maximum, holds with probability `confidence`.

        Args:
            attacks: name -> one score per canary (e.g. {"white_box": ...,
                "black_box": ...}).
            delta: the delta of the claim.
            confidence: the joint confidence.
            guesses: the (k_in, k_out) rules of every attack.
            kind: a label prefix for the results.

        Returns:
            name -> `OneRunResult` (each stating the joint `confidence`).

        Raises:
            RuntimeError: the coins were already scored.
        """
        if self._scored:
            raise RuntimeError("These coins were already scored; audit another run with fresh coins.")
        if not attacks:
            raise ValueError("`attacks` must name at least one attack.")
        confidence = _check_confidence(confidence)
        per_attack = 1.0 - (1.0 - confidence) / len(attacks)
        results = {}
        for name, scores in attacks.items():
            scores = _as_scores(scores)
            if scores.size != self.num_canaries:
                raise ValueError(
                    f"Attack {name!r} gave {scores.size} scores for {self.num_canaries} canaries.")
            result = one_run_audit(
                scores, self._coins.value, delta=delta, confidence=per_attack, guesses=guesses,
                kind=f"{kind}{name}", seeded=self.seeded)
            results[name] = dataclasses.replace(result, confidence=confidence)
        self._scored = True
        return results

    def __repr__(self) -> str:
        secrecy = "seeded (not secret)" if self.seeded else "secret"
        state = "scored" if self._scored else "not scored"
        return f"<CanaryCoins: {self.num_canaries} canaries, {secrecy}, {state}>"

    def __reduce_ex__(self, protocol):
        raise TypeError(
            "CanaryCoins hold the audit's secret answers and cannot be pickled or copied."
        )
