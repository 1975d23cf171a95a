"""The emulated cluster: a gloo job across namespaces, shaping that holds, and a clean teardown."""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from shardwire.cli import command, main
from shardwire.launch import NODE_THREADS, share_node_threads
from shardwire.testbed import check, job, network, regime, spec
from shardwire.testbed.network import links_down
from shardwire.testbed.spec import check_name, cut_since, parse_rate, state_path

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: builds network namespaces, links and qdiscs")
RATE = parse_rate("200mbit")  # low enough that two busy cores shape it exactly, high enough to be quick


def test_rates_parse_in_tc_units():
    assert parse_rate("1gbit") == 10**9
    assert parse_rate("2.5gbit") == 2_500_000_000
    assert parse_rate("500mbit") == 500_000_000
    assert parse_rate("940kbit") == 940_000  # a GPU cluster's regime for a CPU rank (--like)
    assert parse_rate("125mbps") == 10**9  # tc's bytes per second
    for bad in ("1gb", "fast", "1 gbit", "50kbit", "10kbps"):  # no unit of tc's, a word, a space, under 100kbit
        with pytest.raises(spec.TestbedError, match="link rate"):
            parse_rate(bad)


def test_the_bucket_holds_a_segment_at_speed_and_a_few_packets_when_slow():
    assert network.burst_bytes(parse_rate("1gbit")) == 128 * 1024  # a whole 64 KiB GSO segment
    assert network.burst_bytes(parse_rate("10gbit")) == 10**10 // 8 // 1000  # rate / HZ at HZ 1000
    assert network.burst_bytes(parse_rate("10mbit")) == 12_500  # 10 ms of the rate
    # at a GPU cluster's regime an idle link must not pass seconds of traffic at once
    assert network.burst_bytes(parse_rate("940kbit")) == 4096


def test_like_matches_a_presets_flop_per_byte():
    """A node here over its link has the preset's node over its network: h100-100gbe's 8 GPUs at 58%
    of 989 TFLOP/s over 7.5 GB/s is about 612,000 FLOP per byte, so two ranks of 72 GFLOP/s need
    about 1.9 Mbit/s, rounded to two significant digits so that measuring again keeps the testbed."""
    from shardwire.sim.presets import CLUSTERS
    from shardwire.testbed.regime import Regime

    h100 = CLUSTERS["h100-100gbe"]
    matched = Regime("h100-100gbe", node_flops=h100.gpus_per_node * h100.peak_tflops * 1e12 * h100.matmul_efficiency,
                     node_bytes_per_s=h100.inter_node.busbw_GBps * 1e9, rank_flops=72e9, ranks_per_node=2, threads=1)
    assert matched.flop_per_byte == pytest.approx(612_000, rel=0.001)
    assert matched.rate_bits == 1_900_000
    assert "611,861 FLOP per byte" in matched.describe()[0] and "links of 1.9mbit" in matched.describe()[1]


def test_like_gives_each_rank_its_share_where_ranks_outnumber_the_cores(monkeypatch):
    """Four ranks on two cores compute half a thread's rate each: the node's compute is not counted
    twice over."""
    import torch

    from shardwire.profile import flops
    from shardwire.testbed import regime

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(flops, "probe_peak_tflops", lambda device, dtype, seconds: 0.1)  # 100 GFLOP/s
    threads = torch.get_num_threads()
    alone, crowded = regime.like("h100-100gbe", 2, 1), regime.like("h100-100gbe", 2, 2)
    assert (alone.threads, alone.share, crowded.threads, crowded.share) == (1, 1.0, 1, 0.5)
    assert crowded.rate_bits == alone.rate_bits  # twice the ranks per node, each with half the time
    assert "0.5 of their time" in crowded.describe()[1]
    assert torch.get_num_threads() == threads


def test_every_node_gets_its_share_of_the_cores(monkeypatch):
    """The nodes share this machine's cores: a job across them gives each rank cores / all ranks
    compute threads, a command on one node (``exec``, its ranks unknown) the node's share, and a
    choice of the user's stands."""
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    bed = spec.Testbed("shardwire-test", 2, RATE)
    threads = [job.node_environment(bed, nproc)["OMP_NUM_THREADS"] for nproc in (None, 2, 8)]
    assert threads == ["4", "2", "1"]
    assert job.node_environment(spec.Testbed("shardwire-test", 16, RATE))["OMP_NUM_THREADS"] == "1"
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert job.node_environment(bed)["OMP_NUM_THREADS"] == "3"
    assert NODE_THREADS not in job.node_environment(bed)  # the user's choice: not the ranks' to divide


