"""BENCHMARKS.md's first table ("Where zerolm stands") and its figures, drawn from the recorded results alone.

    python -m benchmarks.tools.figures                                   # docs/figures/*.png
    python -m benchmarks.tools.figures --write BENCHMARKS.md README.md   # and the tables between their markers
    python -m benchmarks.tools.figures --out /tmp/figures                # the figures elsewhere

Every number comes from benchmarks/results/*.json, each file holding the command, machine and date that measured
it and where in BENCHMARKS.md its table is; nothing here is typed in by hand but the words. A new measurement goes
into its JSON file (its older rows marked superseded), and this redraws the figures and rewrites the tables.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from benchmarks.lib import REPO
from benchmarks.lib.markdown import write_block
from benchmarks.lib.results import current, load

FIGURES = REPO / "docs" / "figures"
BEGIN, END = "<!-- standing:begin -->", "<!-- standing:end -->"
ZEROLM, PEER = "#1f77b4", "#ff7f0e"


# --- the figures ------------------------------------------------------------------------------------------------

def pytorch_data(train: dict, torch: dict) -> dict:
    """zerolm's current rows beside PyTorch's at the same config and micro-batch."""
    mine = current(train)
    pairs = [(t, mine[(t["config"], t["micro_batch"])]) for t in torch["rows"] if (t["config"], t["micro_batch"]) in mine]
    return {"labels": [f"{t['config']}, micro-batch {t['micro_batch']}" for t, _ in pairs],
            "zerolm_tokens_per_s": [z["tokens_per_s"] for _, z in pairs], "pytorch_tokens_per_s": [t["tokens_per_s"] for t, _ in pairs],
            "zerolm_mfu": [z["mfu"] for _, z in pairs], "pytorch_mfu": [t["mfu"] for t, _ in pairs],
            "zerolm_peak_gib": [z["peak_gib"] for _, z in pairs], "pytorch_peak_gib": [t["peak_gib"] for t, _ in pairs],
            "zerolm_dates": sorted({z["date"] for _, z in pairs}), "pytorch_date": torch["date"]}


def maxtext_data(maxtext: dict) -> dict:
    rows = maxtext["rows"]
    return {"labels": [f"{r['who']}: {r['plan']}" for r in rows], "who": [r["who"] for r in rows],
            "flops_per_token": [r["flops_per_token"] for r in rows], "collective_gb": [r["collective_gb"] for r in rows],
            "peak_gib": [r["peak_gib"] for r in rows]}


def serve_data(serve: dict) -> dict:
    lines = {}
    for r in serve["rows"]:
        lines.setdefault(f"{r['server']}, {r['answers']}", []).append((r["clients"], r["tokens_per_s"]))
    return lines


def _bars(ax, labels, series, title, fmt):
    import numpy as np

    x, width = np.arange(len(labels)), 0.8 / len(series)
    for i, (name, values, color, notes) in enumerate(series):
        bars = ax.bar(x + (i - (len(series) - 1) / 2) * width, values, width, label=name, color=color)
        for bar, note in zip(bars, notes, strict=True):
            ax.annotate(note, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.yaxis.set_major_formatter(fmt)


def pytorch_figure(train: dict, torch: dict):
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    d = pytorch_data(train, torch)
    fig, (speed, memory) = plt.subplots(1, 2, figsize=(11, 4.4))
    _bars(speed, d["labels"], [
        ("zerolm", [100 * m for m in d["zerolm_mfu"]], ZEROLM, [f"{v / 1e3:,.1f}k tok/s" for v in d["zerolm_tokens_per_s"]]),
        ("PyTorch (torch.compile)", [100 * m for m in d["pytorch_mfu"]], PEER,
         [f"{v / 1e3:,.1f}k tok/s" for v in d["pytorch_tokens_per_s"]])],
        "MFU on one H100, tokens/s above each bar (higher is better)", FuncFormatter(lambda v, _: f"{v:.0f}%"))
    _bars(memory, d["labels"], [
        ("zerolm", d["zerolm_peak_gib"], ZEROLM, [f"{g:.1f}" for g in d["zerolm_peak_gib"]]),
        ("PyTorch (torch.compile)", d["pytorch_peak_gib"], PEER, [f"{g:.1f}" for g in d["pytorch_peak_gib"]])],
        "peak memory, GiB (lower is better)", FuncFormatter(lambda v, _: f"{v:.0f}"))
    speed.legend(fontsize=8, loc="lower right")
    fig.text(0.01, 0.01, "One H100 80GB SXM, seq_len 2048, 2 accumulation steps, no remat. zerolm: benchmarks/measure/train_mfu.py, "
             f"{', '.join(d['zerolm_dates'])};\nPyTorch: benchmarks/measure/torch_gpt.py, {d['pytorch_date']}. Two machines "
             "of the same kind, not one card in turn (benchmarks/measure/gpu_session.sh side has not run on a GPU yet).",
             fontsize=7)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig, d


def maxtext_figure(maxtext: dict):
    import matplotlib.pyplot as plt

    d = maxtext_data(maxtext)
    colors = [ZEROLM if w == "zerolm" else PEER for w in d["who"]]
    fig, (flops, sent) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, values, title, fmt in ((flops, [f / 1e9 for f in d["flops_per_token"]], "matmul GFLOPs per token", "{:.2f}"),
                                   (sent, d["collective_gb"], "collective GB per device per step", "{:.2f}")):
        bars = ax.barh(range(len(values)), values, color=colors)
        for bar, v in zip(bars, values, strict=True):
            ax.annotate(fmt.format(v), (bar.get_width(), bar.get_y() + bar.get_height() / 2), va="center", fontsize=7)
        ax.set_title(f"{title} (lower is better)", fontsize=10)
        ax.margins(x=0.15)
    flops.set_yticks(range(len(d["labels"])), d["labels"], fontsize=8)
    flops.invert_yaxis()
    fig.text(0.01, 0.01, f"1.3B on a TPU v3-32, compiled only (no TPU): {maxtext['machine']}, {maxtext['date']};\n"
             f"{maxtext['command']}. MaxText's figures are quoted from its own compile by the same libtpu.", fontsize=7)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig, d


def serve_figure(serve: dict):
    import matplotlib.pyplot as plt

    d = serve_data(serve)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, points in d.items():
        clients, tps = zip(*points, strict=True)
        ax.plot(clients, tps, marker="o", label=name, color=ZEROLM if name.startswith("batched") else PEER,
                linestyle="-" if "streamed" in name else "--")
    ax.set_xscale("log", base=2)
    ax.set_xticks([1, 8, 32], ["1", "8", "32"])
    ax.set_xlabel("clients at once")
    ax.set_title("zerolm serve under load: batched, and held to one row at a time", fontsize=10)
    ax.set_ylabel("completion tokens/s (higher is better)", fontsize=8)
    ax.legend(fontsize=8)
    fig.text(0.01, 0.01, f"The tiny model on one H100 (16 CPU cores for the clients), {serve['date']}:\n{serve['command']}",
             fontsize=6)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig, d


FIGURES_DRAWN = {"h100_pytorch.png": (pytorch_figure, ("train_h100", "torch_h100")),
                 "maxtext_v3-32.png": (maxtext_figure, ("maxtext_v3-32",)),
                 "serve_h100.png": (serve_figure, ("serve_h100",))}


def draw(out: Path) -> dict[str, dict]:
    """Every figure into `out`; what each plotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    plotted = {}
    for name, (figure, sources) in FIGURES_DRAWN.items():
        fig, data = figure(*map(load, sources))
        fig.savefig(out / name, dpi=110, metadata={"Software": None})  # no version stamp: a redraw changes no byte
        plt.close(fig)
        plotted[name] = data
    return plotted


