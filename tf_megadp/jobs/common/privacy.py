"""The privacy section of every job's settings, and how a run plans it.

Each job's settings (`tf_megadp.jobs.bert.config.PretrainConfig`,
`tf_megadp.jobs.finetune.config.FinetuneConfig`) is a dataclass that
inherits `PrivacySettings`: the same fields, the same checks, the same
names in flags, files and reports. `plan_privacy` turns them and the run's
schedule into (sigma, delta, planned epsilon), composing the ledger of a
release the run continues first; `new_dp_optimizer` builds the run's
`DPOptimizer` from them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from tf_megadp.accounting import accountant_names
from tf_megadp.accounting.noise import default_noise, noise_class, noise_kinds
from tf_megadp.jobs.common.errors import JobError

__all__ = ["NOISES", "PER_EXAMPLE_SCALINGS", "PrivacySettings", "check_privacy_unit",
           "default_delta", "new_dp_optimizer", "plan_privacy"]

# DPOptimizer's per_example_scaling.
PER_EXAMPLE_SCALINGS = ("clip", "automatic")
# The noise a job can ask for besides the default (DP-SGD's): every
# registered mechanism, each trained with the sampling its accounting has a
# proof for (docs/privacy.md, "Correlated noise").
NOISES = tuple(kind for kind in noise_kinds() if kind != default_noise().kind)
# `bands` that asks for the mechanism's automatic choice (`with_chosen_noise`).
AUTO = "auto"
_NUMBERS = ("delta", "target_epsilon", "noise_multiplier", "l2_norm_clip",
            "max_truncation_probability", "automatic_scaling_stability",
            "adaptive_clipping_quantile", "adaptive_clipping_learning_rate",
            "adaptive_clipping_count_stddev")


def default_delta(num_examples: int) -> float:
    """A job's delta when none is given: 1 / N^1.1, below 1/N."""
    return 1.0 / num_examples**1.1


