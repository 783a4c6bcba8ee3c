"""What a run tells: metrics.jsonl and wandb with each step's time and MFU (`metrics`, `mfu`), the same numbers
as TensorBoard scalars (`tensorboard`), the launches record, the libraries' own log, profiling, the curves
(`plot`), a run's own files read back (`run_files`) and its training log (`run_report`).

May import: core, config, model, parallel, data, checkpoint, plan, compile.
"""