def _worker_threads(env: dict[str, str], local_ranks: int) -> tuple[str, int]:
    """The OMP_NUM_THREADS and torch's compute threads of a shardwire command's worker, one of
    ``local_ranks`` on its node, started as torchrun starts it in ``env`` (``launch_local``'s
    workers are torchrun's too): a ``simulate``, then torch imported, as every torch command does."""
    worker = {**env, "RANK": "0", "WORLD_SIZE": str(local_ranks), "LOCAL_RANK": "0",
              "LOCAL_WORLD_SIZE": str(local_ranks), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    script = ("import os, sys\n"
              "from shardwire.cli import main\n"
              "assert main(['simulate', '--model', 'gpt-125m', '--cluster', 'a100-100gbe', '--nodes', '1']) == 0\n"
              "import torch\n"
              "print(os.environ['OMP_NUM_THREADS'], torch.get_num_threads(), file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-c", script], env=worker, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    omp, threads = done.stderr.split()
    return omp, int(threads)


@pytest.mark.slow
def test_the_ranks_of_a_command_on_one_node_share_its_threads(monkeypatch):
    """``exec`` gives a node's command the node's share of the cores, and torchrun passes a set
    OMP_NUM_THREADS on to each rank as it is: each of a shardwire command's ranks takes its part of
    that share (torchrun --nproc-per-node 2 -m shardwire ..., or shardwire train --nproc 2), not all
    of it; a value the user set stands."""
    monkeypatch.setattr(os, "cpu_count", lambda: 4)  # a node's share is 2 threads, which any machine runs
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    bed = spec.Testbed("shardwire-test", 2, RATE)
    node = job.node_environment(bed)
    assert (node["OMP_NUM_THREADS"], node[NODE_THREADS]) == ("2", "2")
    assert [_worker_threads(node, ranks) for ranks in (1, 2)] == [("2", 2), ("1", 1)]
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert _worker_threads(job.node_environment(bed, 2), 2) == ("2", 2)  # `run` gave each rank its part already
    # a value the user gave the command stands
    for name, value in (("OMP_NUM_THREADS", "3"), (NODE_THREADS, "4"), ("LOCAL_WORLD_SIZE", "2")):
        monkeypatch.setenv(name, value)
    share_node_threads()
    assert (os.environ["OMP_NUM_THREADS"], os.environ.get(NODE_THREADS)) == ("3", None)


def test_an_option_after_execs_node_is_refused_not_run_as_the_command(capsys):
    assert main(["testbed", "exec", "node0", "--name", "shardwire-other", "--", "hostname"]) == 2
    said = capsys.readouterr().err
    assert "'--name' after the node would be the command: give exec's options before the node" in said
    meant = _suggested(said)  # the command meant, the options before the node
    assert (meant.name, meant.node, meant.command) == ("shardwire-other", "node0", ["hostname"])


def test_like_refuses_what_it_cannot_build(monkeypatch, capsys):
    monkeypatch.setattr(network, "require_privileges", lambda *given: None)
    assert main(["testbed", "up", "--nodes", "2"]) == 2
    assert "give the link rate: --link RATE (e.g. 1gbit) or --like PRESET" in capsys.readouterr().err
    assert main(["testbed", "up", "--nodes", "2", "--like", "h100-100gbe", "--nproc-per-node", "0"]) == 2
    assert "--nproc-per-node must be at least 1, got 0" in capsys.readouterr().err
    assert main(["testbed", "up", "--nodes", "2", "--like", "h100-100gbe", "--nproc-per-node", "1000000"]) == 2
    assert "2,000,000 workers take over" in capsys.readouterr().err  # refused before measuring, as `run` refuses
    assert main(["testbed", "up", "--nodes", "2", "--like", "h100-nvlink"]) == 2
    assert "--like 'h100-nvlink' is not a cluster preset; choose one of" in capsys.readouterr().err
    assert main(["testbed", "up", "--nodes", "2", "--link", "1gbit", "--nproc-per-node", "2"]) == 2
    assert "--nproc-per-node sets the node's compute for --like" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["testbed", "up", "--nodes", "2", "--link", "1gbit", "--like", "h100-100gbe"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_names_must_carry_the_prefix():
    assert check_name("shardwire-ci") == "shardwire-ci"
    for bad in ("ci", "shardwire_x", "shardwire-", "shardwire--ci", "../shardwire", "shardwire-A"):
        with pytest.raises(spec.TestbedError, match="must be 'shardwire' and words of lowercase letters or digits, "
                                                    "each after one '-'"):
            check_name(bad)


def test_without_root_it_says_what_it_needs(monkeypatch, capsys):
    """...and the command to run instead: the user's own, as root."""
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(["testbed", "up", "--name", "shardwire-lab", "--nodes", "2", "--link", "1gbit"]) == 2
    said = capsys.readouterr().err
    assert "needs root" in said and said.endswith(
        "Run it as root: `sudo shardwire testbed up --name shardwire-lab --nodes 2 --link 1gbit`\n"), said


def _suggested(said: str) -> argparse.Namespace:
    """The testbed command a message suggests (between backticks), as ``shardwire testbed`` parses it:
    what it would act on, run as printed."""
    words = shlex.split(re.search(r"`(shardwire testbed [^`]*)`", said)[1])
    parsed = command("testbed")[1].parse_args(words[2:])
    if getattr(parsed, "command", [])[:1] == ["--"]:  # as `run` and `exec` read what follows --
        parsed.command = parsed.command[1:]
    return parsed


@pytest.fixture
def recorded(monkeypatch, tmp_path):
    """A testbed named other than the default, of an odd node count and rate, as ``up`` records it, and
    taken for built: what ``run``, ``exec`` and ``link`` check before they act, without root."""
    monkeypatch.setattr(spec, "STATE_DIR", tmp_path)
    monkeypatch.setattr(network, "require_privileges", lambda *given: None)
    monkeypatch.setattr(network, "is_up", lambda testbed: True)
    bed = spec.Testbed("shardwire-test-named", 3, 1_234_560)  # 1.235mbit to four digits
    bed.save()
    return bed


@pytest.mark.parametrize("name", [spec.DEFAULT_NAME, "shardwire-test-named"])
def test_a_suggested_command_acts_on_the_users_testbed(name, monkeypatch, tmp_path, capsys):
    """Each command a refusal suggests runs as printed on the testbed the user named: ``--name`` for
    any but the default, and the nodes and rate of a testbed to build again."""
    monkeypatch.setattr(spec, "STATE_DIR", tmp_path)
    monkeypatch.setattr(network, "require_privileges", lambda *given: None)
    assert main(["testbed", "run", "--name", name, "--", "job.py"]) == 2
    said = capsys.readouterr().err
    assert f"no testbed {name!r} is up; build one first" in said
    up = _suggested(said)
    assert (up.action, up.name, up.nodes, up.link) == ("up", name, 2, "1gbit")
    assert ("--name" in said) == (name != spec.DEFAULT_NAME)
    spec.Testbed(name, 3, 1_234_560).save()  # recorded, but its namespaces are not all there
    monkeypatch.setattr(network, "is_up", lambda testbed: False)
    assert main(["testbed", "run", "--name", name, "--", "job.py"]) == 2
    up = _suggested(capsys.readouterr().err)
    assert (up.action, up.name, up.nodes, parse_rate(up.link)) == ("up", name, 3, 1_234_560)
    spec.state_path(name).write_text("{")
    assert main(["testbed", "run", "--name", name, "--", "job.py"]) == 2
    down = _suggested(capsys.readouterr().err)
    assert (down.action, down.name) == ("down", name)


@pytest.mark.parametrize("state, damage", [
    ({"rate_bits": -5}, "the link rate must be 100kbit to 100gbit, got -5 bit/s"),
    ({"rate_bits": True}, "the link rate must be 100kbit to 100gbit, got True bit/s"),
    ({"name": "shardwire-other"}, "it records testbed 'shardwire-other'"),
])
def test_a_state_file_of_values_up_never_records_is_damaged(recorded, capsys, state, damage):
    """A rate of -5 was taken as it was: ``check`` printed a -5bit link, and a note of another
    testbed's name suggested building that one."""
    path = state_path(recorded.name)
    path.write_text(json.dumps({"name": recorded.name, "nodes": 3, "rate_bits": 1_234_560, **state}))
    assert main(["testbed", "check", "--name", recorded.name]) == 2
    assert capsys.readouterr().err == (f"error: the state file {path} is damaged ({damage}); run `shardwire testbed "
                                       f"down --name {recorded.name}` and up again\n")


def test_a_second_up_like_keeps_the_testbed_its_measurement_is_near(recorded, monkeypatch):
    """A probe of a rank's compute moves by a few percent from run to run, over a rounding edge at
    times: a second ``up --like`` rebuilt the testbed at 1.8mbit where 1.9 was up."""
    name, nodes = recorded.name, recorded.nodes
    assert regime.kept_rate(name, nodes, 1_300_000) == recorded.rate_bits  # 5% off
    assert regime.kept_rate(name, nodes, 1_500_000) == 1_500_000  # 18% off: another regime
    assert regime.kept_rate(name, 2, 1_300_000) == 1_300_000  # other nodes
    monkeypatch.setattr(network, "is_up", lambda testbed: False)  # recorded, but not all there
    assert regime.kept_rate(name, nodes, 1_300_000) == 1_300_000


def test_a_link_cut_while_a_check_measures_it_is_named(recorded, monkeypatch):
    """The check said only that a transfer took over its timeout, where a failed job names the cut."""
    def cut_while_sending(testbed, source, target, nbytes, timeout_s):
        spec.record_cut(testbed.name, 1, time.time())
        raise spec.TestbedFailure(f"a transfer from node{source} to node{target} took over {timeout_s:g}s")

    monkeypatch.setattr(check, "transfer", cut_while_sending)
    monkeypatch.setattr(network, "links_down", lambda testbed: [1])
    with pytest.raises(spec.TestbedFailure, match=r"^a transfer from node0 to node1 took over \d+s, after `shardwire "
                                                   r"testbed link` cut the link of node1$"):
        check.check(recorded, seconds=1.0)
    monkeypatch.setattr(network, "cut_since", lambda name, since: [])  # cut with `ip link`: not the command's
    with pytest.raises(spec.TestbedFailure, match=r"^a transfer from node0 to node1 took over \d+s, after the link of "
                                                   r"node1 went down$"):
        check.check(recorded, seconds=1.0)


def test_a_command_left_out_is_suggested_on_the_users_testbed(recorded, capsys):
    assert main(["testbed", "run", "--name", recorded.name]) == 2
    run = _suggested(capsys.readouterr().err)
    assert (run.action, run.name, run.command[:2]) == ("run", recorded.name, ["-m", "shardwire"])
    assert main(["testbed", "exec", "--name", recorded.name, "node2"]) == 2
    execute = _suggested(capsys.readouterr().err)
    assert (execute.action, execute.name, execute.node, execute.command) == ("exec", recorded.name, "node2",
                                                                              ["hostname"])
    assert main(["testbed", "exec", "node2", "--name", recorded.name, "hostname"]) == 2  # no --: only the form
    assert "as in shardwire testbed exec [--name NAME] NODE -- CMD..." in capsys.readouterr().err


def test_refusals_exit_2_and_what_the_machinery_cannot_do_1(recorded, monkeypatch, capsys):
    """What the user gave or must do first is a refusal, 2, as every command's; an ``ip`` or ``tc``
    command that fails, or a measurement, is not the user's input, and ends as a failed job, 1."""
    refusals = [["up", "--name", "lab", "--nodes", "2", "--link", "1gbit"],
                ["up", "--name", recorded.name, "--nodes", "65", "--link", "1gbit"],
                ["up", "--name", recorded.name, "--nodes", "2", "--link", "1gb"],
                ["link", "--name", recorded.name, "node3", "down"],
                ["check", "--name", recorded.name, "--seconds", "0"],
                ["run", "--name", recorded.name, "--max-restarts", "-1", "--", "job.py"],
                ["run", "--name", recorded.name, "--nproc-per-node", "0", "--", "job.py"],
                ["link", "--name", "shardwire-test-none", "node0", "down"]]
    for argv in refusals:
        assert main(["testbed", *argv]) == 2, argv
        said = capsys.readouterr().err
        assert said.startswith("error: ") and said.count("\n") == 1, said

    def fails(*given):
        raise spec.TestbedFailure("`ip netns delete shardwire-test-named-hub` failed: Device or resource busy")

    monkeypatch.setattr(network, "down", fails)
    monkeypatch.setattr(network, "set_link", fails)
    for argv in (["down", "--name", recorded.name], ["link", "--name", recorded.name, "node1", "down"]):
        assert main(["testbed", *argv]) == 1, argv
        assert capsys.readouterr().err == ("error: `ip netns delete shardwire-test-named-hub` failed: Device or "
                                           "resource busy\n")


@pytest.mark.skipif(shutil.which("ip") is None, reason="needs iproute2's ip")
def test_a_failed_ip_command_is_a_failure_not_a_refusal():
    with pytest.raises(spec.TestbedFailure, match="`ip link show shardwire-test-none` failed: .*does not exist"):
        network._run("ip", "link", "show", "shardwire-test-none")


def _node(tmp_path, body: str, *args: str) -> subprocess.CompletedProcess:
    """One node's launcher (``shardwire.testbed.node``, as ``run`` starts it on each node) of a
    one-rank job here, given ``args``, with its output."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(body))
    return subprocess.run([sys.executable, "-m", "shardwire.testbed.node", "--standalone", "--nproc-per-node=1",
                           "--", str(script), *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.slow
def test_a_jobs_options_are_its_own_not_torchruns(tmp_path):
    """torchrun's parser read the job's options too: `shardwire train --nproc 3` was refused on every
    node as an ambiguous abbreviation of its own --nproc-per-node, with its usage."""
    done = _node(tmp_path, "import sys; print(sys.argv[1:])", "--nproc", "3", "--max-restarts", "1")
    assert done.returncode == 0 and "['--nproc', '3', '--max-restarts', '1']" in done.stdout, done.stderr[-2000:]


@pytest.mark.slow
def test_a_node_whose_worker_fails_says_it_in_one_line_not_torchruns_traceback(tmp_path):
    """torchrun ended each node of a failed job with its ChildFailedError's traceback and table, thirty
    lines after the worker's own one: a worker that refused (2) said why, and its node adds nothing;
    one that failed otherwise is named in one line."""
    refused = _node(tmp_path, """
        import sys
        print("error: --lr must be a positive, finite number, got -1.0", file=sys.stderr)
        sys.exit(2)
    """)
    assert (refused.returncode, refused.stdout, refused.stderr) == (
        2, "", "error: --lr must be a positive, finite number, got -1.0\n"), refused.stderr
    failed = _node(tmp_path, "import sys; sys.exit(3)")
    assert (failed.returncode, failed.stdout, failed.stderr) == (
        1, "", "error: worker processes failed: rank 0 (exit 3); any message it gave is above\n"), failed.stderr


def _host_network() -> tuple[set[str], str]:
    """The host namespace's links and qdiscs, which a testbed must never touch."""
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    qdiscs = subprocess.run(["tc", "qdisc", "show"], capture_output=True, text=True, check=True).stdout
    return {line.split(":")[1].strip() for line in links.splitlines()}, qdiscs


def _leftovers(name: str) -> list[str]:
    """Anything of testbed ``name`` still on the machine: namespaces, hosts files, the state file."""
    found = network.existing_namespaces(name)
    found += [str(p) for p in network.NETNS_ETC.glob(f"{name}-*")] if network.NETNS_ETC.is_dir() else []
    return found + ([str(state_path(name))] if state_path(name).exists() else [])


@pytest.fixture(scope="module")
def testbed():
    bed = spec.Testbed("shardwire-test", 2, RATE)
    network.up(bed)
    yield bed
    network.down(bed.name)


def _script(tmp_path, body: str) -> list[str]:
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(body))
    return [str(path)]


@pytest.mark.root
@pytest.mark.slow
@root_only
def test_gloo_job_runs_across_the_nodes(testbed, tmp_path):
    command = _script(tmp_path, """
        import os, torch, torch.distributed as dist
        dist.init_process_group("gloo")
        total = torch.tensor([dist.get_rank() + 1.0])
        dist.all_reduce(total)
        print(f"rank {dist.get_rank()} of {dist.get_world_size()} on {os.environ['GLOO_SOCKET_IFNAME']}: {total.item():g}")
        dist.destroy_process_group()
    """)
    out = io.StringIO()
    assert job.run_job(testbed, 1, command, out=out) == 0, out.getvalue()
    ranks = re.findall(r"^\[node(\d)\] rank (\d) of 2 on eth0: 3$", out.getvalue(), re.MULTILINE)
    assert sorted(node for node, _ in ranks) == ["0", "1"], out.getvalue()
    assert sorted(rank for _, rank in ranks) == ["0", "1"], out.getvalue()


@pytest.mark.root
@pytest.mark.slow
@root_only
def test_each_layout_sends_between_nodes_what_it_computes(testbed, tmp_path):
    """2 nodes x 2 ranks: the bytes the nodes' links receive per step, against what
    ``shardwire.engine.layout`` says crosses between two nodes in fp32 (each collective's buffer
    ``S``): full 3 S per block (gather twice, reduce-scatter) and 2 S for the root and the last two
    blocks (gathered once: the root stays gathered, and backward opens with the last two);
    hybrid 2 S per buffer (each rank's shard all-reduced with the other node's); hybrid_secondary
    2 S per buffer (the forward gather and the reduce-scatter). The links add the frames' headers,
    the TCP acknowledgements and the collectives' own headers: about 1%."""
    command = _script(tmp_path, """
        import os, torch, torch.distributed as dist
        import shardwire
        from shardwire.engine.shard import engine_of
        from shardwire.models.gpt import GPT, PRESETS, Block, loss_fn

        def received():
            dist.barrier()  # every rank's collectives complete, so every byte of them arrived
            mine = 0
            if os.environ["LOCAL_RANK"] == "0":  # one count per node
                with open("/sys/class/net/eth0/statistics/rx_bytes") as f:
                    mine = int(f.read())
            total = torch.tensor(float(mine), dtype=torch.float64)
            dist.all_reduce(total)
            return total.item()

        dist.init_process_group("gloo")
        for layout in ("full", "hybrid", "hybrid_secondary"):
            torch.manual_seed(0)
            model = shardwire.shard(GPT(PRESETS["small"]), units=[Block], layout=layout)
            engine = engine_of(model)
            tokens = torch.randint(0, 256, (1, PRESETS["small"].seq_len + 1))
            step = lambda: loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
            step()
            before = received()
            for _ in range(3):
                step()
            per_step = (received() - before) / 3
            sizes = [4 * flat.packing.padded_numel for flat in engine.flats]
            root, blocks = sizes[0], sizes[1:]
            expected = 3 * sum(blocks) - sum(blocks[-2:]) + 2 * root if layout == "full" else 2 * sum(sizes)
            if dist.get_rank() == 0:
                print(f"{layout}: {per_step / expected:.3f}", flush=True)
        dist.destroy_process_group()
    """)
    out = io.StringIO()
    assert job.run_job(testbed, 2, command, out=out) == 0, out.getvalue()
    ratios = dict(re.findall(r"^\[node0\] (\w+): ([\d.]+)$", out.getvalue(), re.MULTILINE))
    assert ratios.keys() == {"full", "hybrid", "hybrid_secondary"}, out.getvalue()
    for layout, ratio in ratios.items():  # measured: 1.007 to 1.011
        assert 1.0 <= float(ratio) <= 1.05, f"{layout}: {ratio} x the computed bytes"


@pytest.mark.root
@pytest.mark.slow
@root_only
def test_a_failing_node_stops_the_job(testbed, tmp_path):
    command = _script(tmp_path, """
        import os, sys, time
        if os.environ["GROUP_RANK"] == "1":  # one node fails at once, the other would run for long
            sys.exit(3)
        time.sleep(600)
    """)
    out = io.StringIO()
    start = time.monotonic()
    assert job.run_job(testbed, 1, command, out=out) != 0
    assert time.monotonic() - start < 60, "the healthy node was not stopped"
    assert re.search(r"^node\d failed \(exit \d+\): stopping the other nodes$", out.getvalue(), re.MULTILINE)
    for namespace in testbed.namespaces:
        assert not subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, check=True).stdout


