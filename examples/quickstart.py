"""Quickstart: a differentially private classifier in a dozen lines of Keras.

Trains a small network on scikit-learn's handwritten-digits data (shipped with
scikit-learn, nothing is downloaded) with DP-SGD on Poisson-sampled batches,
and prints the test accuracy and the (epsilon, delta) the run spent. N and the
batch layout are measured from the arrays, never typed by hand.

    python examples/quickstart.py
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
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
    # Honest Poisson batches of expected size 256, drawn from secret OS
    # entropy; N is measured from the arrays, so nothing is typed by hand.
    sampler = tf_megadp.PoissonSampler.from_arrays(
        x_train, y_train, batch_size=256, epochs=10, micro_batch_size=64)
    model = tf_megadp.make_private(model)  # the explicit opt-in
    model.compile(
        optimizer=tf_megadp.DPOptimizer(
            keras.optimizers.Adam(1e-2),
            l2_norm_clip=1.0,
            noise_multiplier=1.3,
            schedule=sampler.schedule,  # B, accumulation and N shared with the sampler
        ),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        # Poisson steps are padded with zero-weight rows: weight the metric.
        weighted_metrics=["accuracy"],
    )
    privacy = tf_megadp.PrivacyCallback(delta=1e-5)
    # shuffle=False: the sampler drew the batches (Keras ignores shuffle for
    # datasets anyway, with a warning).
    model.fit(sampler.as_dataset(), callbacks=[privacy], shuffle=False, verbose=2)
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    print(f"test accuracy {accuracy:.3f} at epsilon {privacy.epsilon:.2f}, delta 1e-5 "
          f"({sampler.schedule.total_steps} Poisson-sampled logical steps)")


if __name__ == "__main__":
    main()
