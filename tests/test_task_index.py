"""The harness's index of its own tasks, kept in zerolm's cache (zerolm.eval.task_index): the same index the
harness builds, read back instead of rebuilt, built again when a task file changes, and a damaged cache is
rebuilt, not an error."""

import os

import pytest

pytest.importorskip("lm_eval")

TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files: data.jsonl
output_type: loglikelihood
test_split: train
doc_to_text: "{{{{text}}}}"
doc_to_target: " x"
tag: {tag}
"""


def entries(index) -> dict:
    return {name: (e.kind.name, str(e.yaml_path) if e.yaml_path else None, sorted(e.tags)) for name, e in index.items()}


def counting_build(calls: list):
    from lm_eval.tasks._index import TaskIndex

    build = TaskIndex.build

    def counted(paths, **kw):
        calls.extend(map(str, paths))
        return build(paths, **kw)
    return counted


def test_the_harness_index_from_the_cache_is_the_one_it_builds_and_is_not_rebuilt(tmp_path, monkeypatch):
    from lm_eval.tasks._index import TaskIndex

    from zerolm.eval import downstream, task_index

    monkeypatch.setenv("ZEROLM_CACHE", str(tmp_path))
    harness = task_index.harness_directory()
    manager = downstream.task_manager_class()
    calls: list[str] = []
    with monkeypatch.context() as m:
        m.setattr(TaskIndex, "build", staticmethod(counting_build(calls)))
        built = manager()  # no cache yet: the harness's own build, written to the cache
        assert calls == [str(harness)] and list((tmp_path / "lm-eval").glob("task-index-*.json"))
        read = manager(include_path=str(downstream_tasks()))
    assert calls == [str(harness), str(downstream_tasks())]  # the second: only zerolm's own directory read
    assert len(built.all_subtasks) > 10_000
    assert entries(built.task_index) == {k: v for k, v in entries(read.task_index).items() if k in built.task_index}
    ours = set(read.task_index) - set(built.task_index)
    assert ours == {"zerolm_cloze", "zerolm_choice", "zerolm_text"}
    assert (built.all_groups, built.all_tags) == (read.all_groups, read.all_tags)
    assert read.all_subtasks == sorted({*built.all_subtasks, *ours})


def downstream_tasks():
    from zerolm.eval.tasks import DIRECTORY

    return DIRECTORY


def test_a_changed_task_file_rebuilds_the_index_and_a_damaged_cache_is_rebuilt(tmp_path, monkeypatch):
    from lm_eval.tasks._index import TaskIndex

    from zerolm.eval import task_index

    monkeypatch.setenv("ZEROLM_CACHE", str(tmp_path / "cache"))
    root = tmp_path / "tasks"
    (root / "sub").mkdir(parents=True)
    (root / "a.yaml").write_text(TASK.format(name="task_a", tag="letters"))
    (root / "sub" / "b.yaml").write_text(TASK.format(name="task_b", tag="letters"))
    calls: list[str] = []
    build = counting_build(calls)
    built = task_index.cached_index(root, build)
    assert entries(built) == entries(TaskIndex.build([root]))
    assert set(built) == {"task_a", "task_b", "letters"} and built["letters"].tags == {"task_a", "task_b"}
    assert entries(task_index.cached_index(root, build)) == entries(built) and len(calls) == 1  # read back

    (root / "sub" / "b.yaml").write_text(TASK.format(name="task_c", tag="letters"))  # a task renamed
    again = task_index.cached_index(root, build)
    assert len(calls) == 2 and set(again) == {"task_a", "task_c", "letters"}

    for cache in (tmp_path / "cache" / "lm-eval").glob("task-index-*.json"):
        cache.write_text('[{"name": "task_a"')  # cut short
    assert entries(task_index.cached_index(root, build)) == entries(again) and len(calls) == 3


def test_an_unwritable_cache_still_gives_the_index(tmp_path, monkeypatch):
    from zerolm.eval import task_index

    (tmp_path / "file").write_text("")
    monkeypatch.setenv("ZEROLM_CACHE", str(tmp_path / "file" / "cache"))  # under a file: nothing can be made there
    root = tmp_path / "tasks"
    root.mkdir()
    (root / "a.yaml").write_text(TASK.format(name="task_a", tag="letters"))
    calls: list[str] = []
    assert set(task_index.cached_index(root, counting_build(calls))) == {"task_a", "letters"}
    assert not os.path.exists(tmp_path / "file" / "cache")
