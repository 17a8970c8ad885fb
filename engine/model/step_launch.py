"""The runner's half of async scheduling: launch a step, read its tokens later.

engine/frontend/async_step.py holds the mechanism and says what overlaps with
what; this file is what it asks of the ModelRunner. `launch_step` queues one
plain step on the device and returns without waiting for it:

    payload     encoded as for execute(), copied to the device from pinned memory
                without a stream sync (a plain .to() would wait for the step before)
    input ids   a row whose token is PLACEHOLDER (sampled by the step still in
                flight) takes it on the device: input_ids[row] = previous.token_ids[i],
                before the forward, so a CUDA graph's static buffers get it too
    forward     run_step, as execute() runs it (graphs or eager)
    sampling    Sampler.sample: the tokens stay on the device
    read back   CUDA: non_blocking copies into pinned host memory and an event;
                the CPU: the tensors themselves (the step has already run)

`LaunchedStep.result()` waits for the event and gives the ModelRunnerOutput that
execute() would have given. A plain step has no drafts, no prompt logprobs and
no pooling (async_step.py falls back to execute() for those).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.core.sched_output import PLACEHOLDER, ScheduledSequence, SchedulerOutput
from engine.model.runner import ModelRunnerOutput
from engine.model.sampling_batch import build_sampling_batch
from engine.model.step_inputs import encode_step
from engine.sampling.sampler import DeviceSample, SamplerOutput


@dataclass
class LaunchedStep:
    seq_ids: list[int]  # the sequence of each sampled row
    sample: DeviceSample  # on the device: what the next step's placeholder rows read
    host: list[torch.Tensor]  # the same tensors on the host (pinned copies on CUDA)
    done: torch.cuda.Event | None  # recorded after the copies (None: the CPU)

    def row_of(self) -> dict[int, int]:
        return {seq_id: row for row, seq_id in enumerate(self.seq_ids)}

    def result(self) -> ModelRunnerOutput:
        """The step's output on the host; waits for the step (and only it) to finish."""
        if self.done is not None:
            self.done.synchronize()
        sampled = self.sample.to_host(self.host) if self.seq_ids else SamplerOutput([], [], [])
        return ModelRunnerOutput(self.seq_ids, sampled)


def ordered_rows(output: SchedulerOutput, by_lora: bool) -> tuple[list, list]:
    """(decodes, prefills): the runner's row order, decodes first (execute's, too)."""
    decodes = [s for s in output.sequences if s.num_new_tokens == 1]
    if by_lora:  # an adapter's rows side by side: its weights read once for them
        decodes.sort(key=lambda s: s.lora_id)
    return decodes, [s for s in output.sequences if s.num_new_tokens > 1]


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without waiting for the work queued there."""
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


@torch.inference_mode()
def launch_step(runner, output: SchedulerOutput, previous: LaunchedStep | None) -> LaunchedStep:
    """Queue `output` (a plain step) on the runner's device; see the module docstring."""
    runner.use_configured_threads()
    decodes, prefills = ordered_rows(output, runner.lora is not None)
    ordered = decodes + prefills
    batch = build_sampling_batch(ordered, runner.eos_token_ids)
    header, payload = encode_step(decodes, prefills, batch.rows, output.blocks_to_copy,
                                  runner.block_size, output.window_blocks_to_copy)
    feed = _feed_pairs(ordered, previous)
    payload = to_device(payload, runner.device)
    if feed:
        pairs = to_device(torch.tensor(feed, dtype=torch.long), runner.device)
        payload[pairs[:, 0]] = previous.sample.token_ids[pairs[:, 1]]  # input_ids lead the payload
    logits = runner.run_step(header, runner.share(header, payload))
    if not batch.rows:
        return LaunchedStep([], DeviceSample(torch.zeros(0, dtype=torch.long), [], []), [], None)
    sample = runner.sampler.sample(logits, batch.requests)
    host, done = _read_back(sample.tensors(), runner.device)
    return LaunchedStep(batch.seq_ids, sample, host, done)


def _feed_pairs(ordered: list[ScheduledSequence], previous: LaunchedStep | None) -> list[list[int]]:
    """[flat input row, row of `previous`'s tokens] for every PLACEHOLDER input id."""
    pairs, offset = [], 0
    row_of = previous.row_of() if previous is not None else {}
    for s in ordered:  # only a sequence's last input can be a placeholder
        offset += s.num_new_tokens
        if s.token_ids[-1] == PLACEHOLDER:
            if s.seq_id not in row_of:
                raise RuntimeError(f"sequence {s.seq_id}: a placeholder input that the step "
                                   "in flight did not sample")
            pairs.append([offset - 1, row_of[s.seq_id]])
    return pairs


def _read_back(tensors: list[torch.Tensor], device: torch.device):
    """(host tensors, event): copies that land without blocking the host."""
    if device.type == "cpu":
        return tensors, None
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for target, source in zip(host, tensors):
        target.copy_(source, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(device))
    return host, done