def test_a_link_down_is_said_as_it_goes_and_as_it_comes_back(monkeypatch):
    """Read every time it is asked (no interval), as a job's wait loop asks: a link down at the first
    read is said too, and a testbed removed under the job says nothing (its failure does)."""
    bed = spec.Testbed("shardwire-test-links", 3, 1_000_000)
    reads = iter([[2], [1, 2], [1, 2], [], spec.TestbedFailure("gone")])

    def reading(testbed):
        read = next(reads)
        if isinstance(read, Exception):
            raise read
        return read

    monkeypatch.setattr(job, "links_down", reading)
    monkeypatch.setattr(job, "LINKS_POLL_S", 0.0)
    out = io.StringIO()
    links = job._Links(bed, restarts=True)
    for _ in range(5):
        links.say_changes(out, threading.Lock())
    waits = ("the job waits for it, its collectives until they time out (600s by default: shardwire train's "
             "--timeout) and a restart's rendezvous up to 600s more, unless `shardwire testbed link --name "
             "shardwire-test-links node{} up` connects it again")
    assert out.getvalue().splitlines() == [f"node2's link is down: {waits.format(2)}",
                                           f"node1's link is down: {waits.format(1)}",
                                           "node1's link is up again", "node2's link is up again"]


@pytest.mark.root
@pytest.mark.slow
@root_only
def test_a_link_cut_while_a_job_runs_is_said_and_so_is_its_return(testbed, tmp_path, monkeypatch):
    """A job whose node was cut off said nothing until its collectives timed out, ten minutes by
    default, and its restart waited as long again at the rendezvous."""
    monkeypatch.setattr(job, "LINKS_POLL_S", 0.2)
    started = [tmp_path / f"node{node}" for node in range(2)]
    command = _script(tmp_path, f"""
        import os, pathlib, time
        pathlib.Path({str(tmp_path)!r}, "node" + os.environ["GROUP_RANK"]).touch()
        time.sleep(4)
    """)

    def cut_while_they_run():  # after the rendezvous, which a cut link would hold up
        while not all(path.exists() for path in started):
            time.sleep(0.05)
        network.set_link(testbed, 1, False)
        time.sleep(1.5)
        network.set_link(testbed, 1, True)

    cutting = threading.Thread(target=cut_while_they_run, daemon=True)
    cutting.start()
    out = io.StringIO()
    try:
        assert job.run_job(testbed, 1, command, out=out) == 0, out.getvalue()
    finally:
        cutting.join(timeout=10)
        network.set_link(testbed, 1, True)
    assert out.getvalue().splitlines() == [
        "node1's link is down: the job waits for it, its collectives until they time out (600s by default: shardwire "
        "train's --timeout), unless `shardwire testbed link --name shardwire-test node1 up` connects it again",
        "node1's link is up again"]


