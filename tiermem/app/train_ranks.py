"""``tiermem train`` on more than one process: torchrun starts one per rank, FSDP2 shards the
model, and tiermem tiers what each rank holds.

::

    torchrun --nproc-per-node 2 -m tiermem train --state-home nvme

# NOTE [ Training on ranks ]
1. Every rank builds the same GPT from the same seed and shards it with FSDP2: ``fully_shard``
   on each block and at the root, FSDP2's defaults (parameters resharded after forward). Then
   ``rt.manage`` tiers each rank's optimizer states (NOTE [ Sharded model states ] in
   ``tiermem.states.sharded.manager``) and ``rt.offload_activations`` each rank's saved activations.
2. Data: the same Markov chain on every rank (the seed's) and a batch stream of each rank's own
   (``MarkovChainData(stream=rank)``). ``--batch-size`` is per rank, so a step trains
   world size x batch size sequences; FSDP2 averages the ranks' gradients, which is plain
   PyTorch trained on the mean loss of all ranks' batches.
3. The loss a step reports is the mean of the ranks' losses (one all-reduce of the fp32 loss;
   with 2 ranks exactly the mean loss plain PyTorch computes for both batches).
4. Planning: the planner's profiling step is one process's (``sample=``), so the states are
   placed by ``rt.manage``'s sharded plan (from every rank's free bytes, agreed on rank 0) or
   the hand plan (``--state-home``, ``--plan``); each block's activation policy is the
   configuration's (``auto`` falls back as the offloader does without a planned policy).
5. Checkpoints: ``--checkpoint`` / ``--save-every`` / ``--resume`` work on several processes;
   every rank saves and loads together (NOTE [ Checkpoints on ranks ] in
   ``tiermem.checkpoint.ranks``: one DCP checkpoint, each rank writing its own shards, rank 0
   committing), the directory on a filesystem every rank sees. Each rank's data stream position
   and RNG are its own in the checkpoint (NOTE [ Resuming a train run ] rule 4); a resume needs
   the world size that saved it. Not yet on several processes: ``--no-states`` with a
   planner-made activation policy.
6. Rank 0 prints the summary; its tiers, links and NVMe blocks are rank 0's own, the numbers
   every rank has for its own shards (the configuration's capacities are per rank, NOTE
   [ Ranks ] in ``tiermem.distributed``).
7. An error is printed once: by rank 0, and by another rank only where its own error differs
   from rank 0's (a peer's failure, an error of its own). The ranks learn each other's errors
   where they meet to close the process group (one ``all_gather_object`` before the barrier,
   :func:`close_group`); the checks a resume makes are agreed (NOTE [ Resuming a train
   run ] rule 6), so a refused resume is one message. Where the errors cannot be gathered (a
   peer is gone, the gather fails) every rank prints its own, marked with its rank. Before the
   group exists the errors come from the flags, the configuration and the environment, which
   torchrun gives every rank of a machine alike: local rank 0 prints them. Every rank exits
   with the status of its own error.
"""

from __future__ import annotations

import logging
import sys

import torch
from torch import nn

from tiermem import distributed

__all__ = ["close_group", "mean_over_ranks", "report_error", "shard"]

log = logging.getLogger("tiermem.app.train")


def shard(model: nn.Module, ranks: distributed.RankContext) -> bool:
    """Rule 1: ``fully_shard`` every block and the root when this is one rank of several; returns
    whether it did (one process: the model stays as it is)."""
    if not ranks.multi_process:
        return False
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block)
    fully_shard(model)
    return True


def mean_over_ranks(loss: float, ranks: distributed.RankContext) -> float:
    """Rule 3: the mean of every rank's ``loss`` (``loss`` itself in one process)."""
    if not ranks.multi_process:
        return loss
    import torch.distributed as dist

    total = torch.tensor([loss], dtype=torch.float32)
    dist.all_reduce(total)
    return float(total[0] / ranks.world_size)


def close_group(owned: bool, failure: BaseException | None) -> list[str | None] | None:
    """Rule 7: meet the other ranks, learn every rank's error message (None: it succeeded), and
    destroy the group :func:`distributed.setup_process_group` made. None where the messages could
    not be gathered (no group of ours, a peer gone, the gather failed)."""
    import torch.distributed as dist

    if not owned or not dist.is_initialized():
        return None
    messages: list[str | None] | None = None
    if not isinstance(failure, distributed.PeerFailureError):  # a peer gone meets nobody
        gathered: list[str | None] = [None] * dist.get_world_size()
        try:
            dist.all_gather_object(gathered, None if failure is None else str(failure))
            messages = gathered
        except RuntimeError as exc:  # a peer died or hangs: each rank reports its own
            log.warning("tiermem: the ranks did not meet before closing the process group: %s", exc)
    # The barrier still comes last: gloo aborts a rank whose peer tears its connections down
    # while that rank is still receiving the gather's last bytes.
    distributed.close_process_group(owned, wait_for_peers=messages is not None)
    return messages


def report_error(
    error: BaseException, ranks: distributed.RankContext, messages: list[str | None] | None, *, grouped: bool = True
) -> None:
    """Rule 7: print ``error`` to stderr where this rank is the one to. ``messages``: every rank's,
    from :func:`close_group` (None where they were not gathered); ``grouped``: whether the error
    came once the process group existed."""
    text = "\n".join([str(error), *getattr(error, "__notes__", ())])
    if not ranks.multi_process or ranks.rank == 0:
        print(text, file=sys.stderr)
    elif not grouped:  # from the flags, configuration and environment: alike on one machine
        if ranks.local_rank == 0:
            print(f"[rank {ranks.rank}] {text}", file=sys.stderr)
    elif messages is None or messages[0] != str(error):
        print(f"[rank {ranks.rank}] {text}", file=sys.stderr)