@dataclasses.dataclass
class PrivacySettings:
    """What a private run spends and how it clips, the same in every job.

    Args:
        target_epsilon: calibrate sigma to spend exactly this (at `delta`);
            each job sets its default.
        noise_multiplier: sigma, instead of target_epsilon.
        delta: default 1 / N^1.1 for N privacy units (`default_delta`).
        l2_norm_clip: C.
        per_example_scaling: "clip" (flat clipping) or "automatic"
            (normalized clipping, Bu et al. 2022: every per-example gradient
            scaled by C / (||g|| + gamma)); DPOptimizer's option.
        automatic_scaling_stability: gamma of automatic clipping.
        adaptive_clipping_quantile: None (C stays `l2_norm_clip`), or the
            target quantile of adaptive clipping (Andrew et al. 2021;
            `tf_megadp.AdaptiveClipping`): `l2_norm_clip` is the initial C,
            moved after every logical step towards that quantile of the
            per-example norms, within the same epsilon.
        adaptive_clipping_learning_rate: eta of adaptive clipping's update.
        adaptive_clipping_count_stddev: the noise std of its count (None:
            the expected batch / 20).
        accountant: a registered accountant (`accountant_names()`): "pld"
            (tighter) or "rdp" (faster).
        non_private: the baseline: same data, model and optimizer, plain
            Keras step (no clipping, no noise).
        clipping: DPOptimizer's per-example strategy ("auto", "ghost" or
            "vectorized").
        noise: None (independent noise, DP-SGD) or a registered noise
            mechanism's kind (`NOISES`: `tf_megadp.accounting.noise`), trained
            with the sampling its accounting has a proof for
            (`NoiseMechanism.accounted_sampling`).
        bands: the mechanism's one parameter (`NoiseMechanism.option`, its
            bands, buffers or lambda), or "auto" for the mechanism's choice
            by the run's expected error (`with_chosen_noise`).
        max_truncation_probability: the largest probability per logical step
            that a Poisson batch overflows its static capacity.
    """

    target_epsilon: float | None = None
    noise_multiplier: float | None = None
    delta: float | None = None
    l2_norm_clip: float = 1.0
    per_example_scaling: str = "clip"
    automatic_scaling_stability: float = 0.01
    adaptive_clipping_quantile: float | None = None
    adaptive_clipping_learning_rate: float = 0.2
    adaptive_clipping_count_stddev: float | None = None
    accountant: str = "pld"
    non_private: bool = False
    clipping: str = "auto"
    noise: str | None = None
    bands: int | float | str = 4
    max_truncation_probability: float = 1e-9

    def adaptive_clipping(self):
        """The run's `tf_megadp.AdaptiveClipping`, or None for a fixed C."""
        if self.adaptive_clipping_quantile is None:
            return None
        from tf_megadp.adaptive_clipping import AdaptiveClipping

        return AdaptiveClipping(self.adaptive_clipping_quantile,
                                self.adaptive_clipping_learning_rate,
                                self.adaptive_clipping_count_stddev)

    def noise_mechanism(self):
        """The run's noise mechanism (`noise` with its parameter `bands`), or None for DP-SGD.

        Raises:
            JobError: an unknown kind, a parameter the mechanism refuses, or
                "auto" not yet chosen (`with_chosen_noise`).
        """
        if self.noise is None:
            return None
        if self.bands == AUTO:
            raise JobError(
                f"--noise {self.noise} --bands auto is chosen from the run's schedule and "
                "budget (PrivacySettings.with_chosen_noise) before the run is planned.")
        try:
            return noise_class(self.noise).from_option(self.bands)
        except (TypeError, ValueError) as error:
            raise JobError(f"--noise {self.noise} --bands {self.bands!r}: {error}") from None

    def noise_accounting(self) -> dict[str, Any]:
        """The `RunDescription` fields of the run's noise and the sampling it needs.

        Returns:
            {} for DP-SGD; else {"noise": the mechanism, **its
            `accounted_sampling`} (a cycle length, or the fixed order).
        """
        mechanism = self.noise_mechanism()
        if mechanism is None:
            return {}
        return {"noise": mechanism, **mechanism.accounted_sampling()}

    def with_chosen_noise(self, schedule) -> tuple["PrivacySettings", dict[str, Any] | None]:
        """These settings with "auto" replaced by the mechanism's choice for the run.

        The mechanism ranks its candidates by the expected error of the run
        at the target epsilon (`NoiseMechanism.expected_errors`), DP-SGD
        itself among them where the mechanism reaches it (one band), so the
        choice is never worse than DP-SGD by that error.

        Args:
            schedule: the run's `BatchSizeSchedule` (N, B of its first
                phase, its steps).

        Returns:
            (the settings, what was chosen: {"parameter", "chosen",
            "expected_errors"}), or (these settings, None) without "auto".

        Raises:
            JobError: "auto" without a target epsilon, or for a mechanism
                without an automatic choice.
        """
        if self.noise is None or self.bands != AUTO:
            return self, None
        if self.target_epsilon is None:
            raise JobError("--bands auto chooses for a budget: pass --target-epsilon.")
        cls = noise_class(self.noise)
        n = schedule.num_examples
        starts, step = [], 0
        for phase in schedule.phases[:-1]:
            step += phase.steps
            starts.append(step)
        try:
            # A growing batch is ranked at its largest batch (where q = B b / N
            # must stay <= 1); the run's sigma is then calibrated on the
            # schedule itself, as every run's is.
            errors = cls.expected_errors(
                num_examples=n, steps=schedule.total_steps,
                batch_size=max(phase.batch_size for phase in schedule.phases),
                target_epsilon=self.target_epsilon, phase_starts=starts,
                delta=self.delta if self.delta is not None else default_delta(n))
        except ValueError as error:
            raise JobError(f"--noise {self.noise} --bands auto: {error}") from None
        chosen = min(errors, key=errors.get)
        return dataclasses.replace(self, bands=chosen), {
            "parameter": cls.option, "chosen": chosen,
            "expected_errors": {str(value): error for value, error in errors.items()}}

    def check_privacy(self) -> None:
        """Raises `JobError` naming the first bad privacy setting (and how to fix it)."""
        for name in _NUMBERS:
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value)):
                raise JobError(f"{name} must be a finite number, got {value!r}.")
        if self.per_example_scaling not in PER_EXAMPLE_SCALINGS:
            raise JobError(f"per_example_scaling must be one of "
                           f"{', '.join(PER_EXAMPLE_SCALINGS)}, got {self.per_example_scaling!r}.")
        if not self.automatic_scaling_stability > 0:
            raise JobError(
                "automatic_scaling_stability must be > 0, got "
                f"{self.automatic_scaling_stability!r}.")
        if not self.l2_norm_clip > 0:
            raise JobError(f"l2_norm_clip must be > 0, got {self.l2_norm_clip!r}.")
        if self.adaptive_clipping_quantile is not None:
            if self.non_private:
                raise JobError(
                    "Adaptive clipping (--adaptive-clipping-quantile) needs a private run: "
                    "the non-private baseline does not clip.")
            try:
                self.adaptive_clipping()
            except ValueError as error:
                raise JobError(f"adaptive clipping: {error}") from None
        if not self.non_private and self.noise_multiplier is None and self.target_epsilon is None:
            raise JobError("Pass --target-epsilon or --noise-multiplier (or --non-private).")
        if self.noise_multiplier is not None and not self.noise_multiplier > 0:
            raise JobError(
                f"noise_multiplier must be > 0 for a private run, got {self.noise_multiplier}; "
                "use --non-private for the baseline.")
        if self.target_epsilon is not None and not self.target_epsilon > 0:
            raise JobError(f"target_epsilon must be > 0, got {self.target_epsilon}.")
        if self.accountant not in accountant_names():
            raise JobError(
                f"accountant must be one of {accountant_names()}, got {self.accountant!r}.")
        if self.delta is not None and not 0 < self.delta < 1:
            raise JobError(f"delta must be in (0, 1), got {self.delta}.")
        if not 0 < self.max_truncation_probability < 1:
            raise JobError(
                "max_truncation_probability must be in (0, 1), got "
                f"{self.max_truncation_probability!r}.")
        self._check_noise()

    def _check_noise(self) -> None:
        if self.noise is None:
            return
        if self.noise not in NOISES:
            raise JobError(
                f"noise must be one of {', '.join(NOISES)} (or None: independent noise), "
                f"got {self.noise!r}.")
        if self.bands != AUTO:
            if isinstance(self.bands, bool) or not isinstance(self.bands, (int, float)):
                raise JobError(f"bands must be a number or 'auto', got {self.bands!r}.")
            self.noise_mechanism()  # Refuses a parameter the mechanism does not take.
        if self.non_private:
            raise JobError(
                f"--noise {self.noise} is the noise of a private run: the non-private "
                "baseline adds none. Drop --noise, or --non-private.")


