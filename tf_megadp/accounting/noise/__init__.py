"""The noise mechanisms of the gradient noise: a registry, one module per mechanism.

`base` holds what every mechanism provides (`NoiseMechanism`,
`NoiseStrategy`) and the registry (`register_noise`, `noise_kinds`,
`noise_class`, `default_noise`, `mechanism_from_dict`,
`read_noise_record`). Each mechanism
is one module that registers itself: `independent` (DP-SGD), `bandmf`,
`blt` and `lambda_cgd`. This file imports them, so that the registry holds
every built-in mechanism; it and the package root's exports are the only
places outside the mechanisms' modules that name one.
"""

from tf_megadp.accounting.noise.base import (
    NoiseMechanism,
    NoiseStrategy,
    StreamOps,
    default_noise,
    fixed_order_participation,
    mechanism_from_dict,
    noise_class,
    noise_kinds,
    read_noise_record,
    register_noise,
    resolve_noise,
)
from tf_megadp.accounting.noise.independent import Independent
from tf_megadp.accounting.noise.bandmf import BandMF
from tf_megadp.accounting.noise.blt import BLT
from tf_megadp.accounting.noise.lambda_cgd import LambdaCGD

__all__ = [
    "BLT",
    "BandMF",
    "Independent",
    "LambdaCGD",
    "NoiseMechanism",
    "NoiseStrategy",
    "StreamOps",
    "default_noise",
    "fixed_order_participation",
    "mechanism_from_dict",
    "noise_class",
    "noise_kinds",
    "read_noise_record",
    "register_noise",
    "resolve_noise",
]
