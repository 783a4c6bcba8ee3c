"""Task definitions zerolm ships for lm-evaluation-harness, built from the embedded corpus (zerolm.data.corpus),
so that `zerolm eval --tasks` and the tests run with no network:

    zerolm_cloze   LAMBADA-style: a passage's last word given the passage (loglikelihood; acc, perplexity)
    zerolm_choice  a sentence's true ending among 4 (the other 3 end other sentences; acc, acc_norm)
    zerolm_text    whole chapters (loglikelihood_rolling; word_perplexity, byte_perplexity, bits_per_byte)

Each is a harness YAML task beside this file, its data a jsonl file here too (what `python -m zerolm.eval.tasks`
writes, the same bytes every time). The corpus is the default training data, so on a model trained on it
they measure how well it learned its text, not how it generalises: a check that the evaluation works and
moves with training, not a benchmark (docs/evaluation.md names the real ones).
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

DIRECTORY = Path(__file__).parent
NAMES = ("zerolm_cloze", "zerolm_choice", "zerolm_text")
EVERY = 4  # chapters per cloze item, per choice item (offset 2)
TEXT_CHAPTERS = range(3, 1189, 30)  # zerolm_text's 40 chapters
_SENTENCE_END = re.compile(r"(?<=[.?!])\s+")


def _sentences(chapter: str) -> list[str]:
    return [s for s in _SENTENCE_END.split(chapter) if s]


def cloze_items(chapters: list[str]) -> list[dict]:
    """From every EVERY-th chapter: its sentences from the first up to 30 words at least, the last word
    stripped of its punctuation (a chapter whose word there is not a word of 3 letters or more gives none)."""
    items = []
    for chapter in chapters[::EVERY]:
        words: list[str] = []
        for sentence in _sentences(chapter):
            words += sentence.split()
            if len(words) >= 30:
                break
        last = words[-1].rstrip(".,;:?!")
        if last.isalpha() and len(last) >= 3:
            items.append({"text": " ".join([*words[:-1], last])})
    return items


def choice_items(chapters: list[str], seed: int = 47) -> list[dict]:
    """From every EVERY-th chapter (from the third): its first sentence of 12 to 24 words (short enough for a
    small model's context), cut in half; the choices its own second half and three other items' (drawn with
    `seed`), in a drawn order."""
    halves = []
    for chapter in chapters[2::EVERY]:
        sentence = next((s.split() for s in _sentences(chapter) if 12 <= len(s.split()) <= 24), None)
        if sentence is not None:
            cut = len(sentence) // 2
            halves.append((" ".join(sentence[:cut]), " " + " ".join(sentence[cut:])))
    rng, items = random.Random(seed), []
    for i, (context, ending) in enumerate(halves):
        others = rng.sample([j for j in range(len(halves)) if j != i], 3)
        endings = [ending, *(halves[j][1] for j in others)]
        rng.shuffle(endings)
        items.append({"context": context, "endings": endings, "label": endings.index(ending)})
    return items


def text_items(chapters: list[str]) -> list[dict]:
    return [{"text": chapters[i]} for i in TEXT_CHAPTERS]


def build(directory: Path = DIRECTORY) -> dict[str, Path]:
    """Write each task's jsonl into `directory`; returns the files."""
    from zerolm.data.corpus import default_documents

    chapters = default_documents()
    files = {}
    for name, items in (("zerolm_cloze", cloze_items(chapters)), ("zerolm_choice", choice_items(chapters)),
                        ("zerolm_text", text_items(chapters))):
        files[name] = directory / f"{name}.jsonl"
        files[name].write_text("".join(json.dumps(item, sort_keys=True) + "\n" for item in items))
    return files


def load(data_files: dict[str, str], **_metadata):
    """The harness's `custom_dataset` for the tasks here: their jsonl files (named relative to this
    directory) as a DatasetDict, through the harness's own json loader (datasets, nothing downloaded)."""
    import datasets

    return datasets.load_dataset("json", data_files={split: str(DIRECTORY / name) for split, name in data_files.items()})
