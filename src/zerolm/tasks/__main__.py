"""`python -m zerolm.tasks`: write the shipped tasks' jsonl files again (the same bytes: zerolm.tasks.build)."""

from zerolm.tasks import build

for task, path in build().items():
    print(f"{task}: {path} ({sum(1 for _ in path.open())} items)")
