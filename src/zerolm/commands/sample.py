"""`zerolm sample --checkpoint DIR --prompt TEXT`: continue a prompt with a checkpoint's model (zerolm.model.generate)."""

from __future__ import annotations

import argparse
import sys

from zerolm.core.errors import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--checkpoint", required=True, metavar="DIR",
                        help="a run's checkpoint directory (its newest intact step) or one step's directory")
    parser.add_argument("--prompt", default="", help="the text to continue (default: empty: start a new document)")
    parser.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="(default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy (default: %(default)s)")
    parser.add_argument("--top-k", type=int, default=0, metavar="K",
                        help="sample among the K most likely tokens; 0: all (default: %(default)s)")
    parser.add_argument("--top-p", type=float, default=1.0, metavar="P",
                        help="sample among the fewest tokens whose probability reaches P, in (0, 1]; 1: all "
                             "(default: %(default)s)")
    parser.add_argument("--typical-p", type=float, default=1.0, metavar="P",
                        help="sample among the most typical tokens (information nearest the entropy) whose "
                             "probability reaches P, in (0, 1]; 1: all (default: %(default)s)")
    parser.add_argument("--repetition-penalty", type=float, default=1.0, metavar="R",
                        help="> 1: a token already in the text is less likely; 1: none (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    parser.add_argument("--tokenizer", default=None, metavar="FILE",
                        help="the run's tokenizer file, if its dataset is not where the checkpoint says")
    return parser


def run(args: argparse.Namespace, out=None) -> int:
    import jax

    from zerolm.checkpoint import trained_model as restored
    from zerolm.config.sampling import Sampling, checked
    from zerolm.core.storage import check
    from zerolm.model.generate import generate

    out = out or sys.stdout
    if args.max_new_tokens < 0:
        raise UsageError(f"--max-new-tokens: {args.max_new_tokens} must be >= 0")
    sampling = checked({k: getattr(args, k) for k in Sampling.model_fields}, lambda field: "--" + field.replace("_", "-"))
    check(args.checkpoint, "--checkpoint")
    model_run = restored.load(args.checkpoint, jax.local_devices()[:1])
    tokenizer = model_run.tokenizer(args.tokenizer)
    prompt = tokenizer.encode(args.prompt)
    T = model_run.model.cfg.seq_len
    position = model_run.model.cfg.position
    if position != "learned" and len(prompt) + args.max_new_tokens > T:
        # ALiBi and rotary positions have no table: the context is as long as the prompt and its continuation
        model_run = model_run.at_context(len(prompt) + args.max_new_tokens, "--max-new-tokens")
        T = model_run.model.cfg.seq_len
        how = "ALiBi extrapolates" if position == "alibi" else "rotary positions past it were never trained on"
        print(f"note: past the trained context of {model_run.meta.model['seq_len']} tokens ({how})", file=sys.stderr)
    if len(prompt) >= T:
        raise UsageError(f"--prompt: {len(prompt)} tokens, but the model's context is {T} tokens "
                         f"(model.seq_len), so a prompt may have at most {T - 1}")
    if len(prompt) + args.max_new_tokens > T:
        print(f"note: the context ends after {T - len(prompt)} new tokens (model.seq_len {T})", file=sys.stderr)
    ids = generate(model_run.model, model_run.params, prompt, args.max_new_tokens, sampling, tokenizer.eot_id)
    print(tokenizer.decode(ids), file=out)
    return 0
