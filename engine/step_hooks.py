"""Where features plug into `LLMEngine.step` (speculative decoding, beam search, the KV connector's saves). The step
calls every hook at each point, in order; a hook reads the plan and the runner's output and hands back what it
decides as data (`StepEdits`), which the step applies in one place: no hook edits the runner's output or the
scheduler's queues itself."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.outputs import RequestOutput
    from engine.step_types import ModelRunnerOutput, SchedulerOutput, StepEdits


class StepHook:
    """Does nothing at any point; a feature overrides the points it needs."""

    def scheduled(self, plan: SchedulerOutput) -> None:
        """After scheduling, before the runner (the plan may be empty: nothing else follows then)."""

    def before_execute(self, plan: SchedulerOutput) -> None:
        """Just before the runner: add to the plan what it runs beside the scheduler's choice (drafts to verify)."""

    def after_execute(self, plan: SchedulerOutput, output: ModelRunnerOutput, started: float) -> StepEdits | None:
        """After the runner, which started at `started` (time.perf_counter): what the scheduler's update is to
        apply instead of the sampled tokens (None: nothing)."""
        return None

    def after_update(self, plan: SchedulerOutput) -> list[RequestOutput]:
        """After the scheduler's update: the outputs of the requests this feature finished."""
        return []
