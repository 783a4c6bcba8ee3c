"""One-off experiments, kept for the record of the tables they wrote into BENCHMARKS.md: data order, document
masks and their attention on a GPU, precision, length extrapolation, warmup-stable-decay, weight averaging,
staged context. Each still runs (the suite runs it small), so its record can be made again."""
