"""Public then private: what a public start buys a DP BERT, on the default corpus split by package.

The offline default corpus (docstrings of installed packages,
`tf_megadp.jobs.bert.corpus`) is split by package: the standard library and
numpy are the PUBLIC half, keras and tensorflow the PRIVATE half (documents
of the private half that also occur in the public half are dropped, so the
halves share no document: the `--init-data-disjoint` statement below is
true by construction). The WordPiece vocabulary is learned from the public
half only. Then, each with `tf-megadp pretrain` (`run_pretraining`):

- public: non-private pretraining on the public half (the public model);
- (a) the public model alone, evaluated on the private half's held-out split;
- (b) DP continued pretraining on the private half from the public model,
  every weight trained, at `--target-epsilon`;
- (c) the same with `--lora-rank` (LoRA on query and value, MLM head);
- (d) non-private continued pretraining from the public model;
- (e) DP from scratch on the private half (today's job), same epsilon.

Every row reports the held-out MLM accuracy on the same masked held-out
split of the private half (the job's own evaluation, with the same public
masking seed). Then, in one process, the step time (`train_on_batch` of
one micro-batch of the private half, interleaved rounds, median after
warm-up, XLA compilation excluded) and the peak resident-memory growth of
(b) and (c) against their non-private twins (the same model, weights and
trainable set, compiled as the job compiles its baseline: XLA on).
`uptime`'s load average is printed before and after every phase: the
machine may be shared.

Run:

    python benchmarks/public_then_private.py                  # docs/benchmarks.md's table
    python benchmarks/public_then_private.py --quick          # a smoke run (minutes)

Writes `--output-dir`/results.json, the runs' folders, and the plot
(`--plot`, default docs/public_then_private.png).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from benchmarks._measure import PeakRss  # noqa: E402

PUBLIC_PACKAGES = ("stdlib", "numpy")
PRIVATE_PACKAGES = ("keras", "tensorflow")
ROWS = {
    "a": "(a) public model alone",
    "b": "(b) DP continued, full",
    "c": "(c) DP continued, LoRA",
    "d": "(d) non-private continued",
    "e": "(e) DP from scratch",
}


def load_average() -> float:
    return os.getloadavg()[0]


def write_halves(folder: str, max_characters: int, log) -> tuple[str, str, list[str]]:
    """The public and private halves as JSONL files, sharing no document; the public documents."""
    from tf_megadp.jobs.bert.corpus import default_corpus_documents

    public = default_corpus_documents(max_characters // 2, packages=PUBLIC_PACKAGES)
    seen = {" ".join(text.split()) for text in public}
    private = [text for text in default_corpus_documents(max_characters // 2,
                                                         packages=PRIVATE_PACKAGES)
               if " ".join(text.split()) not in seen]
    paths = []
    for name, documents in (("public", public), ("private", private)):
        path = os.path.join(folder, f"{name}.jsonl")
        with open(path, "w", encoding="utf-8") as handle:
            for text in documents:
                handle.write(json.dumps({"text": text}) + "\n")
        paths.append(path)
        log(f"{name} half: {len(documents):,} documents, "
            f"{sum(len(t) for t in documents):,} characters ({path})")
    return paths[0], paths[1], public


def learn_public_vocabulary(folder: str, documents: list[str], size: int) -> str:
    from tf_megadp.jobs.bert import text

    path = os.path.join(folder, "public_vocab.txt")
    if not os.path.isfile(path):
        vocabulary = text.learn_vocabulary(documents, size)
        with open(path, "w", encoding="utf-8") as handle:
            handle.write("".join(token + "\n" for token in vocabulary))
    return path


def run_job(name: str, log, **settings):
    """One `tf-megadp pretrain` run; its report (reused if the folder holds a finished one)."""
    from tf_megadp.jobs.bert.pretraining import PretrainConfig, run_pretraining

    report_path = os.path.join(settings["output_dir"], "report.json")
    if os.path.isfile(report_path):
        with open(report_path, encoding="utf-8") as handle:
            report = json.load(handle)
        if report.get("completed"):
            log(f"{name}: reusing {report_path}")
            return report
    before = load_average()
    started = time.time()
    report = run_pretraining(PretrainConfig(**settings), log=lambda *_: None)
    report["benchmark_load"] = [before, load_average()]
    report["benchmark_seconds"] = time.time() - started
    log(f"{name}: held-out {report['heldout_mlm_accuracy']:.4f}, epsilon "
        f"{report['epsilon'] if report['private'] else 'inf'}, "
        f"{report['benchmark_seconds']:.0f} s, load {before:.1f} -> {load_average():.1f}")
    return report


def private_heldout(settings):
    """The private half's masked held-out split, exactly as every private-half run evaluates it."""
    from tf_megadp.jobs.bert import text, training
    from tf_megadp.jobs.bert.pretraining import PretrainConfig, prepare_data

    config = PretrainConfig(**settings)
    _, train, heldout = prepare_data(config)
    batcher = text.MaskedLMBatcher.from_shards(train, max_predictions=config.max_predictions)
    return training.heldout_batches(heldout, batcher, config.micro_batch_size,
                                    config.seed), batcher, train, config