@pytest.mark.root
@pytest.mark.slow
@root_only
def test_a_node_done_at_its_exit_barrier_adds_nothing_when_the_node_holding_it_fails(testbed, tmp_path,
                                                                                        monkeypatch):
    """Node 1's worker ends at once (as export's other ranks do) and its agent waits at the exit
    barrier that node 0 holds; node 0's worker refuses. Node 1 logged the barrier's traceback, and
    the job's SIGTERM, landing while that log imported torch._dynamo, a second one: a hundred lines."""
    command = _script(tmp_path, """
        import os, sys, time
        if os.environ["GROUP_RANK"] == "0":
            time.sleep(3)  # the other node is at the exit barrier
            print("error: refused", file=sys.stderr)
            sys.exit(2)
    """)
    monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", "FATAL")  # as the command sets it (cli.main)
    out = io.StringIO()
    assert job.run_job(testbed, 1, command, out=out) == 2
    assert out.getvalue() == "[node0] error: refused\nnode0 failed (exit 2): stopping the other nodes\n"


@pytest.mark.root
@pytest.mark.slow
@root_only
def test_a_shardwire_job_refused_says_so_once_per_node_or_once_before_any_starts(testbed, tmp_path):
    """A bad option, or data that is not there, is refused before any node starts, in one line, as
    ``shardwire train`` refuses it; the job ends with a refusal's status."""
    def run(*options: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "shardwire", "testbed", "run", "--name", testbed.name, "--", "-m",
                               "shardwire", "train", "--model", "tiny", "--steps", "2", *options],
                              capture_output=True, text=True, timeout=300)

    bad = run("--lr", "-1")
    assert (bad.returncode, bad.stdout, bad.stderr) == (2, "", "error: --lr must be a positive, finite number, got "
                                                               "-1.0\n")
    missing = run("--data", str(tmp_path / "none.txt"))
    assert (missing.returncode, missing.stdout, missing.stderr) == (
        2, "", f"error: --data {tmp_path / 'none.txt'} does not exist: give a path that exists\n")
    (tmp_path / "notes.jsonl").write_text("the user's\n")  # an output refused: node0's worker said it, node1 blamed
    taken = run("--log-jsonl", str(tmp_path / "notes.jsonl"))  # the rendezvous, and node0's failure ended the job
    assert (taken.returncode, taken.stdout) == (2, "") and taken.stderr.startswith(
        f"error: --log-jsonl {tmp_path / 'notes.jsonl'} exists and is not a `--log-jsonl` log") and \
        taken.stderr.count("\n") == 1, taken.stderr


