"""Evaluation: the held-out loss (`heldout`), the lm-evaluation-harness backend on zerolm's mesh (`harness`),
downstream tasks run offline and their results (`downstream`), the harness's task index kept in zerolm's cache
(`task_index`), and the tasks zerolm ships (`tasks/`, built from the embedded corpus).

May import: core, config, model, parallel, data, checkpoint, plan, compile, observe.
"""
