"""--check-weight-hash-across-dp-replicas-interval N (Megatron-LM's): every N iterations the
data-parallel replicas compare a SHA-256 digest of each weight they hold. Replicas that have
drifted apart (a nondeterministic reduction, a faulty device, a rank that changed its weights
alone) stop the run with the weights and ranks that differ named, instead of training on as
several different models."""

import hashlib

import torch
import torch.distributed as dist

from megatron import mpu
from megatron.errors import TrainingError
from zero.comm.agreement import collective_device

NAMED_UP_TO = 5  # weights named in the error; the rest are counted


def check_replicas_agree(module, iteration, runtime):
    """Every rank of each data-parallel group calls it at the same iteration (an all-gather of
    the digests); every rank of a group that differs raises the same TrainingError."""
    world = mpu.get_data_parallel_world_size()
    if world == 1:
        return
    names, digests = _digests(module)
    group = mpu.get_data_parallel_group()
    digests = digests.to(collective_device(group))
    everyone = [torch.empty_like(digests) for _ in range(world)]
    dist.all_gather(everyone, digests, group=group)
    everyone = torch.stack(everyone).cpu()  # [ranks, weights, 32]
    differs = (everyone != everyone[0]).any(dim=2)  # [ranks, weights]: against DP rank 0's
    if bool(differs.any()):
        weights = [names[i] for i in differs.any(dim=0).nonzero().flatten().tolist()]
        ranks = differs.any(dim=1).nonzero().flatten().tolist()
        more = f" and {len(weights) - NAMED_UP_TO} more" if len(weights) > NAMED_UP_TO else ""
        raise TrainingError(
            f"iteration {iteration}: the data-parallel replicas' weights differ "
            f"(--check-weight-hash-across-dp-replicas-interval): data-parallel rank(s) "
            f"{', '.join(map(str, ranks))} differ from rank 0 in {len(weights)} of "
            f"{len(names)} weights: {', '.join(weights[:NAMED_UP_TO])}{more}. Resume from "
            "the last checkpoint; if it happens again, look for a rank whose device or "
            "reduction is not deterministic")
    runtime.print0(f" iteration {iteration}: the weights of the {world} data-parallel "
                   "replicas agree")


def _digests(module):
    """(names, uint8 [weights, 32]): each weight's SHA-256, of its bytes as held."""
    names, rows = [], []
    for name, param in module.named_parameters():
        data = param.detach().reshape(-1).cpu().view(torch.uint8).numpy()
        names.append(name)
        rows.append(torch.frombuffer(bytearray(hashlib.sha256(data).digest()),
                                     dtype=torch.uint8))
    return names, torch.stack(rows)
