"""tf_megadp: differentially private training for TensorFlow / Keras 3 at mega-batch scale.

The public API is re-exported here; everything else is private to its module.
"""

from tf_megadp.schedules import BatchSizeSchedule, Phase

__version__ = "0.1.0"
