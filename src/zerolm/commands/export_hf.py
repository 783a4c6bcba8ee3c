"""`zerolm export-hf --checkpoint DIR --out OUT`: a checkpoint as a Hugging Face model directory
(zerolm.hf.export): GPT-2's layout for learned positions, MPT's for ALiBi, Llama's for rotary (zerolm.hf.layouts)."""

from __future__ import annotations

import argparse
from pathlib import Path

from zerolm.core.errors import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--checkpoint", required=True, metavar="DIR",
                        help="a run's checkpoint directory (its newest intact step) or one step's directory")
    parser.add_argument("--out", required=True, metavar="OUT", help="the model directory to write (a local path or gs://)")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    parser.add_argument("--tokenizer", default=None, metavar="FILE",
                        help="the run's tokenizer file, if its dataset is not where the checkpoint says")
    parser.add_argument("--max-seq-len", type=int, default=None, metavar="N",
                        help="the context the export declares (MPT's max_seq_len: transformers generates up to it); "
                             "only an ALiBi model's may exceed the trained model.seq_len (default: 4 × model.seq_len "
                             "for ALiBi, model.seq_len otherwise)")
    return parser


def run(args: argparse.Namespace) -> int:
    import jax

    from zerolm.checkpoint import trained_model as restored
    from zerolm.core.storage import check, is_remote, path
    from zerolm.hf.export import ALIBI_CONTEXT, export, exported_context
    from zerolm.hf.layouts import layout_for

    out = path(args.out) if is_remote(args.out) else Path(args.out)
    check(args.out, "--out")
    check(args.checkpoint, "--checkpoint")
    if out.exists() and not args.overwrite:  # before reading the checkpoint
        raise UsageError(f"--out: {out} already exists (pass --overwrite to replace it)")
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out: {out} is a file, not a model directory")
    model_run = restored.load(args.checkpoint, jax.local_devices()[:1])
    tokenizer = model_run.tokenizer(args.tokenizer)
    cfg = model_run.model.cfg
    layout = layout_for(cfg)
    context = exported_context(cfg, args.max_seq_len)
    export(model_run, tokenizer, out, overwrite=args.overwrite, context=context)
    local = "LOCAL_DIR" if is_remote(out) else str(out)
    print(f"exported step {model_run.step} of {model_run.where.parent} to {out}: load it with "
          f"transformers.{layout.architecture}.from_pretrained({local!r})"
          + (f" after copying it to a local directory (`gcloud storage cp -r {out} LOCAL_DIR`): transformers reads "
             "no gs://" if local != str(out) else ""))
    if cfg.position == "alibi":
        times = f"{ALIBI_CONTEXT} × the trained" if args.max_seq_len is None else "--max-seq-len; the trained context is"
        print(f"its context: {context} tokens ({times} {cfg.seq_len}): ALiBi runs past the trained context, and "
              "transformers' MPT generates up to its max_seq_len (--max-seq-len sets it)")
    if cfg.document_mask:
        print("model.document_mask: true: transformers attends across documents in a sequence (it has no such "
              "mask); give it one document per sequence for zerolm's numbers")
    return 0
