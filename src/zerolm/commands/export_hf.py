"""`zerolm export-hf --checkpoint DIR --out OUT`: a checkpoint as a Hugging Face model directory
(zerolm.export): GPT-2's layout for learned positions, MPT's for ALiBi (zerolm.hf_layouts)."""

from __future__ import annotations

import argparse
from pathlib import Path

from zerolm.errors import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--checkpoint", required=True, metavar="DIR",
                        help="a run's checkpoint directory (its newest intact step) or one step's directory")
    parser.add_argument("--out", required=True, metavar="OUT", help="the model directory to write (a local path or gs://)")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    parser.add_argument("--tokenizer", default=None, metavar="FILE",
                        help="the run's tokenizer file, if its dataset is not where the checkpoint says")
    return parser


def run(args: argparse.Namespace) -> int:
    import jax

    from zerolm import restored
    from zerolm.export import export
    from zerolm.hf_layouts import layout_for
    from zerolm.storage import check, is_remote, path

    out = path(args.out) if is_remote(args.out) else Path(args.out)
    check(args.out, "--out")
    check(args.checkpoint, "--checkpoint")
    if out.exists() and not args.overwrite:  # before reading the checkpoint
        raise UsageError(f"--out: {out} already exists (pass --overwrite to replace it)")
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out: {out} is a file, not a model directory")
    model_run = restored.load(args.checkpoint, jax.local_devices()[:1])
    tokenizer = model_run.tokenizer(args.tokenizer)
    layout = layout_for(model_run.model.cfg)
    export(model_run, tokenizer, out, overwrite=args.overwrite)
    local = "LOCAL_DIR" if is_remote(out) else str(out)
    print(f"exported step {model_run.step} of {model_run.where.parent} to {out}: load it with "
          f"transformers.{layout.architecture}.from_pretrained({local!r})"
          + (f" after copying it to a local directory (`gcloud storage cp -r {out} LOCAL_DIR`): transformers reads "
             "no gs://" if local != str(out) else ""))
    return 0
