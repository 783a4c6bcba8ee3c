"""A jax.profiler trace of a run's steps FIRST..LAST (`logging.profile`)."""

from __future__ import annotations

from pathlib import Path

import jax


class Profiler:
    """A jax.profiler trace of steps FIRST..LAST (logging.profile), written under the run's log dir."""

    def __init__(self, steps: tuple[int, int] | None, start: int, end: int, directory: Path, bar, out):
        """Steps `start`+1 .. `end` will run; a range reaching past them is cut to them, and said so."""
        self.directory, self.bar, self.out = directory, bar, out
        self.active = False
        self.steps = steps
        if steps is not None:
            first, last = max(steps[0], start + 1), min(steps[1], end)
            if first > last:
                bar.write(f"profile: steps {steps[0]}-{steps[1]} asked for, but this run trains steps {start + 1}-{end}: "
                          "nothing is traced", file=out)
                self.steps = None
            elif (first, last) != steps:
                bar.write(f"profile: tracing steps {first}-{last} (steps {steps[0]}-{steps[1]} asked for; this run "
                          f"trains steps {start + 1}-{end})", file=out)
                self.steps = (first, last)

    def before(self, step: int) -> None:
        if self.steps is not None and step == self.steps[0]:
            jax.profiler.start_trace(str(self.directory))
            self.active = True

    def after(self, step: int, state) -> None:
        if self.active and self.steps is not None and step == self.steps[1]:
            jax.block_until_ready(state)  # the trace holds these steps' device work, whole
            self.close()
            self.bar.write(f"profile of steps {self.steps[0]}-{self.steps[1]} in {self.directory}", file=self.out)

    def close(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