@pytest.mark.root
@pytest.mark.slow
@root_only
def test_exec_runs_on_a_node_under_its_name_and_a_cut_link_carries_nothing_until_it_is_up(testbed, capsys):
    """``exec`` runs as on a machine of the cluster (its hostname resolves to its address); ``link
    down`` pulls the node's cable: a connection to it fails until ``link up``."""
    def exec_on(node: int, code: str, *, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "shardwire", "testbed", "exec", "--name", testbed.name,
                               f"node{node}", "--", sys.executable, "-c", code],
                              capture_output=True, text=True, timeout=timeout)

    named = exec_on(1, "import socket; name = socket.gethostname(); print(name, socket.gethostbyname(name))")
    assert named.stdout.split() == [testbed.namespace(1), testbed.address(1)], named.stderr
    server = subprocess.Popen([sys.executable, "-m", "shardwire", "testbed", "exec", "--name", testbed.name, "node1",
                               "--", sys.executable, "-c", "import socket, time\n"
                               "s = socket.create_server(('', 29999)); s.settimeout(60)\n"
                               "while True: s.accept()[0].close()"])
    connect = f"import socket; socket.create_connection(('{testbed.namespace(1)}', 29999), timeout=2); print('ok')"
    started = time.time()
    try:
        deadline = time.monotonic() + 30
        while exec_on(0, connect).stdout.strip() != "ok":
            assert time.monotonic() < deadline, "node1 never listened"
        assert main(["testbed", "link", "--name", testbed.name, "node1", "down"]) == 0
        assert "timed out" in exec_on(0, connect).stderr
        # a check of a testbed with a node cut off said so in a probe's traceback
        assert main(["testbed", "check", "--name", testbed.name]) == 2
        assert links_down(testbed) == [1] and cut_since(testbed.name, started) == [1]
        assert main(["testbed", "link", "--name", testbed.name, "node1", "up"]) == 0
        assert exec_on(0, connect).stdout.strip() == "ok"
        # a probe a killed check left running is stopped by the next check, which it would have slowed
        left = subprocess.Popen([sys.executable, "-m", "shardwire", "testbed", "exec", "--name", testbed.name, "node1",
                                 "--", sys.executable, check.probe.__file__, "receive", "--bind", testbed.address(1),
                                 "--timeout", "60"], stdout=subprocess.PIPE, text=True)
        assert left.stdout.readline().startswith("ready")
        capsys.readouterr()
        assert main(["testbed", "check", "--name", testbed.name]) == 0
        assert f"note: stopped what a job or check that was killed left on the nodes (process {left.pid}: " in \
            capsys.readouterr().err
        assert left.wait(timeout=30) != 0
    finally:
        network.set_link(testbed, 1, up=True)
        server.kill()
        server.wait()


