"""A bare all-reduce between two testbed nodes, three ways, and the TCP retransmits it caused.

    python benchmarks/link_allreduce.py --testbed shardwire --out benchmarks/results/ft-wire/allreduce.jsonl

Run as root on a testbed of two nodes (``shardwire testbed up --nodes 2 --link 100mbit``). Each way
all-reduces the GPT ``small`` model's parameters in fp32 (3.4 MB, a DiLoCo sync's change between
two fault-tolerant groups), whole and as the engine's five flat buffers issued at once: ``gloo``,
torch.distributed's own; ``torchft``, torchft's reconfigurable gloo process group, which the
fault-tolerant groups' exact sync runs on; ``shardwire``, the engine's point-to-point transport.
Each line gives the seconds and what the node's TCP counters moved by meanwhile (retransmitted
segments, retransmission timeouts), so that a slow transfer shows whether the link's queue dropped,
and, for ``shardwire``, the nodes its transport placed the two ranks on: 2, one rank a node, as
torchrun's ``LOCAL_WORLD_SIZE`` says it (these sides are started by ``testbed exec``, not torchrun,
so each sets it; without it the transport takes every rank for one node's).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllreduceOptions

SMALL_BUFFERS = [197888] * 4 + [49408]  # GPT small's flat buffers (its four blocks, its root): 840,960 parameters
COUNTERS = ("Tcp.RetransSegs", "TcpExt.TCPTimeouts", "Tcp.OutSegs")
PORT = 29650
TIMEOUT = datetime.timedelta(seconds=120)


def tcp_counters() -> dict[str, int]:
    """This network namespace's TCP counters (``nstat``'s source)."""
    found = {}
    for path in ("/proc/net/snmp", "/proc/net/netstat"):
        lines = Path(path).read_text().splitlines()
        for names, values in zip(lines[::2], lines[1::2]):
            prefix = names.split()[0].rstrip(":")
            found.update({f"{prefix}.{n}": int(v) for n, v in zip(names.split()[1:], values.split()[1:])})
    return {key: found.get(key, 0) for key in COUNTERS}


def all_reduce_of(way: str, rank: int, master: str):
    """A function that starts the sum of a tensor over the two nodes ``way`` says and returns its work,
    and the nodes the way placed the ranks on (None: it does not place them)."""
    if way == "torchft":
        import torchft

        store = dist.TCPStore(master, PORT, 2, is_master=rank == 0, timeout=TIMEOUT)
        group = torchft.ProcessGroupGloo(timeout=TIMEOUT)
        group.configure(f"{master}:{PORT}/quorum", f"group{rank}", rank, 2)
        options = AllreduceOptions()
        options.reduceOp = dist.ReduceOp.SUM

        def start(tensor, served=store):  # node0's store serves while the all-reduces run
            return group.allreduce([tensor], options)
        return start, None
    dist.init_process_group("gloo", init_method=f"tcp://{master}:{PORT}", rank=rank, world_size=2, timeout=TIMEOUT)
    if way == "gloo":
        return (lambda tensor: dist.all_reduce(tensor, async_op=True)), None
    from shardwire.comm.communicator import Communicator

    os.environ["LOCAL_WORLD_SIZE"] = "1"  # this node's ranks, as torchrun would say: the transport reads it
    comm = Communicator(dist.group.WORLD, torch.device("cpu"), timeout=TIMEOUT)
    tags = itertools.count()
    return (lambda tensor: comm.all_reduce(tensor, tag=f"buffer {next(tags)}", op="sum")), comm.placement.nodes


def node(way: str, rank: int, master: str, repeats: int) -> None:
    """One node's side: each shape ``repeats`` times, a JSON line each."""
    start, nodes = all_reduce_of(way, rank, master)
    placed = {} if nodes is None else {"nodes": nodes}
    for shape, sizes in (("whole", [sum(SMALL_BUFFERS)]), ("five buffers", SMALL_BUFFERS)):
        for _ in range(repeats):
            tensors = [torch.randn(n) for n in sizes]
            before, began = tcp_counters(), time.perf_counter()
            for work in [start(tensor) for tensor in tensors]:
                work.wait()
            seconds = time.perf_counter() - began
            moved = {key.split(".")[1]: value - before[key] for key, value in tcp_counters().items()}
            print(json.dumps({"way": way, "shape": shape, "mb": round(4 * sum(sizes) / 1e6, 2),
                              "seconds": round(seconds, 3), **moved, **placed}), flush=True)
            time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--testbed", default="shardwire", help="the testbed's name (two nodes, built)")
    parser.add_argument("--ways", default="gloo,torchft,shardwire")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", help="append node0's lines to this file too")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)  # a node's side, started by the above
    parser.add_argument("--way", help=argparse.SUPPRESS)
    parser.add_argument("--master", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        return node(args.way, args.rank, args.master, args.repeats)
    for way in args.ways.split(","):
        sides = [subprocess.Popen(
            [sys.executable, "-m", "shardwire", "testbed", "exec", "--name", args.testbed, f"node{k}", "--",
             sys.executable, __file__, "--rank", str(k), "--way", way, "--master", f"{args.testbed}-node0",
             "--repeats", str(args.repeats)], stdout=subprocess.PIPE if k == 0 else subprocess.DEVNULL, text=True)
            for k in (0, 1)]
        lines = sides[0].communicate()[0]
        if sides[1].wait() or sides[0].returncode:
            sys.exit(f"{way}: a node failed")
        print(lines, end="")
        if args.out:
            with open(args.out, "a") as out:
                out.write(lines)


if __name__ == "__main__":
    main()
