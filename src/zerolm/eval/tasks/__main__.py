"""`python -m zerolm.eval.tasks`: write the shipped tasks' jsonl files again (the same bytes: zerolm.eval.tasks.build)."""

from zerolm.eval.tasks import build

for task, path in build().items():
    print(f"{task}: {path} ({sum(1 for _ in path.open())} items)")
