"""Know before you launch, by the compiler: the step compiled ahead of time for a TPU slice or a GPU on any
machine (`aot`), its HLO read (`hlo`: collectives, loops, asynchronous collectives), where its bytes go
(`bytes_moved`), every collective beside the planner's count (`collectives`), the step's time modeled from
its programs (`step_time`), the largest micro-batch that fits (`micro_batch_search`) and the fastest plan
(`fastest_plan`).

May import: core, config, model, parallel, data, checkpoint, plan.
"""
