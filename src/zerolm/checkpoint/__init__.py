"""A run's state on storage: orbax checkpoints (save, verify, restore onto any mesh: `store`), the record each
carries (`meta`), what a run may continue or start from (`compatible`), the `zerolm checkpoints` table
(`listing`), what is moved aside instead of deleted (`set_aside`), where a run starts (`resume`), one run per
directory (`run_lock`), a fresh run's parameters from a checkpoint (`warm_start`), a decay branch's start from
another run's checkpoint (`branch`), a deeper model from a trained one (`grow`), the mean of a run's checkpoints
or of its moving average (`average`), and a trained model read onto this machine (`trained_model`).

May import: core, config, model, parallel, data.
"""
