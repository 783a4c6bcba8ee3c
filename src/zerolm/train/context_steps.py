"""A staged-context run's steps (zerolm.data.context): each context before model.seq_len is its own program,
compiled before the first step like the full context's, checked to fit, and said in the header; the loop
runs the one its step's context needs; tokens/s and MFU count what each step trains."""

from __future__ import annotations

import jax

from zerolm.config.section import ConfigError
from zerolm.data.context import Context, ContextPlan
from zerolm.model.attention import PALLAS_LANES, pallas_fits
from zerolm.model.decoder import count_params
from zerolm.model.flops import flops_per_token
from zerolm.observe.mfu import Accounting
from zerolm.parallel.build import BuiltStep, DoesNotFit, compile_step, step_memory
from zerolm.parallel.zero import Zero


class ContextSteps:
    """The step of each context of a run: the full context's `zero` (built and compiled for the run), and one
    compiled for each staged context's shapes (rows of its seq_len + 1, its rows per sample in each micro-batch)."""

    def __init__(self, built: BuiltStep, zero: Zero, plan: ContextPlan, limit: int | None):
        self.plan, self.built, self.full = plan, built, zero
        cfg = built.cfg
        self.steps: dict[Context, Zero] = {plan.contexts[-1]: zero}
        self.peaks: dict[Context, int | None] = {}
        for i, context in enumerate(plan.contexts[:-1]):
            if cfg.model.attention == "pallas" and not pallas_fits(context.seq_len, cfg.model.attention_block):
                raise ConfigError(f"train.context_stages.{i}.seq_len: {context.seq_len} does not cut into Pallas's "
                                  f"blocks of a multiple of {PALLAS_LANES} positions (this device's attention); use "
                                  "a multiple of it, or model.attention=blockwise")
            micro = cfg.train.micro_batch_size * context.rows
            compiled = compile_step(built.zero, micro, context.seq_len, cfg.accum_steps, keep_refusals=True)
            peak = step_memory(compiled, built.zero, micro, context.seq_len, cfg.accum_steps)
            if peak is None or (limit and peak > limit):
                refused = "the compiler refused it" if peak is None else \
                    f"{peak / 2**30:.2f} GiB at its peak of the {(limit or 0) / 2**30:.2f} GiB"
                raise DoesNotFit(cfg, f"the step of train.context_stages' {context.seq_len}-token context "
                                      f"({micro} rows per device per micro-step) does not fit: {refused}")
            self.steps[context] = built.zero.using(compiled.programs)
            self.peaks[context] = peak

    def at(self, step: int) -> Zero:
        """The step that step `step` runs."""
        return self.steps[self.plan.at(step)]

    def accounting(self, context: Context) -> Accounting:
        """MFU's accounting at a context: 6·N + 12·L·d·T per token with T its seq_len."""
        cfg = self.built.cfg
        n = count_params(self.full.abstract_params, matmul_only=True)
        return Accounting(flops_per_token(n, cfg.model.n_layer, cfg.model.d_model, context.seq_len),
                          jax.device_count(), jax.devices()[0].device_kind)

    def describe(self) -> list[str]:
        """The header's line for each staged context."""
        cfg, plan = self.built.cfg, self.plan
        lines = []
        for i, context in enumerate(plan.contexts[:-1]):
            peak = self.peaks[context]
            tokens = cfg.train.global_batch_size * context.tokens_per_sample
            how = (f"{context.rows} rows of each sample" if plan.mode == "split" else
                   f"each sample's first {context.seq_len + 1} tokens")
            lines.append(f"context stage {i + 1}: steps {context.first}-{context.last} at {context.seq_len} tokens "
                         f"(train.context_rows {plan.mode}: {how}; {tokens:,} tokens per step)"
                         + (f", compiled peak {peak / 2**30:.2f} GiB per device" if peak else ""))
        last = plan.contexts[-1]
        lines.append(f"context: model.seq_len {cfg.model.seq_len} from step {last.first}")
        return lines
