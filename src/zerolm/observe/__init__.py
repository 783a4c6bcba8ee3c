"""What a run tells: metrics.jsonl and wandb with each step's time and MFU (`metrics`, `mfu`), the launches
record, the libraries' own log, profiling, the curves (`plot`) and the run's training log
(`run_report`).

May import: core, config, model, parallel, data, checkpoint, plan, compile.
"""
