"""What every other package stands on: errors and the exit codes they carry, storage (local paths and gs://,
zerolm's cache directory), the accelerator table (chips, TPU slices, GPU targets and their XLA descriptions
in gpu_targets/), the JAX platforms and XLA/libtpu flags a process starts with, and Ctrl-C before a
command's own handlers.

May import: nothing of zerolm's (the package face, `zerolm`, excepted).
"""
