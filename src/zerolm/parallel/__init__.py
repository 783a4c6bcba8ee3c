"""The training step on a mesh: the mesh and its axis names, every sharding (`sharding.Table`), the three
programs of a ZeRO step at stages 1-3 (`zero`, `sharded_grad`), the reduce-scatter algorithms, the
optimizer, the step built from a config (`build`: the one way to build and compile it), and the naive
single-jit baseline it is measured against.

May import: core, config, model.
"""
