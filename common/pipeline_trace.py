"""What only a pipeline measures: the bubble per rank, one step's schedule as a timeline, and what each
rank holds (common/README.md)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from common.dist import all_ranks, print0
from common.metrics import memory_label, peak_memory_gib, synchronize


class BusyTimer:
    """Times every compute action ("F", "B", ZBV's "W", "loss"; one stage, one micro-batch) of this rank's stages
    inside the schedule, and remembers which one it was. Clocks: common/README.md."""

    def __init__(self, device: torch.device):
        self.device = device
        self.origin = None  # CUDA: the event this step's times are measured from
        self.actions: list[tuple] = []  # (kind, stage, microbatch, start mark, end mark) of the current step

    def wrap(self, function, kind: str, stage: int, microbatch_of=lambda args: args[0]):
        """`function` timed; `microbatch_of(args)` says which micro-batch a call is (the schedules pass the stage
        methods the micro-batch index as their first argument)."""
        def timed(*args, **kwargs):
            start = self._mark()
            result = function(*args, **kwargs)
            self.actions.append((kind, stage, microbatch_of(args), start, self._mark()))
            return result
        return timed

    def _mark(self):
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start_step(self, aligned: bool = False) -> None:
        """Forget anything timed outside the schedule; on a GPU, record this step's origin (after a barrier if
        `aligned`, for a step whose timelines are compared across ranks)."""
        if aligned and self.device.type == "cuda":
            dist.barrier()
            torch.cuda.synchronize(self.device)
        self.actions = []
        self.origin = self._mark() if self.device.type == "cuda" else None

    def take_actions(self) -> list[dict]:
        """This step's actions, start and end in milliseconds (CPU: on the machine's monotonic clock; GPU: since
        the step's origin). The device must be synchronised first."""
        if self.device.type == "cuda":
            to_ms = self.origin.elapsed_time
        else:
            def to_ms(mark: float) -> float:
                return mark * 1000.0
        actions = [dict(stage=stage, microbatch=microbatch, kind=kind, start_ms=to_ms(start), end_ms=to_ms(end))
                   for kind, stage, microbatch, start, end in self.actions]
        self.actions = []
        return actions


def busy_ms(actions: list[dict]) -> float:
    return sum(action["end_ms"] - action["start_ms"] for action in actions)


def schedule_trace(step: int, actions_per_rank: list[list[dict]], schedule_ms_per_rank: list[float],
                   device: torch.device) -> dict:
    """Every rank's actions of one step as one timeline, times relative to the earliest start over all ranks, with
    that step's busy time and schedule wall time per rank (the bubble of this one step)."""
    origin = min((a["start_ms"] for actions in actions_per_rank for a in actions), default=0.0)
    actions = [dict(rank=rank, **{**action, "start_ms": action["start_ms"] - origin,
                                   "end_ms": action["end_ms"] - origin})
               for rank, rank_actions in enumerate(actions_per_rank)
               for action in sorted(rank_actions, key=lambda a: a["start_ms"])]
    return dict(step=step, clock="cuda events" if device.type == "cuda" else "perf_counter", actions=actions,
                busy_ms_per_rank=[busy_ms(rank_actions) for rank_actions in actions_per_rank],
                schedule_ms_per_rank=schedule_ms_per_rank)


def per_rank_measures(rec) -> dict:
    """Every rank's peak memory (printed) and collectives per profiled step, for summary.json. A collective: every
    rank calls it."""
    peak_mem_gib_per_rank = all_ranks(peak_memory_gib(rec.device))
    print0(f"peak memory per rank ({memory_label(rec.device)}): "
           + ", ".join(f"rank {r} {gib:.2f} GiB" for r, gib in enumerate(peak_mem_gib_per_rank)))
    return dict(peak_mem_gib_per_rank=peak_mem_gib_per_rank,
                collective_bytes_per_step_per_rank=all_ranks(rec.comm.collective_bytes_per_step()))


