"""DP fine-tuning of a public BERT as a classifier: the label as a word at [MASK], beside its twin.

Most teams start from a model pretrained on public text and fine-tune it on
their private data. This example runs `tf-megadp finetune` twice on the
same task from the same public start, and prints both test accuracies:

1. the public BERT: `--public-model` (a `model.keras` of `tf-megadp
   public-model`, or of a non-private `tf-megadp pretrain` run on the public
   corpus, with its vocab.txt beside it); by default `tf-megadp
   public-model`'s cached model, built here if it is missing (nothing is
   downloaded);
2. the task: labelled JSONL (`--train`, `--test`), by default the job's
   default task (which package a docstring summary comes from: scipy,
   scikit-learn or matplotlib; names removed; none of them in the public
   pretraining corpus);
3. fine-tuning by prompt (Li et al. 2022): each text in a template with a
   [MASK] slot, the label a word predicted there by the pretrained MLM head,
   with DP-SGD on Poisson-sampled batches, sigma calibrated to
   `--target-epsilon`, and then the non-private twin on the same batches;
4. `--objective head` runs a `BertTextClassifier` head on [CLS] instead
   (docs/results.md, section 6, "Private fine-tuning", says what each
   gives: at this CPU scale the head does as well as the prompt).

    python examples/finetune_classifier.py                         # the default task
    python examples/finetune_classifier.py --train reviews.jsonl --label-words bad,good

What it printed is in docs/results.md (section 6, "Private fine-tuning"),
with the command that regenerates it.
"""

import argparse
import os
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--public-model", metavar="PATH",
                        help="the public BERT's model.keras (default: tf-megadp public-model's)")
    parser.add_argument("--train", help="labelled JSONL or CSV (default: the default task)")
    parser.add_argument("--test", help="its test file (default: a held-out share of --train)")
    parser.add_argument("--label-words", help="prompt: one word per label, comma-separated")
    parser.add_argument("--objective", choices=["prompt", "head"], default="prompt")
    parser.add_argument("--lora-rank", type=int)
    parser.add_argument("--target-epsilon", type=float, default=8.0)
    parser.add_argument("--epochs", type=float, help="passes over the data (default: the job's)")
    parser.add_argument("--sequence-length", type=int,
                        help="tokens per example, at most the public model's positions "
                             "(default: the job's)")
    parser.add_argument("--output-dir", help="where the two runs go (default: a new temp folder)")
    args = parser.parse_args(argv)

    from tf_megadp.jobs.finetune.config import FinetuneConfig
    from tf_megadp.jobs.finetune.run import run_finetuning

    public = args.public_model or _public_model()
    folder = args.output_dir or tempfile.mkdtemp(prefix="finetune-")
    common = dict(train=args.train, test=args.test, init_from=public, objective=args.objective,
                  lora_rank=args.lora_rank, verbose=0,
                  label_words=args.label_words.split(",") if args.label_words else None,
                  **({} if args.epochs is None else {"epochs": args.epochs}),
                  **({} if args.sequence_length is None
                     else {"sequence_length": args.sequence_length}))
    reports = {
        "dp": run_finetuning(FinetuneConfig(
            **common, target_epsilon=args.target_epsilon,
            output_dir=os.path.join(folder, "dp")), log=lambda *_: None),
        "non_private": run_finetuning(FinetuneConfig(
            **common, non_private=True, target_epsilon=None,
            output_dir=os.path.join(folder, "non-private")), log=lambda *_: None),
    }
    dp, twin = reports["dp"], reports["non_private"]
    print(f"task: {dp['task']['description']}")
    print(f"majority class          {dp['majority_class_accuracy']:.4f}")
    print(f"non-private {args.objective:<11} {twin['test_accuracy']:.4f}")
    print(f"DP {args.objective:<20} {dp['test_accuracy']:.4f}   epsilon {dp['epsilon']:.2f} "
          f"(delta {dp['delta']:.2g}), {dp['trains']}; {dp['test_accuracy'] / twin['test_accuracy']:.2f}x "
          "the non-private twin")
    print(f"runs in {folder}")
    return reports


def _public_model() -> str:
    """The cached public BERT of `tf-megadp public-model` (built here if missing)."""
    from tf_megadp.jobs.bert.public_model import public_model

    return public_model(log=lambda line: print(line, file=sys.stderr))


if __name__ == "__main__":
    main()
