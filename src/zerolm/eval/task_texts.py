"""A task's documents as the text a contamination scan looks for (zerolm.data.contamination), and the
tasks' n-grams built from them.

A task that says what to look for says it in its YAML, as lm-evaluation-harness's own decontamination
reads it: with `should_decontaminate: true`, each document's `doc_to_decontamination_query` (the prompt,
`doc_to_text`, where it names none). Any other task's document is its prompt and its target, as the
harness renders them for scoring: `doc_to_text`, the target delimiter, then the target (for a
multiple-choice task, the right choice's text). The documents are the task's evaluation split
(its test split, else its validation split), every one of them.
"""

from __future__ import annotations

from typing import Any

from zerolm.data.ngrams import NgramSet
from zerolm.eval import downstream

COMMAND_LINE = downstream.Keys()  # the flags' names in errors: --tasks, --include-path, --download


def document_text(task: Any, doc: Any) -> str:
    """One document of a harness task as the text to look for (module docstring)."""
    if task.should_decontaminate():
        return str(task.doc_to_decontamination_query(doc))
    prompt = task.doc_to_text(doc)
    target = task.doc_to_target(doc)
    if task.config.doc_to_choice is not None and isinstance(target, int):
        target = task.doc_to_choice(doc)[target]
    if isinstance(target, list):  # several acceptable targets: the first, as the harness scores it
        target = target[0] if target else ""
    delimiter = task.config.target_delimiter if prompt else ""
    return f"{prompt if isinstance(prompt, str) else ''}{delimiter}{target}"


def task_texts(names: list[str], include_path: str | None = None, download: bool = False,
               keys: downstream.Keys = COMMAND_LINE) -> dict[str, list[str]]:
    """Each named task's documents' texts, in the task's order (a group's: each of its tasks'); TaskError or
    UsageError, one line, for an unknown task or one whose data is not here."""
    manager = downstream.prepare(names, include_path, download, keys)
    with downstream.no_progress_bars():
        tasks = manager.load(names)["tasks"]
    return {name: [document_text(task, doc) for doc in task.eval_docs] for name, task in tasks.items()}


def task_ngrams(names: list[str], n: int, include_path: str | None = None, download: bool = False,
                keys: downstream.Keys = COMMAND_LINE) -> NgramSet:
    """The named tasks' n-grams (zerolm.data.ngrams), ready to look for in training text."""
    return NgramSet.build(task_texts(names, include_path, download, keys), n)
