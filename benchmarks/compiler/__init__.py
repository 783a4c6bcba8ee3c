"""Studies of the training step as XLA's TPU and GPU compilers build it, ahead of time on any machine (no TPU or
GPU needed), and as the CPU backend runs it: memory, bytes moved, collectives, compile time, the planner against
the compilers, the fastest plan that fits and MaxText beside it, the step-time models."""