# --- the table --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Row:
    claim: str
    zerolm: str
    peer: str
    ratio: str
    where: str
    kind: str  # measured | compiled
    section: str  # a heading of BENCHMARKS.md
    front: bool = False  # one of the README's rows


def _n(v: float) -> str:
    return f"{v:,.0f}"


def rows() -> list[Row]:
    train, torch, maxtext, serve = (load(n) for n in ("train_h100", "torch_h100", "maxtext_v3-32", "serve_h100"))
    zero, data = load("zero_step"), load("data_pipeline")
    mine, theirs = current(train), {(t["config"], t["micro_batch"]): t for t in torch["rows"]}
    h100 = f"H100; zerolm {mine[('125m', 16)]['date']}, PyTorch {torch['date']} (another card)"
    pytorch = "Against PyTorch on one GPU"
    out = []
    for config, micro, name in (("125m", 16, "125M"), ("1_3b", 8, "1.3B")):
        z, t = mine[(config, micro)], theirs[(config, micro)]
        out.append(Row(f"Training tokens/s (MFU), {name}, micro-batch {micro}", f"{_n(z['tokens_per_s'])} ({z['mfu']:.1%})",
                       f"PyTorch, torch.compile: {_n(t['tokens_per_s'])} ({t['mfu']:.1%})",
                       f"{z['tokens_per_s'] / t['tokens_per_s']:.2f}", h100, "measured", pytorch, front=True))
    for config, micro, name in (("125m", 16, "125M"), ("1_3b", 8, "1.3B")):
        z, t = mine[(config, micro)], theirs[(config, micro)]
        out.append(Row(f"Peak memory, {name}, micro-batch {micro} (lower is better)", f"{z['peak_gib']:.1f} GiB",
                       f"PyTorch: {t['peak_gib']:.1f} GiB", f"{z['peak_gib'] / t['peak_gib']:.2f}", h100, "measured",
                       pytorch, front=config == "1_3b"))
    memory, speed = zero["runs"]
    state = {r["variant"]: r["state_mib"] for r in memory["rows"]}
    out.append(Row("State per device, 125M on 8 devices, ZeRO-1 (lower is better)", f"{_n(state['reduce_scatter'])} MiB",
                   f"naive data parallel: {_n(state['naive'])} MiB", f"{state['reduce_scatter'] / state['naive']:.2f}",
                   f"8 CPU devices, {memory['date']}, float32", "exact bytes", "ZeRO-1 against the naive data-parallel step"))
    out.append(Row("Step time, 125M, ZeRO-1's three programs (lower is better)", "ZeRO-1 step",
                   "the naive single-jit step, same batches", f"{speed['rows'][0]['ratio']:.2f}", f"one H100, {speed['date']}",
                   "measured", "ZeRO-1 against the naive data-parallel step"))
    shipped = next(r for r in maxtext["rows"] if r.get("shipped"))
    mt = next(r for r in maxtext["rows"] if r["who"] == "MaxText" and "16 × 1" in r["plan"])
    v3 = f"TPU v3-32 by libtpu, no TPU; {maxtext['date']}"
    for claim, key, shown in (("Matmul FLOPs per token, 1.3B (lower is better)", "flops_per_token", lambda v: f"{v / 1e9:.2f} G"),
                              ("Collective bytes per device per step, 1.3B (lower is better)", "collective_gb", lambda v: f"{v:.2f} GB"),
                              ("Peak memory per device, 1.3B (lower is better)", "peak_gib", lambda v: f"{v:.2f} GiB")):
        out.append(Row(claim, f"{shown(shipped[key])} (as shipped)", f"MaxText FSDP, micro-batch 16, full remat: {shown(mt[key])}",
                       f"{shipped[key] / mt[key]:.2f}", v3, "compiled", "zerolm beside MaxText", front=key == "collective_gb"))
    slices = load("multislice_tpu")
    mine_dcn, flat = (next(r for r in slices["rows"] if (r["config"], r["target"], r["slices"], r["accum_steps"]) ==
                           ("1_3b", "v5e-64", 2, 1) and r["layout"].startswith(who)) for who in ("zerolm", "ZeRO over"))
    out.append(Row("Bytes per device per step between TPU slices (DCN), 1.3B on 2 slices (lower is better)",
                   f"{mine_dcn['dcn_gb']:.3f} GB (`mesh.slices`)", f"one ZeRO over every device: {flat['dcn_gb']:.3f} GB",
                   f"{mine_dcn['dcn_gb'] / flat['dcn_gb']:.2f}", f"2 × TPU v5e-64 by libtpu, no TPU; {slices['date']}",
                   "compiled", "Several TPU slices (Multislice): what crosses the data-center network"))
    out.append(Row("Validation loss against nanoGPT on the same tokens", "not measured", "—", "—", "—", "—", ""))
    by = {(r["server"], r["answers"], r["clients"]): r["tokens_per_s"] for r in serve["rows"]}
    out.append(Row("Serving, completion tokens/s at 8 clients (streamed)", _n(by[("batched", "streamed", 8)]),
                   f"one client: {_n(by[('batched', 'streamed', 1)])}",
                   f"{by[('batched', 'streamed', 8)] / by[('batched', 'streamed', 1)]:.1f} (whole answers "
                   f"{by[('batched', 'whole', 8)] / by[('batched', 'whole', 1)]:.1f})", f"one H100, the tiny model, {serve['date']}",
                   "measured", "Serving under load"))
    prepare, loader, scan = data["runs"]
    p = [r["tokens_per_s"] for r in prepare["rows"]]
    out.append(Row("`zerolm prepare`, tokens/s", _n(p[0]), f"its tokenizer alone: {_n(p[1])}", f"{p[0] / p[1]:.2f}",
                   f"2 CPU cores, {prepare['date']}", "measured", "Preparing a corpus"))
    gs, _, need = (r["samples_per_s"] for r in loader["rows"])
    out.append(Row("Loader from gs://, samples/s", _n(gs), f"a v3-32 host's need at 125M: {need}", f"{gs / need:.0f}",
                   f"8 CPU devices, a GCS server on the machine, {loader['date']}", "measured", "Data order"))
    largest = max(scan["rows"], key=lambda r: r["corpus_mib"])
    out.append(Row(f"Contamination scan, tokens/s per core ({largest['corpus_mib']} MiB corpus)",
                   _n(largest["tokens_per_s_per_core"]), "—", "—", f"2 CPU cores, {scan['date']}", "measured",
                   "Contamination scan"))
    return out


