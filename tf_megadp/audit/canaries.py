"""Secret-sharer canaries and their exposure (Carlini et al., USENIX Security 2019).

A canary is a sequence of a fixed format with random secret slots, e.g.
"my pin is D D D D" where each D is a digit token. Canaries are inserted into
the training corpus r times each; after training, the model's score of the
true secret is ranked among all candidate secrets of the same format. The
exposure of a canary is

    exposure = log2 |R| - log2 rank,

where |R| is the number of candidate secrets and rank is 1 for the most
likely candidate. A canary the model has not memorized has expected exposure
about 1 / ln 2 = 1.44 bits; exposure near log2 |R| means the model singles out
the secret, i.e. it could be extracted.

Ranks count ties against the secret (rank = 1 + number of other candidates
scoring >= the secret), so a model that scores everything equally gets
exposure 0, never a spurious high one.

When |R| is small enough to enumerate (`max_enumerate`), the rank is exact.
Otherwise `num_candidates` other candidates are drawn uniformly with
replacement from R \\ {secret}; with k of them scoring >= the secret, the
rank estimate is 1 + (k / num_candidates) * (|R| - 1), an unbiased estimate
of the rank, and "exposure_lower" replaces k / num_candidates by its
Clopper-Pearson upper bound at `confidence`. Sampling cannot resolve exposure
much beyond log2(num_candidates): when k = 0 the point estimate is the maximum
log2 |R|, so cite "exposure_lower" for sampled ranks. To see further into the
tail, "exposure_extrapolated" follows Carlini et al.: fit a skew-normal
distribution to the sampled candidates' scores and read the fraction of the
space scoring >= the secret off its tail. It is a model-based approximation,
not a bound.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Callable, Iterable, Sequence

import numpy as np
from scipy import stats

from tf_megadp.audit.empirical import clopper_pearson
from tf_megadp.files import write_json_atomically

__all__ = [
    "CanaryFormat",
    "Canary",
    "make_canaries",
    "insert_canaries",
    "save_canaries",
    "load_canaries",
    "exposure",
    "canary_exposure",
]

ScoreFn = Callable[[np.ndarray], np.ndarray]


@dataclasses.dataclass(frozen=True)
class CanaryFormat:
    """The token template of a family of canaries.

    Args:
        template: token ids of the canary sequence, with None at each secret
            slot, e.g. `[cls, my, pin, is, None, None, None, None, sep]`.
        alphabet: the token ids a secret slot can take (e.g. the ten digit
            tokens); every slot draws from the same alphabet.

    Example:
    ```python
    fmt = CanaryFormat(template=[2, 40, 41, None, None, 3], alphabet=range(10, 20))
    fmt.space_size                 # 100
    fmt.fill((12, 19))             # array([ 2, 40, 41, 12, 19,  3])
    ```
    """

    template: tuple
    alphabet: tuple

    def __init__(self, template: Sequence[int | None], alphabet: Iterable[int]):
        template = tuple(None if t is None else int(t) for t in template)
        alphabet = tuple(int(a) for a in alphabet)
        if None not in template:
            raise ValueError(
                "`template` needs at least one secret slot: put None where the "
                "secret tokens go."
            )
        if any(t is not None and t < 0 for t in template):
            raise ValueError(f"Token ids in `template` must be >= 0, got {template}.")
        if len(alphabet) < 2 or len(set(alphabet)) != len(alphabet):
            raise ValueError(
                "`alphabet` must hold at least two distinct token ids, got "
                f"{alphabet}."
            )
        if min(alphabet) < 0:
            raise ValueError(f"Token ids in `alphabet` must be >= 0, got {alphabet}.")
        object.__setattr__(self, "template", template)
        object.__setattr__(self, "alphabet", alphabet)

    @classmethod
    def from_vocabulary(
        cls,
        template: Sequence[str | None],
        alphabet: Iterable[str],
        vocabulary: Sequence[str],
    ) -> "CanaryFormat":
        """A format written in tokens of a vocabulary (a list, index = token id).

        Args:
            template: token strings, None at each secret slot, e.g.
                `["[CLS]", "my", "pin", "is", None, None, None, None, "[SEP]"]`.
            alphabet: the token strings a slot can take, e.g. "0" .. "9".
            vocabulary: the model's vocabulary.

        Returns:
            The `CanaryFormat` with token ids.
        """
        ids = {token: index for index, token in enumerate(vocabulary)}
        alphabet = list(alphabet)
        missing = [t for t in [*template, *alphabet] if t is not None and t not in ids]
        if missing:
            raise ValueError(
                f"Tokens {sorted(set(missing))} are not in the vocabulary: choose "
                "canary words the vocabulary has as whole tokens."
            )
        return cls(
            [None if t is None else ids[t] for t in template], [ids[t] for t in alphabet]
        )

    @property
    def secret_positions(self) -> tuple[int, ...]:
        """Indices of the secret slots in the sequence."""
        return tuple(i for i, t in enumerate(self.template) if t is None)

    @property
    def length(self) -> int:
        return len(self.template)

    @property
    def space_size(self) -> int:
        """|R|: the number of candidate secrets (a Python int, may be huge)."""
        return len(self.alphabet) ** len(self.secret_positions)

    def fill(self, secrets: Sequence[int] | np.ndarray) -> np.ndarray:
        """Token sequences with the given secrets in the slots.

        Args:
            secrets: token ids, shape [num_slots] or [n, num_slots].

        Returns:
            int32 array of shape [length] or [n, length].
        """
        secrets = np.asarray(secrets, dtype=np.int64)
        single = secrets.ndim == 1
        secrets = np.atleast_2d(secrets)
        slots = self.secret_positions
        if secrets.ndim != 2 or secrets.shape[1] != len(slots):
            raise ValueError(
                f"Secrets must have {len(slots)} tokens each, got shape {secrets.shape}."
            )
        if not np.all(np.isin(secrets, self.alphabet)):
            raise ValueError("Every secret token must come from the format's alphabet.")
        base = np.array([0 if t is None else t for t in self.template], dtype=np.int32)
        sequences = np.tile(base, (secrets.shape[0], 1))
        sequences[:, list(slots)] = secrets
        return sequences[0] if single else sequences

    def all_secrets(self) -> np.ndarray:
        """Every candidate secret, shape [space_size, num_slots] (small spaces only)."""
        digits = np.unravel_index(
            np.arange(self.space_size), (len(self.alphabet),) * len(self.secret_positions)
        )
        return np.asarray(self.alphabet, dtype=np.int64)[np.stack(digits, axis=1)]

    def sample_secrets(self, rng: np.random.Generator, num: int) -> np.ndarray:
        """`num` secrets drawn uniformly with replacement, shape [num, num_slots]."""
        index = rng.integers(0, len(self.alphabet), size=(num, len(self.secret_positions)))
        return np.asarray(self.alphabet, dtype=np.int64)[index]


@dataclasses.dataclass(frozen=True)
class Canary:
    """One secret in a format, and how often it was put into the corpus.

    Args:
        format: the `CanaryFormat`.
        secret: the secret's token ids, one per slot.
        repetitions: copies inserted into the training corpus; 0 marks a
            control canary that is never inserted (its exposure is the
            baseline of an unmemorized secret).
    """

    format: CanaryFormat
    secret: tuple
    repetitions: int

    @property
    def token_ids(self) -> np.ndarray:
        return self.format.fill(self.secret)


def make_canaries(
    canary_format: CanaryFormat,
    *,
    repetitions: Sequence[int] = (1, 4, 16),
    canaries_per_repetition: int = 10,
    num_controls: int = 0,
    seed: int | None = None,
) -> list[Canary]:
    """Random canaries with distinct secrets.

    Args:
        canary_format: the format all canaries share.
        repetitions: insertion counts; `canaries_per_repetition` canaries are
            made for each.
        canaries_per_repetition: canaries per insertion count.
        num_controls: extra canaries with repetitions=0 (never inserted).
        seed: seed of the secret draw; None draws from OS entropy.

    Returns:
        The canaries, grouped by repetition count, controls last.

    Example:
    ```python
    canaries = make_canaries(fmt, repetitions=(1, 4, 16), canaries_per_repetition=5,
                             num_controls=5, seed=0)
    ```
    """
    counts = [int(r) for r in repetitions]
    if any(r < 1 for r in counts):
        raise ValueError(
            f"`repetitions` must be positive (use num_controls for 0), got {counts}."
        )
    if canaries_per_repetition < 1 or num_controls < 0:
        raise ValueError(
            "Need canaries_per_repetition >= 1 and num_controls >= 0, got "
            f"{canaries_per_repetition} and {num_controls}."
        )
    plan = [r for r in counts for _ in range(canaries_per_repetition)]
    plan += [0] * num_controls
    if len(plan) > canary_format.space_size // 2:
        raise ValueError(
            f"{len(plan)} distinct secrets requested from a space of "
            f"{canary_format.space_size}: add secret slots or alphabet tokens."
        )
    rng = np.random.default_rng(seed)
    secrets: list[tuple] = []
    seen = set()
    while len(secrets) < len(plan):
        secret = tuple(int(t) for t in canary_format.sample_secrets(rng, 1)[0])
        if secret not in seen:
            seen.add(secret)
            secrets.append(secret)
    return [Canary(canary_format, s, r) for s, r in zip(secrets, plan)]


def insert_canaries(
    token_ids: np.ndarray,
    canaries: Sequence[Canary],
    *,
    pad_token_id: int = 0,
    seed: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """A corpus of packed sequences with every canary added r times.

    Each copy is its own row (one privacy unit), padded with `pad_token_id` to
    the corpus width, at a uniformly random position among the original rows.

    Args:
        token_ids: the corpus, int array [num_sequences, sequence_length].
        canaries: canaries to insert; controls (repetitions=0) are skipped.
        pad_token_id: padding token for canaries shorter than the rows.
        seed: seed of the insertion positions; None draws from OS entropy.

    Returns:
        (new_token_ids, canary_index): the enlarged corpus, and for each of its
        rows the index into `canaries` of the canary it holds, or -1.

    Example:
    ```python
    corpus, which = insert_canaries(corpus, canaries, seed=0)
    ```
    """
    token_ids = np.asarray(token_ids)
    if token_ids.ndim != 2 or not np.issubdtype(token_ids.dtype, np.integer):
        raise ValueError(
            "`token_ids` must be an integer array [num_sequences, sequence_length], "
            f"got dtype {token_ids.dtype} and shape {token_ids.shape}."
        )
    width = token_ids.shape[1]
    rows, owners = [], []
    for index, canary in enumerate(canaries):
        if canary.format.length > width:
            raise ValueError(
                f"Canary of length {canary.format.length} does not fit rows of "
                f"length {width}: shorten the template or pack longer sequences."
            )
        row = np.full(width, pad_token_id, dtype=token_ids.dtype)
        row[: canary.format.length] = canary.token_ids
        rows += [row] * canary.repetitions
        owners += [index] * canary.repetitions
    total = token_ids.shape[0] + len(rows)
    rng = np.random.default_rng(seed)
    canary_rows = np.sort(rng.choice(total, size=len(rows), replace=False))
    is_canary = np.zeros(total, dtype=bool)
    is_canary[canary_rows] = True
    result = np.empty((total, width), dtype=token_ids.dtype)
    canary_index = np.full(total, -1, dtype=np.int64)
    result[~is_canary] = token_ids
    if rows:
        # Shuffle which copy lands where so copies of one canary are not adjacent.
        order = rng.permutation(len(rows))
        result[canary_rows] = np.stack(rows)[order]
        canary_index[canary_rows] = np.asarray(owners)[order]
    return result, canary_index


def save_canaries(path: str | os.PathLike, canaries: Sequence[Canary]) -> None:
    """Writes canaries (formats, secrets, repetitions) to a JSON file, atomically.

    The training job saves what it inserted; the audit reloads it with
    `load_canaries`. The file holds the secrets: keep it with the model, not
    with anything published.

    Args:
        path: destination file.
        canaries: the canaries, controls included.
    """
    payload = {
        "canaries": [
            {
                "template": list(c.format.template),
                "alphabet": list(c.format.alphabet),
                "secret": list(c.secret),
                "repetitions": c.repetitions,
            }
            for c in canaries
        ]
    }
    write_json_atomically(path, payload)


def load_canaries(path: str | os.PathLike) -> list[Canary]:
    """Reads canaries written by `save_canaries`.

    Args:
        path: the JSON file.

    Returns:
        The canaries, in the saved order.
    """
    with open(path) as stream:
        payload = json.load(stream)
    try:
        entries = payload["canaries"]
        formats: dict[tuple, CanaryFormat] = {}
        canaries = []
        for entry in entries:
            key = (tuple(entry["template"]), tuple(entry["alphabet"]))
            if key not in formats:
                formats[key] = CanaryFormat(*key)
            canary_format = formats[key]
            secret = tuple(int(t) for t in entry["secret"])
            if len(secret) != len(canary_format.secret_positions) or not set(
                secret
            ) <= set(canary_format.alphabet):
                raise ValueError(f"secret {secret} does not fit its format")
            repetitions = int(entry["repetitions"])
            if repetitions < 0:
                raise ValueError(f"negative repetitions {repetitions}")
            canaries.append(Canary(canary_format, secret, repetitions))
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(
            f"{path} is not a canary file written by save_canaries: {error}"
        ) from error
    return canaries


def exposure(rank: float, space_size: int) -> float:
    """Exposure in bits: log2(space_size) - log2(rank).

    Args:
        rank: rank of the secret among all candidates, 1 <= rank <= space_size
            (may be fractional when estimated).
        space_size: number of candidates |R|.

    Returns:
        The exposure, between 0 and log2(space_size).
    """
    if space_size < 1 or not 1 <= rank <= space_size:
        raise ValueError(
            f"Need 1 <= rank <= space_size, got rank={rank!r}, space_size={space_size!r}."
        )
    return math.log2(space_size) - math.log2(rank)


def _scores(score_fn: ScoreFn, sequences: np.ndarray) -> np.ndarray:
    scores = np.asarray(score_fn(sequences), dtype=np.float64).reshape(-1)
    if scores.shape[0] != sequences.shape[0] or not np.all(np.isfinite(scores)):
        raise ValueError(
            f"`score_fn` must return one finite score per sequence: got {scores.size} "
            f"scores for {sequences.shape[0]} sequences."
        )
    return scores


def _extrapolated_exposure(secret_score, other_scores, space) -> float:
    """Exposure from a skew-normal fit of the candidates' score distribution."""
    if np.ptp(other_scores) == 0:
        # No spread to fit: the empirical fraction is all there is.
        tail = float(np.mean(other_scores >= secret_score))
    else:
        tail = float(stats.skewnorm.sf(secret_score, *stats.skewnorm.fit(other_scores)))
    return exposure(_estimated_rank(tail, space), space)


