"""The DP step against the non-private step, under tf_megadp and the peers, on the same models.

One script, three environments (the peers cannot share a process with
tf_megadp: tensorflow-privacy 0.9 imports only under TensorFlow <= 2.15,
Opacus needs PyTorch). Each run prints, for every DP path of one framework,
its median time per step next to the non-private step of the same model,
measured in the same process, interleaved round by round, so that load from
other processes falls on both alike:

- `tf_megadp` (this repository's venv): `make_private` + `DPOptimizer(Adam,
  clipping="auto")`; non-private: the same Keras 3 model with Adam, with and
  without XLA (the ratio is to the faster).
- `tfp` (tensorflow-privacy 0.9.0 on TensorFlow 2.15 / Keras 2):
  `vectorized`: `VectorizedDPKerasAdamOptimizer(num_microbatches=m)` (one
  clipped gradient per example through `vectorized_map`, per-example losses
  with `reduction=NONE`), and `vectorized_xla` the same compiled with
  `jit_compile=True`; `registry`: `DPModel` with the fast-gradient-clipping
  layer registry (Dense, Embedding, LayerNormalization, MultiHeadAttention:
  every trainable layer of both models is registered, so its "fast" ghost-norm
  path runs), `use_xla=True` as its default; `dpmodel`: `DPModel` without a
  registry (its own `vectorized_map` path, XLA). Non-private: the same
  tf.keras model with Adam, with and without XLA.
- `opacus` (Opacus 1.6, PyTorch 2.13 CPU): `PrivacyEngine.make_private` with
  `grad_sample_mode="ghost"` (ghost clipping, its criterion's two backward
  passes) and `"hooks"` (per-sample gradients), fixed batches
  (`poisson_sampling=False`), Adam; non-private: the same module and Adam.

Models (the same layers and sizes in all three; random weights and data,
nothing downloaded):

- `fullhead`: issue 42's encoder, `benchmarks/step_overhead.py`'s: token
  Embedding(V, 128), 2 blocks of MultiHeadAttention (2 heads of 64) +
  LayerNorm(x + attention) + Dense(512, gelu) + Dense(128) added back, and a
  Dense(V) head on every one of the T positions; loss: cross-entropy of all
  T positions, averaged per example.
- `bertlike`: a BERT-tiny-shaped masked LM: token and position embeddings,
  LayerNorm, 2 post-LN blocks (attention, 2 heads of 64; feed-forward 512,
  gelu), the hidden states of 20 masked positions per sequence gathered,
  Dense(128, gelu) + LayerNorm + Dense(V) on them; loss: cross-entropy of
  the 20 positions, averaged per example.
- `gpt2` (tf_megadp and opacus only: keras-hub does not run on TensorFlow
  2.15): `benchmarks/step_overhead.py`'s GPT-2, keras-hub `GPT2CausalLM`
  from `GPT2Backbone` (its `build_gpt2`: 2 layers, hidden 128, 2 heads of
  64, intermediate 512, dropout 0), i.e. token and learned position
  embeddings, 2 pre-LN blocks (LayerNorm, causal self-attention, added
  back; LayerNorm, Dense(512, tanh-approximated gelu), Dense(128), added
  back), a final LayerNorm and the head tied to the token embedding (no
  bias); loss: next-token cross-entropy on all T positions (inputs are
  tokens 0..T-1 of a random sequence of T + 1, labels tokens 1..T),
  averaged per example. The PyTorch module is the same architecture from
  `nn.Embedding`, `nn.LayerNorm` and `nn.Linear` (attention from four
  `nn.Linear`s and `scaled_dot_product_attention(is_causal=True)`, the
  head an `nn.Linear` whose weight is the token embedding's); both sides
  print their parameter counts (1,437,184 at the defaults). Opacus 1.6's
  ghost clipping does not support tied parameters (the tied module's
  first forward pass raises NotImplementedError: "Parameter tying is not
  supported with Ghost Clipping"), so its `ghost` path trains the same
  module with an untied head (an `nn.Linear(128, V, bias=False)` of its
  own: V x 128 more parameters, 2,461,184 in all; the same products) and
  is compared with the non-private step of that untied module; `hooks`
  (per-sample gradients of the shared weight summed over its two uses)
  trains the tied module, as tf_megadp does.

Environments (outside the repository; see docs/benchmarks.md):

    python3.11 -m venv /work/venv-tfp
    /work/venv-tfp/bin/pip install "tensorflow==2.15.*" "tensorflow-privacy==0.9.0"
    python3.11 -m venv /work/venv-opacus
    /work/venv-opacus/bin/pip install torch==2.13.0 "opacus==1.6.*"

Run (one framework per process; `uptime` before each):

    python benchmarks/peers.py --framework tf_megadp --model fullhead
    /work/venv-tfp/bin/python benchmarks/peers.py --framework tfp --model fullhead
    /work/venv-opacus/bin/python benchmarks/peers.py --framework opacus --model fullhead
    python benchmarks/peers.py --framework tf_megadp --model gpt2 --rounds 7
    /work/venv-opacus/bin/python benchmarks/peers.py --framework opacus --model gpt2 --rounds 7

Nothing in the library or the tests imports this file.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

HIDDEN, HEADS, KEY_DIM, FEED_FORWARD, BLOCKS, MASKS = 128, 2, 64, 512, 2, 20
FRAMEWORK_PATHS = {
    "tf_megadp": ("auto",),
    "tfp": ("vectorized", "vectorized_xla", "registry", "dpmodel"),
    "opacus": ("ghost", "hooks"),
}


def load_average() -> str:
    with open("/proc/loadavg") as handle:
        return " ".join(handle.read().split()[:3])


def make_data(args, seed=0):
    """Token ids, position ids, masked positions and labels as NumPy arrays."""
    import numpy as np

    rng = np.random.default_rng(seed)
    m, t = args.micro_batch, args.seq
    if args.model == "gpt2":
        sequence = rng.integers(0, args.vocab, (m, t + 1)).astype("int32")
        return {"tokens": np.ascontiguousarray(sequence[:, :-1]),
                "positions": np.tile(np.arange(t, dtype="int32"), (m, 1)),
                "masked": np.zeros((m, 0), "int32"),
                "labels": np.ascontiguousarray(sequence[:, 1:])}
    tokens = rng.integers(0, args.vocab, (m, t)).astype("int32")
    positions = np.tile(np.arange(t, dtype="int32"), (m, 1))
    masked = np.sort(np.stack([rng.choice(t, MASKS, replace=False) for _ in range(m)]),
                     axis=1).astype("int32")
    if args.model == "fullhead":
        labels = rng.integers(0, args.vocab, (m, t)).astype("int32")
    else:
        labels = rng.integers(0, args.vocab, (m, MASKS)).astype("int32")
    return {"tokens": tokens, "positions": positions, "masked": masked, "labels": labels}


# -- Keras (3 for tf_megadp, 2 for tensorflow-privacy): one builder --------------


def keras_model(keras, tf, args):
    """The model as a functional Keras model (the same code runs on Keras 2 and 3).

    `gpt2` is `step_overhead.py`'s keras-hub GPT-2 (Keras 3 only).
    """
    if args.model == "gpt2":
        from step_overhead import build_gpt2

        return build_gpt2(argparse.Namespace(vocab=args.vocab, seq=args.seq, dropout=0.0))
    layers = keras.layers
    tokens = keras.Input((args.seq,), dtype="int32", name="tokens")
    x = layers.Embedding(args.vocab, HIDDEN)(tokens)
    inputs = [tokens]
    if args.model == "bertlike":
        positions = keras.Input((args.seq,), dtype="int32", name="positions")
        masked = keras.Input((MASKS,), dtype="int32", name="masked")
        inputs += [positions, masked]
        x = layers.LayerNormalization()(x + layers.Embedding(args.seq, HIDDEN)(positions))
    for _ in range(BLOCKS):
        attention = layers.MultiHeadAttention(num_heads=HEADS, key_dim=KEY_DIM)(x, x)
        x = layers.LayerNormalization()(x + attention)
        hidden = layers.Dense(FEED_FORWARD, activation="gelu")(x)
        x = x + layers.Dense(HIDDEN)(hidden)
        if args.model == "bertlike":
            x = layers.LayerNormalization()(x)
    if args.model == "bertlike":
        x = layers.Lambda(lambda pair: tf.gather(pair[0], pair[1], batch_dims=1),
                          output_shape=(MASKS, HIDDEN))([x, masked])
        x = layers.LayerNormalization()(layers.Dense(HIDDEN, activation="gelu")(x))
    return keras.Model(inputs, layers.Dense(args.vocab)(x))


def keras_inputs(data, args):
    if args.model == "fullhead":
        return data["tokens"]
    if args.model == "gpt2":
        import numpy as np

        return {"token_ids": data["tokens"], "padding_mask": np.ones_like(data["tokens"])}
    return [data["tokens"], data["positions"], data["masked"]]


def keras_paths(args):
    """(name, step) of every path: each step trains on one micro-batch."""
    import tensorflow as tf

    if args.framework == "tf_megadp":
        import keras
    else:
        from tensorflow import keras
    data = make_data(args)
    x, y = keras_inputs(data, args), data["labels"]
    loss = per_example_loss(keras, tf)
    # GPT2CausalLM's compile would add an accuracy metric; no model here has one.
    no_metrics = {"weighted_metrics": None} if args.model == "gpt2" else {}
    paths = []
    for jit in (False, True):
        keras.utils.set_random_seed(0)
        model = keras_model(keras, tf, args)
        print(f"  parameters: {count_keras(model):,}", flush=True)
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss, jit_compile=jit,
                      **no_metrics)
        paths.append((f"non-private ({'XLA' if jit else 'no XLA'})",
                      lambda model=model: model.train_on_batch(x, y)))
    if args.framework == "tf_megadp":
        import tf_megadp

        model = tf_megadp.make_private(keras_model(keras, tf, args))
        print(f"  parameters: {count_keras(model):,} (DP)", flush=True)
        model.compile(optimizer=tf_megadp.DPOptimizer(
            keras.optimizers.Adam(1e-3), l2_norm_clip=1.0, noise_multiplier=1.0,
            clipping="auto"), loss=loss, **no_metrics)
        paths.append(("DP auto", lambda: model.train_on_batch(x, y)))
        return paths
    import tensorflow_privacy as tfp
    from tensorflow_privacy.privacy.fast_gradient_clipping import layer_registry
    from tensorflow_privacy.privacy.fast_gradient_clipping.registry_functions import (
        layer_normalization, multi_head_attention)

    for path in args.paths:
        model = None
        if path.startswith("vectorized"):
            model = keras_model(keras, tf, args)
            model.compile(optimizer=tfp.VectorizedDPKerasAdamOptimizer(
                l2_norm_clip=1.0, noise_multiplier=1.0, num_microbatches=args.micro_batch,
                learning_rate=1e-3),
                loss=per_example_loss(keras, tf, reduction=keras.losses.Reduction.NONE),
                jit_compile=path.endswith("xla"))
        else:
            registry = None
            if path == "registry":
                registry = layer_registry.make_default_layer_registry()
                registry.insert(keras.layers.LayerNormalization,
                                layer_normalization.layer_normalization_computation)
                registry.insert(keras.layers.MultiHeadAttention,
                                multi_head_attention.multi_head_attention_layer_computation)
            plain = keras_model(keras, tf, args)
            model = tfp.DPModel(l2_norm_clip=1.0, noise_multiplier=1.0, use_xla=True,
                                layer_registry=registry, inputs=plain.inputs,
                                outputs=plain.outputs)
            model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss)
            if path == "registry" and not model._enable_fast_peg_computation:
                raise RuntimeError("tensorflow-privacy did not take its fast registry path")
        paths.append((f"DP {path}", lambda model=model: model.train_on_batch(x, y)))
    return paths


def count_keras(model):
    """Trainable parameters (a tied head's weight counted once)."""
    import numpy as np

    return sum(int(np.prod(v.shape)) for v in model.trainable_weights)


def per_example_loss(keras, tf, **kwargs):
    """Cross-entropy, one value per example: the mean over its positions.

    tensorflow-privacy's registry path refuses a loss of shape [m, T], and its
    vectorized optimizer wants `reduction=NONE`; the other paths reduce as
    Keras does (the mean over examples).
    """

    class PerExample(keras.losses.Loss):
        def call(self, labels, logits):
            return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
                labels, logits, from_logits=True), axis=-1)

    return PerExample(**kwargs)


