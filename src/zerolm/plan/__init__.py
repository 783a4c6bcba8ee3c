"""Know before you launch, by formula: per-device memory of ZeRO stages 0-3, the micro-batch that fits, the
step time and the collectives' bytes, for a config or a parameter count, on a device preset.

The planner, along its seams:
  spec.py         what a plan is about: the model, its parallel layout, bytes per parameter
  states.py       model-state bytes per ZeRO stage (exact from a config, the paper's formulas from N)
  activations.py  activation bytes: the paper's minimal set, and zerolm's own step as the compiler counts it
  timing.py       step time: compute at a share of the peak, the ring and tree collectives
  traffic.py      the step's collectives as the planner counts them (`zerolm comms`, `zerolm compile`)
  planner.py      the Planner: memory, the step peak, the micro-batch that fits, the step time, scaling
  build.py        a plan's model from a config or from a parameter count
  request.py      what `zerolm plan` asks, checked, and the Planner for it
  describe.py     the report, as JSON and as the lines `zerolm plan` prints

May import: core, config, model, parallel, data, checkpoint.
"""

from zerolm.plan.build import from_config, model_from_params
from zerolm.plan.describe import PlanReport, describe
from zerolm.plan.planner import SAFETY_MARGIN, Planner, PlanSettings
from zerolm.plan.request import PlanRequest, planner_for
from zerolm.plan.spec import PRECISIONS, STAGES, BytesPerParam, Model, Parallelism, PlanError
from zerolm.plan.states import AnalyticStates, ExactStates
from zerolm.plan.timing import ring_time, tree_time
from zerolm.plan.traffic import CountedStep, Prediction, naive_predictions, predicted_collectives, step_predictions

__all__ = ["PRECISIONS", "SAFETY_MARGIN", "STAGES", "AnalyticStates", "BytesPerParam", "CountedStep", "ExactStates",
           "Model", "Parallelism", "PlanError", "PlanReport", "PlanRequest", "PlanSettings", "Planner", "Prediction",
           "describe", "from_config", "model_from_params", "naive_predictions", "planner_for", "predicted_collectives",
           "ring_time", "step_predictions", "tree_time"]
