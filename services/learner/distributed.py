"""Multi-device training with FSDP2 (``torch.distributed.fsdp.fully_shard``).

Data parallel with fully sharded parameters, gradients and optimizer state: every rank holds
1/N of each, gathers a layer's parameters just before using them and reduce-scatters its
gradients right after. The same code runs on NVIDIA (NCCL), AMD (RCCL — ROCm builds of torch
expose it as ``nccl``) and the CPU (gloo, used by the tests with two processes).

How a step is split (see :meth:`services.learner.trainer.PolicyTrainer.train_step`):

* the step's sequences are dealt to the ranks by token count (:func:`split_for_ranks`, longest
  first onto the least-loaded rank);
* the token-mean denominator is the *global* number of loss tokens (all-reduced), and each
  rank's loss is multiplied by the world size because FSDP2 averages gradients across ranks —
  so the summed gradient is exactly the single-device token-mean gradient;
* every rank runs the same number of micro-batches (all-reduced max; a rank with fewer runs
  empty ones with a zero loss) because each forward and backward is a collective;
* gradient clipping uses the global norm (``clip_grad_norm_`` on DTensor gradients).

Sharding: each decoder layer is its own FSDP unit and the :class:`~services.learner.trainer.LogprobModel`
wrapper is the root (it holds the embeddings, the final norm and the output layer, which the
chunked log-prob function uses outside the HF forward). On GPUs parameters are gathered in
bf16 and gradients reduced in fp32 (``MixedPrecisionPolicy``); master weights and AdamW state
stay fp32 and sharded.

Launch: ``torchrun --nproc-per-node N ...`` sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR;
:func:`init_from_env` joins the group. Checkpoints: :meth:`DataParallel.full_state_dict` gathers
the full weights on rank 0 (CPU), which writes the same HF directory as a single device.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from services.learner.packing import TrainSequence


@dataclass
class DataParallel:
    group: Any = None  # None: the default process group
    mixed_precision: bool = False  # bf16 parameter gathers + fp32 gradient reduction (GPUs)
    # This rank's device for collectives. Recorded once because torch's current CUDA device is
    # per thread, and rank 0 issues commands from worker threads (see services/learner/commands.py).
    device: torch.device | None = None

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    def rank_device(self) -> torch.device:
        if self.device is not None:
            return self.device
        backend = dist.get_backend(self.group)
        return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    def shard(self, net: torch.nn.Module) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if self.mixed_precision else MixedPrecisionPolicy())
        decoder = net.model.get_decoder()  # type: ignore[attr-defined]
        for layer in decoder.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(net, mp_policy=mp)

    def sum(self, value: float) -> float:
        t = torch.tensor([float(value)], dtype=torch.float64, device=self.rank_device())
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return float(t.item())

    def max_int(self, value: int) -> int:
        t = torch.tensor([int(value)], dtype=torch.int64, device=self.rank_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t.item())

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.group, device=self.rank_device())
        return box[0]

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Full (unsharded) weights on CPU, on rank 0 (empty elsewhere); a collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def init_from_env(backend: str | None = None, *, mixed_precision: bool | None = None,
                  timeout_s: float | None = None) -> DataParallel:
    """Join the process group described by torchrun's environment variables.

    ``timeout_s`` bounds every collective (torch's default: 10 min for NCCL, 30 min for gloo): a
    rank whose peers died stops waiting after that long instead of hanging.
    """
    use_cuda = torch.cuda.is_available() and backend != "gloo"
    device = torch.device("cpu")
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
        dist.init_process_group(backend or ("nccl" if use_cuda else "gloo"), **kwargs)
    return DataParallel(mixed_precision=use_cuda if mixed_precision is None else mixed_precision, device=device)


def leave_process_group() -> None:
    """Destroy the default process group at the end of a rank's work (every rank).

    A sharded model's DTensors hold the group. Freed after it, during interpreter exit, gloo's
    worker threads abort the process ("terminate called without an active exception"), so the
    caller drops its references to models and trainers first and this collects what is left
    (reference cycles included) before the group goes.
    """
    import gc

    gc.collect()
    dist.destroy_process_group()


def split_for_ranks(sequences: list[TrainSequence], world_size: int) -> list[list[TrainSequence]]:
    """Deal sequences to ranks, longest first onto the rank with the fewest tokens (deterministic)."""
    loads = [0] * world_size
    shards: list[list[TrainSequence]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(sequences)), key=lambda k: (-len(sequences[k]), k)):
        r = min(range(world_size), key=lambda k: (loads[k], k))
        shards[r].append(sequences[i])
        loads[r] += len(sequences[i])
    return shards
