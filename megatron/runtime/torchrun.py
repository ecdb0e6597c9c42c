"""torchrun as the launch scripts start it: torch's own launcher (torch.distributed.run, the
same arguments), whose failures end in one `error:` line instead of its Python traceback and
failure table, after the error the failed worker printed itself.

    python -m megatron.runtime.torchrun --nproc_per_node 2 pretrain_gpt2.py ...

(scripts/check_env.sh's torchrun_command starts it with the repository first on the import
path, ahead of a `megatron` package in the folder it runs in.)

- a worker that failed: `error: pretrain_gpt2.py stopped: rank 1 exited with code 2 (its
  error is above)`, and the launcher exits with the worker's code (2 for a user error, 130
  for Ctrl-C; 128 + the signal for one killed by a signal), where torchrun exits 1;
- a node that never joins, or a rendezvous port already in use: one line naming the address
  and the variables of the launch scripts that set it;
- Ctrl-C or SIGTERM reaching the launcher: its workers stop as torchrun stops them, and the
  launcher exits with 128 + the signal's number, without a traceback.
"""

import os
import sys


def main(argv=None):
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import parse_args, run
    args = parse_args(sys.argv[1:] if argv is None else argv)
    script = os.path.basename(args.training_script)
    try:
        run(args)
    except ChildFailedError as failure:
        rank, first = failure.get_first_failure()
        if first.exitcode < 0:  # a signal: the process could say nothing itself
            print(f"error: {script} stopped: rank {rank} was killed by {first.signal_name()} "
                  "(it printed no error of its own; SIGKILL: out of memory?)", file=sys.stderr,
                  flush=True)
            return 128 - first.exitcode
        print(f"error: {script} stopped: rank {rank} exited with code {first.exitcode} (its "
              "error is above)", file=sys.stderr, flush=True)
        return first.exitcode if first.exitcode < 256 else 1
    except SignalException as stopped:
        return 128 + int(stopped.sigval)
    except KeyboardInterrupt:  # before the launcher's own handler was in place
        return 130
    except (RendezvousError, DistError) as error:
        print(f"error: {_rendezvous_failure(args, error)}", file=sys.stderr, flush=True)
        return 2
    return 0


def _rendezvous_failure(args, error):
    """What went wrong meeting the other nodes, in the launch scripts' terms."""
    reason = (str(error).strip().splitlines() or [type(error).__name__])[0].rstrip(".")
    if args.standalone:  # (one node, its rendezvous on a free local port)
        return f"the processes on this machine could not meet: {reason}"
    if args.rdzv_endpoint and args.rdzv_backend != "static":
        where, variables, port = args.rdzv_endpoint, "RDZV_ENDPOINT", "RDZV_ENDPOINT's port"
    else:
        where, variables = f"{args.master_addr}:{args.master_port}", "MASTER_ADDR/MASTER_PORT"
        port = "MASTER_PORT"
    if "EADDRINUSE" in reason or "address already in use" in reason.lower():
        return (f"the rendezvous port at {where} is in use (another job on this machine?): "
                f"{reason}. Give a free port ({port})")
    return (f"the {args.nnodes} node(s) could not meet at {where}: {reason or 'timed out'}. "
            f"Start the script on every node with the same NNODES and {variables} (the "
            "address of the first node, reachable from the others), each with its own "
            "NODE_RANK; DISTRIBUTED_TIMEOUT_MINUTES sets how long they wait")


if __name__ == "__main__":
    sys.exit(main())
