"""What each node of ``shardwire testbed run`` runs: torchrun, in this process, ending as
``shardwire train``'s own launch ends (``shardwire.launch.launch_local``).

``python -m torch.distributed.run`` ends a job whose worker failed with its ``ChildFailedError``'s
traceback and a table of the failures, some thirty lines on every node after the worker's own line
(and a node that ``run`` stops, or that lost the rendezvous, with a traceback too). Here a worker
that refused (status 2, ``launch.REFUSED``: it said why, in one line) ends its node with that
status and nothing more; a worker that failed otherwise, with one line naming the ranks and their
statuses (a shardwire worker whose collective failed, status 3, said so itself: the line names the
ranks the launcher then stopped, or none, beside another failure); a node that lost the
rendezvous (the node holding it ended first, or is cut off), with one line; and a node stopped by
a signal, quietly, with 128 + its number (``job.run_job`` says which node stopped the job).

    python -m shardwire.testbed.node TORCHRUN_OPTIONS... -- JOB...

The job (a script, ``-m module`` or ``--no-python program``, then its arguments) is handed to
torchrun after its options are parsed, as ``launch.launch_local`` hands it: torchrun's parser would
otherwise read the job's options too, and take ``shardwire train --nproc`` for an abbreviation of
its own ``--nproc-per-node``.
"""

from __future__ import annotations

import sys

from shardwire.launch import REFUSED, WorkersRefused, failed_workers, quiet_agent, restarting_failures_only


def main(argv: list[str]) -> int:
    """Run torchrun with ``argv`` (its options, ``--``, then the job); returns the node's exit status."""
    from torch.distributed import DistStoreError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import parse_args, run

    options, job = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    ours = job[:2] in (["-m", "shardwire"], ["--module", "shardwire"])  # whose statuses say more (COLLECTIVE_FAILED)
    said = quiet_agent(ours=ours)
    script = next((i for i, word in enumerate(job) if not word.startswith("-")), len(job))  # after -m, --no-python
    config = parse_args([*options, *job[:script + 1]])
    config.training_script_args = job[script + 1:]
    try:
        with restarting_failures_only(said):
            run(config)
    except SignalException as err:
        return 128 + int(err.sigval)
    except ChildFailedError as err:
        return failed_workers(err, ours=ours)
    except WorkersRefused:
        return REFUSED
    except (RendezvousError, DistStoreError) as err:  # the nodes could not meet (a node cut off: the store's
        # wait times out), or the one holding their meeting point ended
        cause = err.__cause__ or err
        reason = " ".join(str(cause).split()) or type(cause).__name__
        who = ("another node has stopped, or cannot be reached" if "--rdzv-conf=is_host=1" in options else
               "the node holding it has stopped, or cannot be reached")
        print(f"error: the job's rendezvous at {config.rdzv_endpoint} failed ({reason}): {who}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
