"""zerolm: GPT-style decoder-only language models (GPT-2, ALiBi and Llama layouts) pretrained in JAX, the optimizer
state (and at ZeRO stages 2 and 3 the gradients and parameters) sharded over the data-parallel devices, on
one CPU, one GPU, a GPU cluster or a multi-host TPU slice; evaluated and exported.

The package face: its version, and nothing it imports. The concerns are its packages, lowest first (each
package imports only from those before it: docs/layout.md, tests/test_layout.py): core, config, model,
parallel, data, checkpoint, plan, compile, observe, eval, hf, train, commands; `zerolm.cli` and
`zerolm.lm_eval_cli` are the entry points above them.
"""

__version__ = "0.1.0"