# -- PyTorch / Opacus -------------------------------------------------------------


def torch_paths(args):
    import torch
    from torch import nn

    class Attention(nn.Module):
        def __init__(self, causal=False):
            super().__init__()
            self.causal = causal
            width = HEADS * KEY_DIM
            self.query, self.key, self.value = (nn.Linear(HIDDEN, width) for _ in range(3))
            self.output = nn.Linear(width, HIDDEN)

        def forward(self, x):
            m, t, _ = x.shape

            def split(z):
                return z.view(m, t, HEADS, KEY_DIM).transpose(1, 2)

            q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
            if self.causal:
                mixed = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                weights = torch.softmax(q @ k.transpose(-1, -2) / KEY_DIM ** 0.5, dim=-1)
                mixed = weights @ v
            return self.output(mixed.transpose(1, 2).reshape(m, t, HEADS * KEY_DIM))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention, self.norm = Attention(), nn.LayerNorm(HIDDEN)
            self.up, self.down = nn.Linear(HIDDEN, FEED_FORWARD), nn.Linear(FEED_FORWARD, HIDDEN)
            self.after = nn.LayerNorm(HIDDEN) if args.model == "bertlike" else nn.Identity()

        def forward(self, x):
            x = self.norm(x + self.attention(x))
            return self.after(x + self.down(nn.functional.gelu(self.up(x))))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens = nn.Embedding(args.vocab, HIDDEN)
            self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
            if args.model == "bertlike":
                self.positions, self.norm = nn.Embedding(args.seq, HIDDEN), nn.LayerNorm(HIDDEN)
                self.transform = nn.Linear(HIDDEN, HIDDEN)
                self.transform_norm = nn.LayerNorm(HIDDEN)
            self.head = nn.Linear(HIDDEN, args.vocab)

        def forward(self, tokens, positions, masked):
            x = self.tokens(tokens)
            if args.model == "bertlike":
                x = self.norm(x + self.positions(positions))
            for block in self.blocks:
                x = block(x)
            if args.model == "bertlike":
                x = torch.gather(x, 1, masked.unsqueeze(-1).expand(-1, -1, HIDDEN))
                x = self.transform_norm(nn.functional.gelu(self.transform(x)))
            return self.head(x)

    class GPT2Block(nn.Module):
        """keras-hub's TransformerDecoder with normalize_first=True (pre-LN), no cross-attention."""

        def __init__(self):
            super().__init__()
            self.attention_norm, self.attention = nn.LayerNorm(HIDDEN), Attention(causal=True)
            self.mlp_norm = nn.LayerNorm(HIDDEN)
            self.up, self.down = nn.Linear(HIDDEN, FEED_FORWARD), nn.Linear(FEED_FORWARD, HIDDEN)

        def forward(self, x):
            x = x + self.attention(self.attention_norm(x))
            hidden = nn.functional.gelu(self.up(self.mlp_norm(x)), approximate="tanh")
            return x + self.down(hidden)

    class GPT2(nn.Module):
        """GPT2Backbone + GPT2CausalLM's head; `tied`: the head's weight is the token embedding."""

        def __init__(self, tied=True):
            super().__init__()
            self.tokens = nn.Embedding(args.vocab, HIDDEN)
            self.positions = nn.Embedding(args.seq, HIDDEN)
            self.blocks = nn.ModuleList(GPT2Block() for _ in range(BLOCKS))
            self.norm = nn.LayerNorm(HIDDEN)
            self.head = nn.Linear(HIDDEN, args.vocab, bias=False)
            for module in self.modules():  # keras-hub's initializers
                if isinstance(module, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(module.weight, std=0.01 if module is self.tokens else 0.02)
                if isinstance(module, nn.Linear) and module.bias is not None:
                    nn.init.zeros_(module.bias)
            if tied:
                self.head.weight = self.tokens.weight

        def forward(self, tokens, positions, masked):
            x = self.tokens(tokens) + self.positions(positions)
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm(x))

    def new_model(tied=True):
        torch.manual_seed(0)
        model = GPT2(tied) if args.model == "gpt2" else Net()
        count = sum(p.numel() for p in model.parameters() if p.requires_grad)
        print(f"  parameters: {count:,}{'' if tied else ' (untied head)'}", flush=True)
        return model

    data = {name: torch.from_numpy(value).long() for name, value in make_data(args).items()}
    inputs = (data["tokens"], data["positions"], data["masked"])
    labels = data["labels"]

    def per_example_loss(logits):
        loss = nn.functional.cross_entropy(logits.reshape(-1, args.vocab), labels.reshape(-1),
                                           reduction="none")
        return loss.view(args.micro_batch, -1).mean(dim=1)

    def plain(model):
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

        def step():
            optimizer.zero_grad()
            per_example_loss(model(*inputs)).mean().backward()
            optimizer.step()
        return step

    paths = [("non-private", plain(new_model()))]
    # Opacus's ghost clipping does not support tied parameters: its path
    # trains GPT-2 with an untied head, against that module's own
    # non-private step.
    untied_ghost = args.model == "gpt2" and "ghost" in args.paths
    if untied_ghost:
        paths.append(("non-private (untied)", plain(new_model(tied=False))))
    from opacus import PrivacyEngine

    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(*inputs, labels), batch_size=args.micro_batch)
    for mode in args.paths:
        private = new_model(tied=not (untied_ghost and mode == "ghost"))
        private_optimizer = torch.optim.Adam(private.parameters(), lr=1e-3)
        engine = PrivacyEngine()
        if mode == "ghost":
            private, private_optimizer, criterion, _ = engine.make_private(
                module=private, optimizer=private_optimizer, data_loader=loader,
                criterion=nn.CrossEntropyLoss(), noise_multiplier=1.0, max_grad_norm=1.0,
                poisson_sampling=False, grad_sample_mode="ghost")

            def step(private=private, optimizer=private_optimizer, criterion=criterion):
                optimizer.zero_grad()
                logits = private(*inputs)
                loss = criterion(logits.reshape(-1, args.vocab), labels.reshape(-1),
                                 shape=logits.shape)
                loss.backward()  # both of ghost clipping's backward passes
                optimizer.step()
        else:
            private, private_optimizer, _ = engine.make_private(
                module=private, optimizer=private_optimizer, data_loader=loader,
                noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=False,
                grad_sample_mode="hooks")

            def step(private=private, optimizer=private_optimizer):
                optimizer.zero_grad()
                per_example_loss(private(*inputs)).mean().backward()
                optimizer.step()
        name = f"DP {mode} (untied)" if untied_ghost and mode == "ghost" else f"DP {mode}"
        paths.append((name, step))
    return paths


