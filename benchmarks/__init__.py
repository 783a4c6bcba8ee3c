"""zerolm's benchmarks, one program each, run from the repository root as modules:

    python -m benchmarks.measure.zero_step --config configs/tiny.yaml

`measure/`: what a user runs to measure zerolm (speed, memory, serving, data, checkpoints; PyTorch beside it);
`compiler/`: studies of the step as XLA's TPU and GPU compilers build it, on any machine, no accelerator needed;
`experiments/`: one-off experiments, kept for the record their tables in BENCHMARKS.md hold;
`tools/`: the figures, a GPU profile's summary, the test suite's CPU and its GCS server's starts;
`lib/`: what they share (and the tests with them); `results/`: recorded results as JSON, which the figures
and BENCHMARKS.md's first table are drawn from. benchmarks/README.md lists every program.
"""
