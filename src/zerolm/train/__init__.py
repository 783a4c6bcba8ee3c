"""One training run and what only it uses: the run top to bottom (`trainer`), opened (`opening`) and its steps
with evaluation, tasks, samples, your own hooks and checkpoints between them (`loop`), its data opened and
checked (`run_data`), what it prints before its first
step (`preflight`), stopping at one step on SIGTERM or Ctrl-C (`preemption`), JAX's persistent compilation
cache, and `zerolm launch-local`'s supervised processes.

May import: core, config, model, parallel, data, checkpoint, plan, compile, observe, eval, hf.
"""