# -- Timing -------------------------------------------------------------------------


def measure(paths, args):
    """Median seconds per step of each path: rounds of `--steps` steps, rotating order."""
    for name, step in paths:
        start = time.perf_counter()
        for _ in range(args.warmup):
            step()
        print(f"  warm-up {name}: {time.perf_counter() - start:.1f} s", flush=True)
    times = {name: [] for name, _ in paths}
    for round_index in range(args.rounds):
        shift = round_index % len(paths)
        for name, step in paths[shift:] + paths[:shift]:
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            times[name].append((time.perf_counter() - start) / args.steps)
    return {name: statistics.median(values) for name, values in times.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--framework", choices=sorted(FRAMEWORK_PATHS), required=True)
    parser.add_argument("--model", choices=("fullhead", "bertlike", "gpt2"), default="fullhead")
    parser.add_argument("--paths", default=None,
                        help="comma-separated DP paths (default: all of the framework's)")
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args(argv)
    if args.framework == "tfp" and args.model == "gpt2":
        parser.error("--model gpt2 is keras-hub's GPT-2, which does not run on TensorFlow 2.15")
    args.paths = (args.paths.split(",") if args.paths else list(FRAMEWORK_PATHS[args.framework]))
    print(f"{args.framework} / {args.model}: m={args.micro_batch} T={args.seq} V={args.vocab}, "
          f"median of {args.rounds} rounds of {args.steps} steps; load {load_average()}",
          flush=True)
    if args.framework == "opacus":
        import torch

        versions = f"torch {torch.__version__}, opacus {__import__('opacus').__version__}"
        paths = torch_paths(args)
    else:
        import tensorflow as tf

        versions = f"tensorflow {tf.__version__}"
        if args.framework == "tfp":
            versions += f", tensorflow-privacy {__import__('tensorflow_privacy').__version__}"
        paths = keras_paths(args)
    print(f"  {versions}; python {sys.version.split()[0]}", flush=True)
    medians = measure(paths, args)
    for name, seconds in medians.items():
        ratio = ""
        if not name.startswith("non-private"):
            # The faster non-private step of the same module (an untied one for "(untied)").
            baseline = min((n for n in medians if n.startswith("non-private")
                            and n.endswith("(untied)") == name.endswith("(untied)")),
                           key=medians.get)
            ratio = f"  {seconds / medians[baseline]:.2f}x to {baseline}"
        print(f"  {name:24s} {1000 * seconds:9.1f} ms/step{ratio}")
    print(f"  load {load_average()}", flush=True)


if __name__ == "__main__":
    main()