def check_privacy_unit(privacy_unit: str | None, corpus: Any) -> None:
    """Checks user-level privacy (`--privacy-unit FIELD`) as every job that takes it does.

    The unit of each document is read from a field of a JSONL corpus
    (`tf_megadp.jobs.bert.text.read_documents(unit_field=...)`): without
    `--corpus` there is no field to read (the default corpus has no units).

    Args:
        privacy_unit: the JSONL field naming each document's unit, or None
            (the packed sequence is the unit).
        corpus: the run's `--corpus` files, or None for the default corpus.

    Raises:
        JobError: the field is not a non-empty string, or there is no corpus
            to read it from.
    """
    if privacy_unit is None:
        return
    if not isinstance(privacy_unit, str) or not privacy_unit:
        raise JobError(f"privacy_unit must name a JSONL field, got {privacy_unit!r}.")
    if not corpus:
        raise JobError(
            f"--privacy-unit {privacy_unit} reads each document's unit from a field of a "
            "JSONL corpus: pass --corpus FILE.jsonl.")


def plan_privacy(settings: PrivacySettings, schedule, *, prior=None,
                 plan: dict[str, Any] | None = None,
                 init_from: str | None = None) -> tuple[float, float, float]:
    """(sigma, delta, epsilon of the full schedule) of a run.

    Args:
        settings: the run's privacy settings.
        schedule: the `BatchSizeSchedule` it follows (its N is the number of
            privacy units).
        prior: the ledger of a release the run continues: epsilon composes
            it first, and a target epsilon bounds the whole.
        plan: a planned run's plan (`tf-megadp plan`), which has calibrated
            sigma and accounted this same schedule already: its numbers are
            taken, not computed a second time.
        init_from: the continued release's path, for the messages.

    Returns:
        (sigma, delta, epsilon); (0, delta, inf) for the non-private baseline.

    Raises:
        JobError: the target is out of reach (the prior alone spends it, or
            no sigma reaches it), or a given sigma spends more than it.
    """
    from tf_megadp import accounting

    n = schedule.num_examples
    delta = settings.delta if settings.delta is not None else default_delta(n)
    if settings.non_private:
        return 0.0, delta, math.inf
    if plan is not None and plan["schedule"] == schedule.to_dict() and plan["delta"] == delta:
        return float(plan["noise_multiplier"]), delta, float(plan["epsilon"])
    if settings.noise_multiplier is not None:
        sigma = float(settings.noise_multiplier)
    else:
        _check_prior_below_target(settings, prior, n, delta, init_from)
        try:
            sigma = accounting.calibrate_noise_multiplier(
                settings.target_epsilon, delta, schedule=schedule,
                accountant=settings.accountant, prior=prior, **settings.noise_accounting())
        except (ValueError, RuntimeError) as error:
            raise JobError(
                f"target epsilon {settings.target_epsilon} is unreachable for this schedule "
                f"({schedule.total_steps} steps over N={n}): {str(error).rstrip('.')}. Use "
                "fewer steps, a smaller batch or a larger epsilon."
            ) from None
    epsilon = accounting.compute_epsilon(delta=delta, schedule=schedule, noise_multiplier=sigma,
                                         accountant=settings.accountant, prior=prior,
                                         **settings.noise_accounting())
    if settings.target_epsilon is not None and epsilon > settings.target_epsilon * 1.0001:
        raise JobError(
            f"noise multiplier {sigma:g} spends epsilon {epsilon:.3f} over the "
            f"{schedule.total_steps} steps, more than target epsilon {settings.target_epsilon}; "
            "raise --noise-multiplier or drop it to calibrate."
        )
    return sigma, delta, epsilon