class PipelineTrace:
    """The bubble and the schedule trace of a torch.distributed.pipelining run; `config` gives the schedule, the
    micro-batches, the stages per rank, the steps, the timing warm-up and the profiled window."""

    def __init__(self, device: torch.device, config):
        self.device, self.config = device, config
        self.busy = BusyTimer(device)
        self.records: list[tuple[int, float, float]] = []  # (step, busy_ms, pipeline_ms) of this rank per step
        self.trace_step = None
        self.traced = (None, None)  # the traced step's actions and schedule wall time
        self.microbatch_of_labels: dict[int, int] = {}  # id(labels tensor) -> micro-batch index, refilled every step
        self.started = 0.0

    def time_stage(self, stage, index: int) -> None:
        """Instance attributes shadow the methods the schedule calls, so every compute action is timed, with its
        stage and micro-batch. backward_one_chunk is the full backward, or under ZBV its input-gradient half."""
        for name, kind in (("forward_one_chunk", "F"), ("backward_one_chunk", "B"), ("backward_weight_one_chunk", "W")):
            setattr(stage, name, self.busy.wrap(getattr(stage, name), kind, index))

    def time_loss(self, loss_fn, stage: int):
        """loss_fn timed. It gets micro-batch i's labels, the very tensor passed in target_mbs: its identity says
        which i it is (the first step's shape inference also calls it once, on stand-in labels: None)."""
        return self.busy.wrap(loss_fn, "loss", stage, microbatch_of=lambda args: self.microbatch_of_labels.get(
            id(args[1])))

    def _choose_trace_step(self, first_step: int) -> int:
        """The step drawn as a timeline: the last measured step that torch.profiler did not slow down."""
        config = self.config
        window = range(config.timing_warmup_steps, config.timing_warmup_steps + config.comm_profile_steps)
        warmup = min(config.timing_warmup_steps, max(0, config.steps - 1))
        unprofiled = [s for s in range(first_step, config.steps) if s not in window]
        return max([s for s in unprofiled if s - first_step >= warmup] or unprofiled or [config.steps - 1])

    def start(self, step: int, labels: list[torch.Tensor] | None) -> None:
        """Before the step's clock starts: `labels` are the micro-batches' labels on the last stage (else None)."""
        if self.trace_step is None:
            self.trace_step = self._choose_trace_step(step)
        self.microbatch_of_labels = {id(tensor): i for i, tensor in enumerate(labels or [])}
        self.busy.start_step(aligned=step == self.trace_step)
        self.started = time.perf_counter()

    def stop(self, step: int) -> None:
        """Right after schedule.step: waits for the device (the schedule's wall time needs its end)."""
        synchronize(self.device)
        actions = self.busy.take_actions()
        self.records.append((step, busy_ms(actions), (time.perf_counter() - self.started) * 1000.0))
        if step == self.trace_step:
            self.traced = (actions, self.records[-1][2])

    def finish(self, rec) -> dict:
        """summary.json's pipeline measurements, every rank's; prints the bubble per rank. Every rank calls it."""
        measured = self.records[rec.metrics.warmup_steps:] or self.records
        measured = [r for r in measured if r[0] + 1 not in rec.comm.profiled] or measured
        mean_busy_ms = sum(b for _, b, _ in measured) / len(measured) if measured else 0.0
        mean_pipeline_ms = sum(t for _, _, t in measured) / len(measured) if measured else 0.0
        per_rank = all_ranks((mean_busy_ms, mean_pipeline_ms))
        bubble_per_rank = [(t - b) / t if t > 0 else None for b, t in per_rank]
        fractions = [f for f in bubble_per_rank if f is not None]
        bubble_fraction = sum(fractions) / len(fractions) if fractions else None
        for r, ((b, t), fraction) in enumerate(zip(per_rank, bubble_per_rank)):
            if fraction is not None:
                print0(f"bubble rank {r}: busy {b:,.0f} ms, idle {t - b:,.0f} ms of {t:,.0f} ms in the schedule "
                       f"-> {fraction:.1%}")
        if bubble_fraction is not None:
            print0(f"bubble: measured {bubble_fraction:.1%} (mean over ranks)")
        traced = all_ranks(self.traced)
        trace = (schedule_trace(self.trace_step + 1, [actions for actions, _ in traced], [ms for _, ms in traced],
                                self.device) if self.traced[0] is not None else None)
        return dict(bubble_fraction=bubble_fraction, bubble_fraction_per_rank=bubble_per_rank,
                    busy_ms_per_rank=[b for b, _ in per_rank], schedule_ms_per_rank=[t for _, t in per_rank],
                    schedule_trace=trace,
                    **per_rank_measures(rec))
