"""`zerolm export-hf --checkpoint DIR --out OUT`: a checkpoint as a Hugging Face model directory.

The model's settings pick transformers' architecture (zerolm.hf.layouts, one name table per layout):
learned positions export to `GPT2LMHeadModel` (a bias-free model with zero biases), ALiBi ones to
`MptForCausalLM`, rotary ones to `LlamaForCausalLM` (RMSNorms, SwiGLU), `GPTNeoXForCausalLM` (LayerNorms, a GELU
MLP; parallel residual or not) or `GPTJForCausalLM` (the parallel block with a shared norm). OUT holds `config.json`
(that architecture's: the model's norms, embeddings and vocabulary, and its context: the trained one, or for ALiBi a
longer one, `exported_context`), `model.safetensors` (float32, transformers' names; a tied output layer is
`wte`, so `lm_head.weight` is not stored) and the tokenizer as
`tokenizer.json` with `tokenizer_config.json`, so that

    AutoModelForCausalLM.from_pretrained(OUT), AutoTokenizer.from_pretrained(OUT)

load it without missing or unexpected weights, and give zerolm's logits. A tiktoken tokenizer is
converted to an equivalent byte-level BPE `tokenizer.json` (GPT-2's split regex). The directory is
written beside OUT and renamed into place: an existing OUT is refused (or, with --overwrite, replaced
only once the new one is complete). OUT may be a gs:// URL: the directory is written locally, then
uploaded with `config.json` last (and, over an older export, first deleted), so that a half-uploaded
directory never loads as a model.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from zerolm.checkpoint.errors import CheckpointError
from zerolm.config.model import ModelConfig
from zerolm.core import storage
from zerolm.data.tokenizer import EOT, GPT2_PATTERN, Tokenizer, TokenizerError
from zerolm.hf.layouts import ExportError, hf_state_dict, layout_for

# An ALiBi model's export declares this many times its trained context, unless told (`--max-seq-len`).
ALIBI_CONTEXT = 4


def hf_tokenizer(tokenizer: Tokenizer) -> tokenizers.Tokenizer:
    """The tokenizer as a Hugging Face `tokenizers` one (a tiktoken BPE is converted)."""
    if tokenizer.kind == "hf":
        return tokenizers.Tokenizer.from_str(tokenizer.file_bytes.decode())
    ranks = tokenizer._backend._mergeable_ranks
    return _from_tiktoken(ranks)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (what byte-level BPE vocabularies hold)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, n = printable[:], 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, map(chr, chars), strict=True))


def _from_tiktoken(ranks: dict[bytes, int]) -> tokenizers.Tokenizer:
    """A byte-level BPE equal to a tiktoken encoding: each token's merge is the split of it into two
    tokens of lower rank, ordered by the token's rank."""
    table = _bytes_to_unicode()
    text = lambda b: "".join(table[x] for x in b)  # noqa: E731
    vocab = {text(token): rank for token, rank in ranks.items()}
    merges = []
    for token, rank in ranks.items():
        splits = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks]
        if splits:
            left, right = min(splits, key=lambda lr: (ranks[lr[0]], ranks[lr[1]]))
            merges.append((rank, text(left), text(right)))
    bpe = models.BPE(vocab, [(a, b) for _, a, b in sorted(merges)], fuse_unk=False)
    tok = tokenizers.Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(GPT2_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([tokenizers.AddedToken(EOT, special=True)])
    if tok.token_to_id(EOT) != len(ranks):
        raise TokenizerError(f"tokenizer: {EOT} would get id {tok.token_to_id(EOT)}, not {len(ranks)} as in tiktoken")
    return tok


def exported_context(cfg: ModelConfig, asked: int | None = None) -> int:
    """The context the export's config declares (GPT-2's n_positions, MPT's max_seq_len, Llama's
    max_position_embeddings, the tokenizer's model_max_length): the trained one, or for an ALiBi model `asked`
    or ALIBI_CONTEXT times the trained one, since ALiBi runs past it (transformers' MPT builds its bias up to
    max_seq_len and fails beyond, where `zerolm sample` goes on). ExportError naming --max-seq-len otherwise."""
    if cfg.position != "alibi":
        if asked not in (None, cfg.seq_len):
            raise ExportError(f"--max-seq-len: {asked}: a model with model.position: {cfg.position} runs only within "
                              f"its trained context of {cfg.seq_len} (model.seq_len); only an ALiBi model's runs past it")
        return cfg.seq_len
    if asked is None:
        return ALIBI_CONTEXT * cfg.seq_len
    if asked < cfg.seq_len:
        raise ExportError(f"--max-seq-len: {asked} is shorter than the model's trained context of {cfg.seq_len} "
                          "(model.seq_len)")
    return asked


def export(model_run, tokenizer: Tokenizer, out, overwrite: bool = False, context: int | None = None):
    """Write the model directory `out` (a local Path or a gs:// epath); `context`: the --max-seq-len asked
    (`exported_context`)."""
    from safetensors.numpy import save_file

    if out.exists() and not overwrite:
        raise CheckpointError(f"--out: {out} already exists (pass --overwrite to replace it)")
    cfg = model_run.model.cfg
    layout = layout_for(cfg)
    declared = cfg.model_copy(update={"seq_len": exported_context(cfg, context)})
    remote = storage.is_remote(out)
    partial = Path(tempfile.mkdtemp(prefix="zerolm-export-")) if remote else out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        (partial / "config.json").write_text(json.dumps(layout.config(declared, tokenizer), indent=2) + "\n")
        save_file(hf_state_dict(model_run.params, cfg, layout), str(partial / "model.safetensors"),
                  metadata={"format": "pt", "zerolm_checkpoint": str(model_run.where)})
        hf_tokenizer(tokenizer).save(str(partial / "tokenizer.json"))
        (partial / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": declared.seq_len,
            "bos_token": tokenizer.eot_text, "eos_token": tokenizer.eot_text, "unk_token": tokenizer.eot_text,
            "add_prefix_space": False, "clean_up_tokenization_spaces": False}, indent=2) + "\n")
        (partial / "generation_config.json").write_text(json.dumps({
            "bos_token_id": tokenizer.eot_id, "eos_token_id": tokenizer.eot_id}, indent=2) + "\n")
        _as_umask_allows(partial)
        if remote:
            _upload(partial, out)
        elif out.exists():  # --overwrite: the old directory goes only once the new one is complete
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            out.rename(old)
            partial.rename(out)
            shutil.rmtree(old)
        else:
            partial.rename(out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    if remote:
        shutil.rmtree(partial, ignore_errors=True)
    return out


def _as_umask_allows(directory: Path) -> None:
    """Every file of the export with the mode a plain write gives it (safetensors writes 0600)."""
    umask = os.umask(0o022)
    os.umask(umask)
    for p in directory.iterdir():
        p.chmod(0o666 & ~umask)


def _upload(local: Path, out) -> None:
    """Upload an export to gs://, `config.json` (what makes it loadable) last; an older export there loses
    its config.json first and the files the new one lacks last."""
    old = set(storage.sizes(out)) if out.exists() else set()
    if "config.json" in old:
        (out / "config.json").unlink()
    names = sorted(p.name for p in local.iterdir())
    for name in [n for n in names if n != "config.json"] + ["config.json"]:
        (out / name).write_bytes((local / name).read_bytes())
    for name in sorted(old - set(names)):
        (out / name).unlink()