@pytest.mark.root
@root_only
def test_shaping_holds(testbed):
    findings = check.check(testbed, seconds=1.0)
    assert all(finding.ok for finding in findings), "\n".join(map(str, findings))
    burst_bits = network.burst_bytes(RATE) * 8
    for finding in findings:
        t = finding.transfer
        if t.source != t.target:  # never faster than the link (and its bucket) allows
            assert t.nbytes * 8 <= RATE * t.seconds * 1.02 + burst_bits
        else:  # loopback inside a node is much faster
            assert t.bits_per_s > 2 * RATE


@pytest.mark.root
@root_only
def test_up_is_idempotent_and_down_leaves_nothing():
    name = "shardwire-test-updown"
    network.down(name)  # whatever an interrupted run left
    host_before = _host_network()
    try:
        assert network.up(spec.Testbed(name, 2, RATE))
        assert not network.up(spec.Testbed(name, 2, RATE))  # same layout: nothing changes
        assert network.up(spec.Testbed(name, 3, RATE))  # another layout: rebuilt
        assert network.existing_namespaces(name) == [f"{name}-hub", *(f"{name}-node{k}" for k in range(3))]
    finally:
        assert main(["testbed", "down", "--name", name]) == 0
    assert _leftovers(name) == []
    assert _host_network() == host_before


@pytest.mark.root
@root_only
def test_a_failed_up_leaves_nothing(monkeypatch):
    name = "shardwire-test-broken"
    real_run = network._run

    def tc_fails(*argv):
        if argv[0] == "tc":
            raise spec.TestbedError("tc refused")
        return real_run(*argv)

    monkeypatch.setattr(network, "_run", tc_fails)
    with pytest.raises(spec.TestbedError, match="tc refused"):
        network.up(spec.Testbed(name, 2, RATE))
    monkeypatch.undo()
    assert _leftovers(name) == []