def timing_inputs(args, with_heldout: bool = False):
    """(the public model.keras, the private runs' config, one masked micro-batch[, held-out set])."""
    from tf_megadp.jobs.bert import training

    public_model = os.path.join(args.output_dir, "public", "model.keras")
    with open(os.path.join(args.output_dir, "public", "report.json"), encoding="utf-8") as handle:
        shape = json.load(handle)["model"]
    settings = dict(model=args.model, corpus=[os.path.join(args.output_dir, "private.jsonl")],
                    vocabulary=os.path.join(args.output_dir, "public_vocab.txt"),
                    cache_dir=os.path.join(args.output_dir, "cache"),
                    micro_batch_size=args.micro_batch_size,
                    sequence_length=shape["sequence_length"])
    heldout, batcher, train, config = private_heldout(settings)
    # The model's V: the learned vocabulary may be smaller than asked.
    config = dataclasses.replace(config, vocabulary_size=train.vocabulary_size)
    # A training micro-batch of the private half, masked with a public key.
    rows = train.read(np.arange(args.micro_batch_size))
    batch = training.masked_rows(rows, batcher, config.seed + 1)
    return (public_model, config, batch) + ((heldout,) if with_heldout else ())


def accuracy_of(model_path: str, config, heldout) -> float:
    """Held-out MLM accuracy of a released model.keras, as the job's evaluation computes it."""
    import keras

    from tf_megadp.jobs.bert import training

    x, y, w = heldout
    model = training.build_model(config, config.vocabulary_size)
    model.load_weights(model_path)
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  weighted_metrics=[keras.metrics.SparseCategoricalAccuracy(name="acc")])
    _, accuracy = model.evaluate(x, y, sample_weight=w, batch_size=config.micro_batch_size,
                                 verbose=0)
    return float(accuracy)


# The four steps compared: (name, LoRA, private).
STEPS = (("non-private full", False, False), ("DP full", False, True),
         ("non-private LoRA", True, False), ("DP LoRA", True, True))


def step_model(public_model: str, config, lora_rank: int, lora: bool, private: bool):
    """The job's model from the public weights, trained as (b)-(d) train it, compiled as the job does."""
    import keras

    import tf_megadp
    from tf_megadp.jobs.bert import initial_weights, trainable, training

    settings = dataclasses.replace(config, lora_rank=lora_rank if lora else None)
    keras.utils.set_random_seed(0)
    model = training.build_model(settings, config.vocabulary_size)
    initial_weights.load_into(model, initial_weights.read_initial_weights(public_model))
    trainable.restrict_training(model, settings)
    optimizer = keras.optimizers.AdamW(1e-3)
    if private:
        model = tf_megadp.make_private(model)
        optimizer = tf_megadp.DPOptimizer(optimizer, l2_norm_clip=1.0, noise_multiplier=1.0,
                                          clipping=config.clipping)
    # As the job compiles: XLA for the baseline (Keras leaves it off on a
    # CPU), the DP step compiles its clipping with XLA itself.
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  weighted_metrics=[keras.metrics.SparseCategoricalAccuracy()],
                  jit_compile=not private)
    return model