def slug(heading: str) -> str:
    """A markdown heading's anchor as GitHub makes it."""
    kept = "".join(c for c in heading.strip().lower() if c.isalnum() or c in "-_ ")
    return kept.replace(" ", "-")


def table(rows: list[Row], benchmarks: str = "") -> list[str]:
    """The rows as markdown; `benchmarks` is the path to BENCHMARKS.md from the file they go into ("" inside it)."""
    lines = ["| what a user weighs | zerolm | against | zerolm ÷ it | machine, date | kind | section |",
             "|---|---:|---|---:|---|---|---|"]
    for r in rows:
        link = f"[{r.section}]({benchmarks}#{slug(r.section)})" if r.section else "—"
        lines.append(f"| {r.claim} | {r.zerolm} | {r.peer} | {r.ratio} | {r.where} | {r.kind} | {link} |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=FIGURES, help="where the figures go (default: docs/figures)")
    p.add_argument("--write", type=Path, nargs="*", default=[], metavar="FILE.md",
                   help="rewrite the table between its markers: BENCHMARKS.md gets every row, any other file the "
                        "README's (front) rows, linking into BENCHMARKS.md")
    args = p.parse_args()
    for name in draw(args.out):
        print(args.out / name)
    every = rows()
    for path in args.write:
        inside = path.name == "BENCHMARKS.md"
        chosen = every if inside else [r for r in every if r.front]
        write_block(path, BEGIN, END, table(chosen, "" if inside else "BENCHMARKS.md"))
        print(f"{path}: {len(chosen)} rows")
    if not args.write:
        print("\n".join(table(every)))


if __name__ == "__main__":
    main()
