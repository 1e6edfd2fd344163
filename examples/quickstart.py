"""Quickstart: a differentially private classifier in a dozen lines of Keras.

Trains a small network on scikit-learn's handwritten-digits data (shipped with
scikit-learn, nothing is downloaded) with DP-SGD, and prints the test accuracy
and the (epsilon, delta) the run spent.

    python examples/quickstart.py
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import tf_megadp  # noqa: E402


def main():
    features, labels = load_digits(return_X_y=True)
    features = (features / 16.0).astype("float32")
    x_train, x_test, y_train, y_test = train_test_split(
        features, labels.astype("int32"), test_size=0.25, random_state=0)
    keras.utils.set_random_seed(0)

    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
    ])
    model = tf_megadp.make_private(model)  # the explicit opt-in
    micro_batch, accumulation_steps = 64, 4  # logical batch of 256 examples
    model.compile(
        optimizer=tf_megadp.DPOptimizer(
            keras.optimizers.Adam(1e-2),
            l2_norm_clip=1.0,
            noise_multiplier=1.3,
            accumulation_steps=accumulation_steps,
        ),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    n = len(x_train) - len(x_train) % (micro_batch * accumulation_steps)
    privacy = tf_megadp.PrivacyCallback(
        num_examples=n, delta=1e-5, batch_size=micro_batch * accumulation_steps,
        sampling="shuffle")
    model.fit(x_train[:n], y_train[:n], batch_size=micro_batch, epochs=10,
              callbacks=[privacy], verbose=2)
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    print(f"test accuracy {accuracy:.3f} at epsilon {privacy.epsilon:.2f}, delta 1e-5 "
          "(shuffled batches accounted as Poisson; see docs/privacy.md)")


if __name__ == "__main__":
    main()