def timed_steps(public_model: str, config, batch, lora_rank: int, rounds: int, warmup: int,
                log) -> dict:
    """Median step time of DP full / LoRA and their non-private twins, interleaved in one process."""
    x, y, w = batch
    models = {name: step_model(public_model, config, lora_rank, lora, private)
              for name, lora, private in STEPS}
    times = {name: [] for name in models}
    order = list(models)
    for round_ in range(warmup + rounds):
        # A rotating order: load from other processes falls on all alike.
        for name in order[round_ % len(order):] + order[:round_ % len(order)]:
            started = time.perf_counter()
            models[name].train_on_batch(x, y, sample_weight=w)
            if round_ >= warmup:
                times[name].append(time.perf_counter() - started)
    result = {}
    for name, model in models.items():
        ordered = sorted(times[name])
        result[name] = {"step_s": ordered[len(ordered) // 2],
                        "trainable_parameters": int(sum(
                            int(np.prod(v.shape)) for v in model.trainable_variables))}
        log(f"{name}: {result[name]['step_s'] * 1000:.0f} ms/step")
    return result


def peak_memory(name: str, public_model: str, config, batch, lora_rank: int,
                warmup: int) -> float:
    """MiB the step adds to the process: peak RSS during its first calls, XLA compilation included.

    Run in a fresh process per step (`--memory-probe`), so that no other
    model's memory is counted: the peak resident-memory growth from just
    before the model is built to the end of `warmup + 2` steps.
    """
    x, y, w = batch
    _, lora, private = next(step for step in STEPS if step[0] == name)
    with PeakRss() as peak:
        model = step_model(public_model, config, lora_rank, lora, private)
        for _ in range(warmup + 2):
            model.train_on_batch(x, y, sample_weight=w)
    return peak.peak_increase / 2**20


def probed_memory(args, log) -> dict:
    """`peak_memory` of each step, each in its own process (this script with --memory-probe)."""
    import subprocess

    result = {}
    for name, _, _ in STEPS:
        output = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--memory-probe", name,
             "--output-dir", args.output_dir, "--model", args.model,
             "--vocabulary-size", str(args.vocabulary_size),
             "--micro-batch-size", str(args.micro_batch_size),
             "--lora-rank", str(args.lora_rank), "--timing-warmup", str(args.timing_warmup)],
            capture_output=True, text=True, check=True).stdout
        result[name] = json.loads(output.strip().splitlines()[-1])["peak_rss_mib"]
        log(f"{name}: peak RSS growth {result[name]:.0f} MiB (own process)")
    return result


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2),
                                         gridspec_kw={"width_ratios": [5, 4]})
    keys = list(ROWS)
    values = [results["accuracy"][k] for k in keys]
    colors = ["tab:gray", "tab:blue", "tab:cyan", "tab:green", "tab:red"]
    left.bar(range(len(keys)), values, color=colors)
    left.axhline(results["unigram_accuracy"], color="black", linestyle=":",
                 label=f"unigram baseline {results['unigram_accuracy']:.3f}")
    left.axhline(0.9 * results["accuracy"]["d"], color="tab:green", linestyle="--",
                 label="0.9 x (d)")
    left.set_xticks(range(len(keys)), [ROWS[k].split(") ")[1] for k in keys], rotation=20,
                    ha="right", fontsize=8)
    for index, value in enumerate(values):
        left.text(index, value, f"{value:.3f}", ha="center", va="bottom", fontsize=8)
    left.set_ylabel("held-out MLM accuracy (private half)")
    left.set_title(f"public then private, epsilon {results['epsilon_target']}", fontsize=10)
    left.legend(fontsize=8, loc="lower right")
    names = list(results["steps"])
    right.bar(range(len(names)), [results["steps"][n]["step_s"] * 1000 for n in names],
              color=["tab:green", "tab:blue", "tab:olive", "tab:cyan"])
    right.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
    right.set_ylabel(f"ms per micro-batch of {results['micro_batch_size']}")
    right.set_title("step time (median, train_on_batch)", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", default=os.path.join("runs", "public_then_private"))
    parser.add_argument("--plot", default=os.path.join("docs", "public_then_private.png"))
    parser.add_argument("--max-characters", type=int, default=3_000_000,
                        help="of the default corpus, split evenly over the four packages")
    parser.add_argument("--model", default="nano")
    parser.add_argument("--vocabulary-size", type=int, default=512)
    parser.add_argument("--public-steps", type=int, default=600)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=64)
    parser.add_argument("--target-epsilon", type=float, default=5.36)
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--lora-learning-rate", type=float, default=None,
                        help="peak learning rate of (c) (default: the job's DP default)")
    parser.add_argument("--timing-rounds", type=int, default=5)
    parser.add_argument("--timing-warmup", type=int, default=2)
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: 300 k characters, 10 steps each")
    parser.add_argument("--memory-probe", metavar="STEP", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_probe:
        # One step's memory, in this fresh process (`probed_memory`).
        public_model, config, batch = timing_inputs(args)
        print(json.dumps({"peak_rss_mib": peak_memory(
            args.memory_probe, public_model, config, batch, args.lora_rank,
            args.timing_warmup)}))
        return {}
    if args.quick:
        args.max_characters, args.public_steps, args.steps = 300_000, 10, 10
        args.batch_size, args.timing_rounds, args.timing_warmup = 64, 2, 1
    os.makedirs(args.output_dir, exist_ok=True)
    lines = []

    def log(line):
        print(line, flush=True)
        lines.append(line)

    log(f"load at start {load_average():.1f}")
    public_file, private_file, public_documents = write_halves(args.output_dir,
                                                               args.max_characters, log)
    vocabulary = learn_public_vocabulary(args.output_dir, public_documents,
                                         args.vocabulary_size)
    cache = os.path.join(args.output_dir, "cache")
    common = dict(model=args.model, vocabulary=vocabulary, cache_dir=cache, verbose=0,
                  micro_batch_size=args.micro_batch_size, batch_size=args.batch_size,
                  checkpoint_minutes=0)
    public = run_job("public", log, corpus=[public_file], non_private=True,
                     target_epsilon=None, steps=args.public_steps,
                     output_dir=os.path.join(args.output_dir, "public"), **common)
    public_model = os.path.join(args.output_dir, "public", "model.keras")
    private = dict(common, corpus=[private_file], steps=args.steps)
    continued = dict(private, init_from=public_model, init_data_disjoint=True)
    reports = {
        "b": run_job(ROWS["b"], log, target_epsilon=args.target_epsilon,
                     output_dir=os.path.join(args.output_dir, "b_dp_full"), **continued),
        "c": run_job(ROWS["c"], log, target_epsilon=args.target_epsilon,
                     lora_rank=args.lora_rank, learning_rate=args.lora_learning_rate,
                     output_dir=os.path.join(args.output_dir, "c_dp_lora"), **continued),
        "d": run_job(ROWS["d"], log, non_private=True, target_epsilon=None,
                     output_dir=os.path.join(args.output_dir, "d_non_private"), **continued),
        "e": run_job(ROWS["e"], log, target_epsilon=args.target_epsilon,
                     output_dir=os.path.join(args.output_dir, "e_dp_scratch"), **private),
    }
    public_model, config, batch, heldout = timing_inputs(args, with_heldout=True)
    accuracy = {"a": accuracy_of(public_model, config, heldout)}
    accuracy.update({key: report["heldout_mlm_accuracy"] for key, report in reports.items()})
    log(f"{ROWS['a']}: held-out {accuracy['a']:.4f}")
    log(f"timing: load {load_average():.1f}")
    steps = timed_steps(public_model, config, batch, args.lora_rank, args.timing_rounds,
                        args.timing_warmup, log)
    log(f"timing done: load {load_average():.1f}")
    for name, mib in probed_memory(args, log).items():
        steps[name]["peak_rss_mib"] = mib
    log(f"memory done: load {load_average():.1f}")
    results = {
        "accuracy": accuracy,
        "unigram_accuracy": reports["e"]["unigram_baseline_accuracy"],
        "epsilon": {key: reports[key]["epsilon"] for key in ("b", "c", "e")},
        "epsilon_target": args.target_epsilon,
        "reports": {key: {k: report[k] for k in ("heldout_mlm_accuracy", "epsilon",
                                                  "learning_rate", "logical_steps",
                                                  "num_examples", "train_time_s",
                                                  "noise_multiplier", "delta")
                          if k in report} | {"load": report.get("benchmark_load")}
                    for key, report in reports.items()},
        "public": {k: public[k] for k in ("heldout_mlm_accuracy", "num_examples",
                                          "logical_steps", "learning_rate")},
        "steps": steps,
        "micro_batch_size": args.micro_batch_size,
        "settings": vars(args),
        "log": lines,
    }
    best = max(accuracy["b"], accuracy["c"])
    results["targets"] = {
        "best_dp_over_non_private": best / accuracy["d"],
        "dp_lora_step_over_non_private_lora": (steps["DP LoRA"]["step_s"]
                                               / steps["non-private LoRA"]["step_s"]),
        "dp_full_step_over_non_private_full": (steps["DP full"]["step_s"]
                                               / steps["non-private full"]["step_s"]),
    }
    with open(os.path.join(args.output_dir, "results.json"), "w", encoding="utf-8") as handle:
        json.dump(results, handle, indent=2, default=str)
    if args.plot:
        plot(results, args.plot)
    print(markdown(results))
    return results


def markdown(results: dict) -> str:
    reports = results["reports"]
    table = ["| row | held-out MLM accuracy | epsilon | learning rate | steps |",
             "|---|---|---|---|---|"]
    for key, name in ROWS.items():
        if key == "a":
            table.append(f"| {name} | {results['accuracy']['a']:.4f} | - | - | - |")
            continue
        report = reports[key]
        epsilon = f"{report['epsilon']:.3f}" if report.get("epsilon") else "inf (non-private)"
        table.append(f"| {name} | {results['accuracy'][key]:.4f} | {epsilon} | "
                     f"{report['learning_rate']:g} | {report['logical_steps']} |")
    table += ["", "| step (m = %d) | ms (interleaved) | peak RSS growth MiB (own process) "
              "| trained weights |"
              % results["micro_batch_size"], "|---|---|---|---|"]
    for name, step in results["steps"].items():
        table.append(f"| {name} | {step['step_s'] * 1000:.0f} | {step['peak_rss_mib']:.0f} | "
                     f"{step['trainable_parameters']:,} |")
    targets = results["targets"]
    table += ["", f"best DP / non-private continued: {targets['best_dp_over_non_private']:.3f}; "
              f"DP LoRA step / non-private LoRA step: "
              f"{targets['dp_lora_step_over_non_private_lora']:.2f}; DP full / non-private "
              f"full: {targets['dp_full_step_over_non_private_full']:.2f}"]
    return "\n".join(table)


if __name__ == "__main__":
    main()
