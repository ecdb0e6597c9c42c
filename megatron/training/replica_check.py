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
from zero.comm.agreement import any_rank_failed, collective_device

NAMED_UP_TO = 5  # weights named in the error; the rest are counted


def check_replicas_agree(module, iteration, runtime):
    """Every rank calls it at the same iteration: each data-parallel group all-gathers its
    digests, then all ranks learn whether any group differs (one all-reduced flag), so that
    every rank stops, not only those of the group that drifted (the others would wait for
    them in their next collective)."""
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
    here = bool(differs.any())
    if not any_rank_failed(here):
        runtime.print0(f" iteration {iteration}: the weights of the {world} data-parallel "
                       "replicas agree")
        return
    what = f"iteration {iteration}: the data-parallel replicas' weights differ " \
           "(--check-weight-hash-across-dp-replicas-interval)"
    if not here:
        raise TrainingError(f"{what} in another model-parallel group than this rank's (rank "
                            f"{runtime.rank}): see the error of a rank that names them")
    weights = [names[i] for i in differs.any(dim=0).nonzero().flatten().tolist()]
    ranks = differs.any(dim=1).nonzero().flatten().tolist()
    members = dist.get_process_group_ranks(group)
    more = f" and {len(weights) - NAMED_UP_TO} more" if len(weights) > NAMED_UP_TO else ""
    raise TrainingError(
        f"{what}: data-parallel rank(s) {', '.join(map(str, ranks))} (global "
        f"{', '.join(str(members[r]) for r in ranks)}) differ from data-parallel rank 0 (global "
        f"{members[0]}) in {len(weights)} of {len(names)} weights: "
        f"{', '.join(weights[:NAMED_UP_TO])}{more}. Resume from the last checkpoint; if it "
        "happens again, look for a rank whose device or reduction is not deterministic")


def _digests(module):
    """(names, uint8 [weights, 32]): each weight's SHA-256, of its bytes as held."""
    names, rows = [], []
    for name, param in module.named_parameters():
        data = param.detach().reshape(-1).cpu().view(torch.uint8).numpy()
        names.append(name)
        rows.append(torch.frombuffer(bytearray(hashlib.sha256(data).digest()),
                                     dtype=torch.uint8))
    return names, torch.stack(rows)