def _estimated_rank(fraction: float, space: int) -> float:
    """1 + fraction * (|R| - 1), kept <= |R| despite float rounding of huge |R|."""
    return min(1.0 + fraction * (space - 1), space)


def canary_exposure(
    canary: Canary,
    score_fn: ScoreFn,
    *,
    num_candidates: int | None = None,
    max_enumerate: int = 65536,
    confidence: float = 0.95,
    extrapolate: bool = True,
    seed: int | None = None,
) -> dict:
    """Exposure of one canary under a scoring function.

    Args:
        canary: the canary.
        score_fn: maps int token sequences [n, length] to scores [n], higher
            meaning more likely under the model (e.g. a log-likelihood from
            `MaskedLMScorer.secret_score_fn`).
        num_candidates: sample this many other candidates instead of
            enumerating; None enumerates when the space has at most
            `max_enumerate` candidates and fails otherwise.
        max_enumerate: largest space enumerated when num_candidates is None.
        confidence: confidence of "exposure_lower" for sampled ranks.
        extrapolate: fit the skew-normal tail for sampled ranks (about 0.1 s
            per canary); when False, "exposure_extrapolated" is None.
        seed: seed of the candidate draw.

    Returns:
        A dict with "exposure", "exposure_lower" and "exposure_extrapolated"
        (both equal to "exposure" when exact), "rank", "space_size", "exact",
        "repetitions" and "secret_score".
    """
    fmt = canary.format
    space = fmt.space_size
    secret = np.asarray(canary.secret, dtype=np.int64)
    if num_candidates is None:
        if space > max_enumerate:
            raise ValueError(
                f"The canary space has {space} candidates, more than max_enumerate="
                f"{max_enumerate}: pass num_candidates to estimate the rank by sampling."
            )
        candidates = fmt.all_secrets()
        others = candidates[np.any(candidates != secret, axis=1)]
    else:
        if num_candidates < 1:
            raise ValueError(f"`num_candidates` must be >= 1, got {num_candidates}.")
        rng = np.random.default_rng(seed)
        others = fmt.sample_secrets(rng, num_candidates)
        # Redraw the (rare) copies of the secret so all draws come from R \ {secret}.
        while True:
            hits = np.all(others == secret, axis=1)
            if not hits.any():
                break
            others[hits] = fmt.sample_secrets(rng, int(hits.sum()))
    scores = _scores(score_fn, fmt.fill(np.concatenate([secret[None], others])))
    secret_score, other_scores = scores[0], scores[1:]
    at_least = int(np.sum(other_scores >= secret_score))
    if num_candidates is None:
        rank = 1.0 + at_least
        value = lower = exposure(rank, space)
    else:
        fraction_hi = clopper_pearson(
            at_least, num_candidates, confidence=confidence, side="upper"
        )
        rank = _estimated_rank(at_least / num_candidates, space)
        value = exposure(rank, space)
        lower = exposure(_estimated_rank(fraction_hi, space), space)
        extrapolated = (
            _extrapolated_exposure(secret_score, other_scores, space)
            if extrapolate
            else None
        )
    return {
        "exposure": value,
        "exposure_lower": lower,
        "exposure_extrapolated": value if num_candidates is None else extrapolated,
        "rank": rank,
        "space_size": space,
        "exact": num_candidates is None,
        "repetitions": canary.repetitions,
        "secret_score": float(secret_score),
    }