def _check_prior_below_target(settings: PrivacySettings, prior, n: int, delta: float,
                              init_from: str | None) -> None:
    """A release whose ledger alone spends the target leaves nothing to calibrate."""
    from tf_megadp import accounting

    if prior is None:
        return
    spent = accounting.PrivacyAccountant(n, delta, accountant=settings.accountant,
                                         ledger=prior).epsilon()
    if spent >= settings.target_epsilon:
        raise JobError(
            f"--init-from {init_from} is a DP release whose ledger alone spends epsilon "
            f"{spent:.4g} at this run's delta {delta:.3g}, at least --target-epsilon "
            f"{settings.target_epsilon}: raise --target-epsilon, or pass --init-data-disjoint "
            "if its training data share no example with this corpus.")


def new_dp_optimizer(settings: PrivacySettings, inner, schedule, sigma: float, *,
                     examples_per_unit: int = 1, loss_scale: float | None = None,
                     seed: int | None = None):
    """The run's `tf_megadp.DPOptimizer` around `inner`, from its privacy settings.

    Args:
        settings: the run's privacy settings.
        inner: the inner Keras optimizer.
        schedule: the run's `BatchSizeSchedule`.
        sigma: the planned noise multiplier (`plan_privacy`).
        examples_per_unit: k of a user-level run (units clipped whole).
        loss_scale: the fixed loss scale of a private mixed_float16 run.
        seed: tests only (seeded noise: not for release).
    """
    import tf_megadp

    return tf_megadp.DPOptimizer(
        inner, l2_norm_clip=settings.l2_norm_clip, noise_multiplier=sigma, schedule=schedule,
        clipping=settings.clipping, per_example_scaling=settings.per_example_scaling,
        automatic_scaling_stability=settings.automatic_scaling_stability,
        examples_per_unit=examples_per_unit, adaptive_clipping=settings.adaptive_clipping(),
        noise=settings.noise_mechanism(), loss_scale=loss_scale, seed=seed)
