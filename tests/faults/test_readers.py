"""Every file a command reads goes through the one bounded reader (``shardwire.mappings``): a
profile given to ``simulate --calibrate`` or ``report`` that is endless, deep, not UTF-8 or holds
values no profile holds is one line; names in messages are cut short; two testbed commands that
change one testbed take turns; and the profile's summary line is one rank's own step."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import types

import pytest

import shardwire
from shardwire.cli import main
from shardwire.models.gpt import GPT, PRESETS, Block
from shardwire.mappings import MAX_JSON_BYTES
from shardwire.profile import analysis
from shardwire.testbed import network, regime, spec
from shardwire.training import loop
from harness import PROFILE, measured, timelined

pytestmark = pytest.mark.timeout(60)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CALIBRATE = ["simulate", "--model", "gpt-1.3b", "--cluster", "{preset: h100-rdma-3200, gpu: h200}", "--calibrate"]
LONG = "x" * 100_000
DEEP = "[" * 200_000 + "]" * 200_000
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: builds network namespaces, links and qdiscs")


def refusal(argv: list[str], capsys) -> str:
    """The one line ``shardwire`` ends ``argv`` with, failing."""
    status = main(argv)
    message = capsys.readouterr().err.strip()
    assert status != 0 and "\n" not in message and "Traceback" not in message, message
    return message


def profile_with(tmp_path, change) -> str:
    """The path of a copy of a real profile, changed by ``change(document)``."""
    with open(PROFILE) as f:
        document = json.load(f)
    change(document)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(document))
    return str(path)


def test_a_real_profile_still_calibrates(capsys):
    assert main([*CALIBRATE, PROFILE]) == 0
    assert "(calibrated by gpt-1.3b-b8.json)" in capsys.readouterr().out


def test_calibrate_takes_a_run_directory_as_report_does(tmp_path, capsys):
    (tmp_path / "profile.json").write_bytes(open(PROFILE, "rb").read())
    assert main([*CALIBRATE, str(tmp_path)]) == 0
    assert f"(calibrated by {tmp_path.name})" in capsys.readouterr().out
    (tmp_path / "empty").mkdir()
    said = refusal([*CALIBRATE, str(tmp_path / "empty")], capsys)
    assert f"{tmp_path / 'empty'} is a directory that holds no profile.json: give the profile.json" in said, said
    # a directory named as the profile: said of the path given, by both commands, not of one made up
    (tmp_path / "run" / "profile.json").mkdir(parents=True)
    said = refusal([*CALIBRATE, str(tmp_path / "run" / "profile.json")], capsys)
    assert said.endswith(f"{tmp_path / 'run' / 'profile.json'} is a directory that holds no profile.json: give the "
                         f"profile.json `shardwire train --profile` wrote, or its --run-dir"), said
    said = refusal(["report", str(tmp_path / "run")], capsys)
    assert said.endswith(f"{tmp_path / 'run' / 'profile.json'} is a directory, not a file: give the file that holds "
                         f"it"), said
    assert "nonexist.json does not exist: give the profile.json `shardwire train --profile` wrote, or its run " \
           "directory" in refusal([*CALIBRATE, "nonexist.json"], capsys)
    assert "nonexist does not exist: give the run directory that holds a profile.json" in refusal(
        ["report", "nonexist"], capsys)


def test_an_empty_profile_or_a_pipe_nothing_was_written_to_says_so(tmp_path, capsys):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "blank").write_text(" \n")
    assert f"{tmp_path / 'blank'} is empty; profile the run again" in refusal(
        [*CALIBRATE, str(tmp_path / "blank")], capsys)
    assert f"{fifo} is a FIFO that nothing was written to" in refusal([*CALIBRATE, str(fifo)], capsys)


def test_calibrate_reads_a_device_never_and_a_file_up_to_a_bound(tmp_path, capsys):
    assert "/dev/zero is a character device, not a file: give the file that holds it" in refusal(
        [*CALIBRATE, "/dev/zero"], capsys)
    huge = tmp_path / "profile.json"
    with huge.open("wb") as f:
        f.truncate(MAX_JSON_BYTES + 1)  # sparse: no disk taken
    assert f"{huge} is larger than {MAX_JSON_BYTES:,} bytes" in refusal([*CALIBRATE, str(huge)], capsys)


@pytest.mark.parametrize("key, value, message", [
    ("world_size", 0, "is damaged (its world_size is 0, not a count of ranks)"),
    ("world_size", "2", "is damaged (its world_size is '2', not a count of ranks)"),
    ("world_size", None, "is damaged (its world_size is None, not a count of ranks)"),
    ("world_size", True, "is damaged (its world_size is True, not a count of ranks)"),
    ("world_size", 2.0, "is damaged (its world_size is 2.0, not a count of ranks)"),  # as report reads it
    ("world_size", json.loads("[" * 500 + "]" * 500), "is damaged (its world_size is [[[...]]]"),
    # a world other than the one its timeline and steps hold: report refuses it, and so does calibrate
    ("world_size", 64, "is damaged (its timeline holds 1 ranks' steps for a world_size of 64)"),
    ("model", 5, "is damaged (its metadata's model is 5, not a name)"),
    ("model", LONG, "its job cannot be simulated: unknown model preset 'xxx"),
    ("seq_len", "long", "its job cannot be simulated: model: seq_len must be a whole number, got 'long'"),
    # another model's name, fitted to the times of the one that ran, predicted a step 8.6 times too long
    ("model", "gpt-125m", "is damaged (its model flops_per_token, 9.074e+09, are not those of its job, gpt-125m, "
                          "which does"),
    ("activation_checkpointing", True, "is damaged (its hardware flops_per_token, 9.074e+09, are not those of its "
                                       "job, gpt-1.3b recomputing every block, which does"),
    # an edited job, fitted to the times of the one that ran, predicted a step 7.5 times too long
    ("batch", 1, "is damaged (its job, 1 x 1 sequences of 2048 tokens on each of 1 ranks, is 2,048 tokens a step, "
                 "where its tokens_per_step is 16384)"),
])
def test_a_profile_holding_what_no_profile_holds_is_one_line(tmp_path, capsys, key, value, message):
    def change(document):  # the job's model is recorded twice, and edited alike (else refused as damaged)
        (document if key == "world_size" else document["metadata"]["config"])[key] = value
        if key == "model":
            document["metadata"]["model"] = value

    refused = refusal([*CALIBRATE, profile_with(tmp_path, change)], capsys)
    assert message in refused and len(refused) < 1000


def test_odd_paths_and_keys_are_named_with_what_to_do(tmp_path, capsys):
    """Each said the system's words alone (a permission deep in /proc, an I/O error as [Errno 5]),
    echoed a name of 300 bytes whole, or named a YAML key `preset:h100` with no word of the space."""
    assert refusal(["export", "/proc", str(tmp_path / "e.safetensors")], capsys) == (
        "error: /proc holds no checkpoint: give one (ckpt/step_00000400) or a --checkpoint-dir")
    with pytest.raises(SystemExit, match=r"^error: --data /proc/self/mem cannot be read \(Input/output error\): give "
                                         r"a text file, a directory of them, or token ids you can read$"):
        main(["train", "--model", "tiny", "--data", "/proc/self/mem"])
    said = refusal(["simulate", "--model", "tiny", "--cluster", "{preset:h100-rdma-3200}"], capsys)
    assert "unknown key(s) 'preset:h100-rdma-3200' (YAML reads `key:value` as one key: put a space after the " \
           "colon, `key: value`)" in said, said
    model = shardwire.shard(GPT(PRESETS["tiny"]), units=[Block])
    shardwire.save_checkpoint(tmp_path / "ckpt", model, step=1)
    long = tmp_path / ("a" * 300 + ".safetensors")
    said = refusal(["export", str(tmp_path / "ckpt"), str(long), "--model", "tiny"], capsys)
    assert "has a name of 312 bytes" in said and len(said) < 400, said
    # the system's words for a name too long, said of the option or argument that gave it
    name = "b" * 300
    said = refusal(["export", name, str(tmp_path / "e.safetensors")], capsys)
    assert said.startswith("error: CKPT 'bbb") and said.endswith(" cannot be read (File name too long): give a "
                                                                  "checkpoint, or a --checkpoint-dir, you can read")
    for option, wanted in (("--data", "files"), ("--tokenizer", "a tokenizer directory")):
        with pytest.raises(SystemExit, match=f"^error: {option}: bbb.* cannot be read \\(File name too long\\): "
                                             f"give {wanted} you can read$"):
            main(["train", "--model", "tiny", option, name] + (["--data", str(long)] if option == "--tokenizer"
                                                               else []))


@pytest.mark.parametrize("option", ["--checkpoint-dir", "--log-jsonl", "--data", "--model"])
def test_a_nul_character_in_a_name_is_refused_naming_its_option(tmp_path, capsys, option):
    """A config file's checkpoint_dir: "a\\0b" was refused in the system's words alone: "embedded null byte"."""
    config = tmp_path / "job.yaml"
    config.write_text(f'steps: 2\n{option[2:].replace("-", "_")}: "a\\0b"\n')
    said = refusal(["train", "--config", str(config)], capsys)
    assert said == (f"error: --config {config}: {option[2:].replace('-', '_')}: 'a\\x00b' holds a NUL character, which "
                    f"no name or path holds: give it without"), said


def test_an_optimizer_step_faster_than_the_gpus_memory_is_refused(tmp_path, capsys):
    def change(document):
        measured(document, "optimizer_s", 1e-6)

    refused = refusal([*CALIBRATE, profile_with(tmp_path, change)], capsys)
    assert "its optimizer step streams 3.683e+07 GB/s, more than the memory bandwidth of cluster" in refused, refused
    assert "of cluster 'h100-rdma-3200, changed' (4800 GB/s) allows" in refused  # not 'changed''s


@pytest.mark.parametrize("where, value, message", [
    ("metadata", [], "is damaged (metadata is a list, not a mapping, unlike a profile of `shardwire train "
                     "--profile`)"),
    ("summary", None, "is damaged (summary is null, not a mapping, unlike a profile"),
    ("world_size", "absent", "is damaged (its world_size is None, not a count of ranks)"),
])
def test_a_profile_missing_a_part_says_which(tmp_path, capsys, where, value, message):
    def change(document):
        if value == "absent":
            del document[where]
        else:
            document[where] = value

    refused = refusal([*CALIBRATE, profile_with(tmp_path, change)], capsys)
    assert message in refused, refused


BENCH = os.path.join(REPO, "benchmarks", "results", "bench_testbed_2x1_1gbit.json")


@pytest.mark.parametrize("change, message", [
    (lambda d: d["context"].update(nodes="1"), "its context.nodes is '1', not a whole number of at least 1"),
    (lambda d: d["context"].update(ranks_per_node=None), "its context.ranks_per_node is None, not a whole number"),
    (lambda d: d.update(context=None), "its context is null, not a mapping"),
    (lambda d: d.update(fit=[]), "its fit is [], not a mapping"),
    (lambda d: d["fit"]["inter"]["all_gather"].update(beta_Bps=-1.0),
     "its fit.inter.all_gather.beta_Bps is -1.0, not a positive rate in bytes per second"),
    (lambda d: d["fit"]["inter"]["all_gather"].update(alpha_s=-1.0),
     "its fit.inter.all_gather.alpha_s is -1.0, not a fitted latency in seconds"),
    (lambda d: d["fit"]["inter"]["all_gather"].update(alpha_s=float("nan")), "alpha_s is nan, not a fitted latency"),
    (lambda d: d["fit"]["inter"]["all_gather"].update(ranks=0), "ranks is 0, not a whole number from 1 to the 2 ranks"),
    (lambda d: d["fit"]["inter"]["reduce_scatter"].update(ranks=10**9), "ranks is 1000000000, not a whole number"),
    (lambda d: d["fit"].update(inter=[1]), "its fit.inter is [1], not a mapping"),
    (lambda d: d.update(contention={"inter": "x"}), "its contention.inter is 'x', not a mapping"),
    (lambda d: d["fit"]["inter"].update(all_gather="fast"), "its fit.inter.all_gather is 'fast', not a mapping"),
    (lambda d: d["fit"]["inter"]["all_gather"].pop("ranks"), "its fit.inter.all_gather has no ranks"),
    # edited apart from what was measured: a network 8 times slower, or a rate no size reached
    (lambda d: d["context"].update(ranks_per_node=8), "its context.world is 2, where its 2 nodes of 8 ranks make 16"),
    (lambda d: d["fit"]["inter"]["all_gather"].update(beta_Bps=9e12),
     "its fit.inter.all_gather has beta_Bps 9e+12, where its results give "),
    (lambda d: d["fit"]["inter"]["all_gather"].update(points=1), "its fit.inter.all_gather counts 1 sizes, where its "
                                                                 "results hold "),
    (lambda d: d["context"]["groups"]["inter"].update(ranks=3, members=[[0, 1, 2]]),  # its fit was dropped as of 1
     "its fit.inter.all_gather.ranks is 2, where its context's inter group has 3"),
    (lambda d: d.update(contention={"inter": {"compute_share": 0.9, "rank_shares": [0.05, 0.0]}}),
     "its contention.inter.compute_share is 0.9, where the median of its rank_shares is 0.025"),
    (lambda d: d["contention"]["inter"].update(ranks=8), "its contention.inter.ranks is 8, where its context's inter "
                                                         "group has 2"),
    (lambda d: d["contention"].update(intra=d["contention"]["inter"]),
     "its contention has 'intra', a group it did not measure (its groups: inter)"),
    # the checks of its contention cannot be turned off by damaging what they compare it with
    (lambda d: d["contention"]["inter"].update(compute_share=0.9, rank_shares=[0.9, 0.9], alone_s=-1),
     "its contention.inter gives alone_s -1 and beside_s "),
    (lambda d: [d["contention"]["inter"].pop(key) for key in ("alone_s", "beside_s")],
     "its contention.inter gives alone_s None and beside_s None, not the positive times"),
    (lambda d: d["context"].pop("groups"), "its context.groups is None, not a mapping of the groups it measured"),
    (lambda d: d["context"].update(groups=["inter"]), "its context.groups is ['inter'], not a mapping"),
    (lambda d: d["context"]["groups"]["inter"].pop("members"),
     "its context.groups.inter is {'ranks': 2}, not a group's ranks and its instances' members"),
    (lambda d: d["contention"]["inter"].update(rank_shares=d["contention"]["inter"]["rank_shares"] * 50),
     "its contention.inter.rank_shares holds 100 shares, where its context's inter group has 2 members"),
    (lambda d: d["contention"]["inter"].update(compute_share=1.5, rank_shares=[1.5, 1.5]),
     "its contention.inter.rank_shares is [1.5, 1.5], not a list of shares from 0 to 1"),
    (lambda d: d["contention"]["inter"].update(compute_share="0.02"),
     "its contention.inter.compute_share is '0.02', where the median of its rank_shares is "),
    (lambda d: d["results"]["inter"]["all_gather"][0]["out_of_place"].update(wrong="5"),
     "its 'all_gather' on the 'inter' group at 65536 bytes records '5' wrong elements, not a count"),
    (lambda d: d["results"]["inter"]["all_gather"][0]["out_of_place"].update(time_us=float("nan")),
     "its fit.inter.all_gather stands for results that are not sizes and times"),
    # measured so that its times are not the links': a quantized wire, wrong results, the fastest rank's
    (lambda d: d["context"]["settings"].update(wire="params=int8,grads=int8"),
     "was measured with --wire 'params=int8,grads=int8': its times are of quantized collectives"),
    (lambda d: d["results"]["inter"]["all_gather"][0].update(wire_bytes=100),  # its wire edited to none
     "sent its all_gather on inter through a quantized wire (its rows' wire_bytes): its times are of quantized"),
    (lambda d: d["results"]["inter"]["all_gather"][0]["out_of_place"].update(wrong=1000),
     "records wrong results (1000 elements of its 'all_gather' on the 'inter' group at "),
    (lambda d: d["context"]["settings"].update(combine="min"), "was measured with --combine 'min': a collective ends"),
])
def test_bench_results_missing_a_part_say_which(tmp_path, capsys, change, message):
    with open(BENCH) as f:
        document = json.load(f)
    change(document)
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(document))
    refused = refusal(["simulate", "--model", "gpt2-125m", "--cluster", "a100-100gbe", "--cluster-from", str(path)],
                      capsys)
    assert message in refused, refused


def test_a_bench_whose_median_times_do_not_give_its_median_share_is_read(tmp_path, capsys):
    """The median of the members' shares is not the share of their median times: a busy machine's
    own bench (`train --plan auto`'s probe) was refused as damaged, with a traceback."""
    with open(BENCH) as f:
        document = json.load(f)
    document["contention"]["inter"].update(alone_s=1.0, beside_s=1.0)  # times that give a share of 0
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(document))
    assert main(["simulate", "--model", "gpt2-125m", "--cluster", "a100-100gbe", "--cluster-from", str(path)]) == 0
    capsys.readouterr()


def _scaled_summary(document):
    document["summary"]["figures"]["forward_s"] = {stat: 20 * seconds for stat, seconds in
                                                   document["summary"]["figures"]["forward_s"].items()}


def _forward_five_times(document):
    """Every rank's forward made five times as long, with each step's figures and the summary made to
    agree, as the attacker of a profile would: the parts then outgrow the step."""
    for step in document["steps"]:
        for figures in step["ranks"]:
            figures["forward_s"] *= 5
        step["figures"]["forward_s"] = {stat: 5 * seconds for stat, seconds in step["figures"]["forward_s"].items()}
    document["summary"]["figures"]["forward_s"] = {stat: 5 * seconds for stat, seconds in
                                                   document["summary"]["figures"]["forward_s"].items()}


@pytest.mark.parametrize("change, said", [
    (_scaled_summary, "its summary's forward_s min is 1.56234, where the median of its steps' forward_s min is 0.0781172"),
    (_forward_five_times, "its step 0's rank 0 has parts adding up to "),
    (lambda d: (d["metadata"]["config"].update(seq_len=2048), d.update(tokens_per_step=10 * d["tokens_per_step"]),
                d["summary"].update(tokens_per_s=10 * d["summary"]["tokens_per_s"])),
     "its job, 8 x 1 sequences of 2048 tokens on each of 1 ranks, is 16,384 tokens a step, where its tokens_per_step "
     "is 163840"),
    (lambda d: d["steps"][3]["figures"]["backward_s"].update(max=100.0),
     "its step 3's backward_s max is 100, where its ranks give 0.169"),
    (lambda d: d["summary"].update(tokens_per_s=20 * d["summary"]["tokens_per_s"]),
     "its summary's tokens_per_s is 1.18583e+06, where its tokens_per_step over its step time give 59291.4"),
    (lambda d: d.update(warmup_steps=-3), "warmup_steps is -3, not a whole number"),
    (lambda d: d["metadata"].update(model="gpt-125m"),
     "its metadata's model is 'gpt-125m', where the job it ran has 'gpt-1.3b'"),
    (lambda d: d["metadata"].update(precision="fp32"),
     "its metadata's precision is 'fp32', where the job it ran has 'bf16'"),
    # a rank's figures that contradict one another, and steps that do not follow one another
    (lambda d: [figures.update(overlap_ratio=0.99) for step in d["steps"] for figures in step["ranks"]],
     "its step 0's rank 0 has an overlap ratio of 0.99, where its "),
    (lambda d: [figures.update(comm_s=10 * figures["step_s"]) for step in d["steps"] for figures in step["ranks"]],
     "its step 0's rank 0 has communication of "),
    (lambda d: d["steps"][2].update(step=1), "its steps are numbered [0, 1, 1, "),
])
def test_a_summary_its_steps_do_not_give_is_refused_by_both_readers(tmp_path, capsys, change, said):
    """A summary edited apart from its steps calibrated the simulator with figures no step measured,
    and was drawn by report; metadata edited apart from the job had report compare the runs by one
    model or precision where calibrate fitted another."""
    path = profile_with(tmp_path, change)
    for argv in ([*CALIBRATE, path], ["report", str(tmp_path), "--out", str(tmp_path / "plots")]):
        refused = refusal(argv, capsys)
        assert f"{path} is damaged ({said}" in refused, refused
    assert not (tmp_path / "plots").exists()


def test_a_file_that_is_not_a_profile_is_named_so(tmp_path, capsys):
    """A trace or an empty mapping was 'format version None'."""
    for text in ("{}", '{"traceEvents": []}'):
        path = tmp_path / "profile.json"
        path.write_text(text)
        for argv in ([*CALIBRATE, str(path)], ["report", str(tmp_path), "--out", str(tmp_path / "plots")]):
            assert f"{path} is not a profile: it holds no format version" in refusal(argv, capsys)


RACED = os.path.join(REPO, "benchmarks", "results", "link-100mbit", "profiles", "shardwire", "2x2-100mbit",
                     "profile.json")


def _shifted(rank: dict, seconds: float) -> None:
    """A rank's step and every span of it moved by ``seconds``."""
    rank["start"] += seconds
    rank["end"] += seconds
    for part in ("phases", "waits", "comms"):
        rank[part] = [[*span[:-2], span[-2] + seconds, span[-1] + seconds] for span in rank[part]]


@pytest.mark.parametrize("change, said", [
    (lambda t: t.update(step=99), "its timeline is of step 99, which its steps do not hold"),
    (lambda t: t["ranks"][0]["phases"][0].__setitem__(-1, 1e6), "its timeline's rank 0 has a span from "),
    (lambda t: t["ranks"][0].update(comms=[]), "its timeline's rank 0 gives comm_s 0, where its step "),
    (lambda t: t["ranks"][0].update(end=t["ranks"][0]["start"] + 100), "its timeline's rank 0 gives step_s 100"),
    (lambda t: _shifted(t["ranks"][1], 50.0), "its timeline's rank 3 ends its step at "),
])
def test_a_timeline_its_step_does_not_give_is_refused(tmp_path, capsys, change, said):
    """report drew a span a million seconds long, a step the profile does not hold, a rank moved
    seconds apart from the others or without its collectives, each as measured."""
    with open(RACED) as f:
        document = json.load(f)
    change(document["timeline"])
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(document))
    refused = refusal(["report", str(tmp_path), "--out", str(tmp_path / "plots")], capsys)
    assert f"{path} is damaged ({said}" in refused, refused
    assert not (tmp_path / "plots").exists()


def test_a_time_no_profiler_measures_is_refused(tmp_path, capsys):
    def change(document):
        measured(document, "forward_s", 1e-300)

    assert "must be seconds of at least 1e-06" in refusal([*CALIBRATE, profile_with(tmp_path, change)], capsys)


def test_times_no_profile_holds_are_shown_cut_short(tmp_path, capsys):
    def change(document):
        document["summary"]["figures"]["forward_s"]["median"] = [LONG]

    refused = refusal([*CALIBRATE, profile_with(tmp_path, change)], capsys)
    assert "is damaged (summary.figures.forward_s.median is ['xxx" in refused and "not a finite number" in refused
    assert len(refused) < 400


def test_a_profile_nested_deep_or_not_utf8_is_one_line(tmp_path, capsys):
    deep = tmp_path / "deep.json"
    deep.write_text(DEEP)
    assert f"{deep} nests deeper than a profile does" in refusal([*CALIBRATE, str(deep)], capsys)
    latin1 = tmp_path / "latin1.json"
    latin1.write_bytes(b'{"world_size": "\xff"}')
    assert f"{latin1} is not UTF-8 text (byte 16 is 0xff)" in refusal([*CALIBRATE, str(latin1)], capsys)


@pytest.mark.parametrize("digits", [5001, 401])
def test_a_number_longer_than_python_reads_is_one_line_naming_no_python_setting(tmp_path, capsys, digits):
    """Past Python's own bound, its refusal named its setting; past a float's, a warmup_steps of 10**400
    overflowed the profile's check in a traceback."""
    profile = tmp_path / "profile.json"
    profile.write_text('{"version": 1, "warmup_steps": ' + "9" * digits + "}")
    for argv in ([*CALIBRATE, str(profile)], ["report", str(tmp_path)]):
        refused = refusal(argv, capsys)
        assert f"{profile} holds a number of {digits:,} digits, more than any profile holds; profile the run again" \
            in refused and "sys." not in refused, refused


def test_report_of_a_deep_or_damaged_profile_is_one_line(tmp_path, capsys):
    profile = tmp_path / "profile.json"
    profile.write_text(DEEP)
    assert f"{profile} nests deeper than a profile does; profile the run again" in refusal(
        ["report", str(tmp_path)], capsys)
    profile.write_bytes(b'{"version": 1, "\xff": 1}')
    assert f"{profile} is not UTF-8 text" in refusal(["report", str(tmp_path)], capsys)
    profile.write_text(json.dumps({"version": LONG}))
    refused = refusal(["report", str(tmp_path)], capsys)
    assert "has format version 'xxx" in refused and len(refused) < 400
    with open(PROFILE) as f:
        document = json.load(f)
    for world in (0, -2, "2", None):  # a scaling report divides by it
        profile.write_text(json.dumps({**document, "world_size": world}))
        assert "is damaged (its world_size is" in refusal(["report", str(tmp_path)], capsys)


def _backward(value):
    return lambda document: document["summary"]["figures"]["backward_s"].update(median=value)


@pytest.mark.parametrize("change, said", [
    (_backward(float("nan")), "summary.figures.backward_s.median is nan"),
    (_backward(-0.5), "summary.figures.backward_s.median is -0.5"),
    (_backward(float("inf")), "summary.figures.backward_s.median is inf"),
    (_backward(1e308), "summary.figures.backward_s.median is 1e+308: times, bytes and ratios are numbers from 0 to "
                       "1e+15"),  # finite, but a plot's arithmetic overflows on it
    (lambda d: d["steps"][0]["ranks"][0].update(step_s="x"), "steps.0.ranks.0.step_s is 'x'"),
    (lambda d: d.update(tokens_per_step=-512), "tokens_per_step is -512"),
    (lambda d: d.update(world_size=5), "its timeline holds 1 ranks' steps for a world_size of 5"),
])
def test_report_draws_no_figure_a_profiler_cannot_measure(tmp_path, capsys, change, said):
    with open(PROFILE) as f:
        document = json.load(f)
    change(document)
    (tmp_path / "profile.json").write_text(json.dumps(document))  # NaN and Infinity as Python writes them
    refused = refusal(["report", str(tmp_path), "--out", str(tmp_path / "plots")], capsys)
    assert f"is damaged ({said}" in refused
    assert not (tmp_path / "plots").exists()


def _span(kind: str, index: int, value):
    return lambda d: d["timeline"]["ranks"][0][kind].__setitem__(index, value)


@pytest.mark.parametrize("change, said", [
    (lambda d: d.pop("timeline"), "the profile has no timeline"),
    (lambda d: d["steps"][0].pop("figures"), "steps.0 has no figures"),
    (lambda d: d["steps"][1].update(figures=[]), "steps.1.figures is a list, not a mapping"),
    (lambda d: d["steps"].__setitem__(0, 3), "steps.0 is a number, not a mapping"),
    (lambda d: d["steps"][0].update(step="x"), "steps.0.step is 'x', not a whole number"),
    (lambda d: d.update(steps={}), "steps is a mapping, not a list"),
    (lambda d: d["steps"][0]["figures"]["overlap_ratio"].update(median=7), "overlap_ratio.median is 7, not a ratio"),
    (lambda d: d.update(metadata=[]), "metadata is a list, not a mapping"),
    (_span("phases", 0, ["forward", None, 1.0]), "phases.0 is ['forward', None, 1.0], not a span of 4 values"),
    (_span("phases", 0, [[1], None, 1.0, 2.0]), "phases.0.0 is [1], not a name"),
    (_span("phases", 0, ["forward", None, 5.0, 1.0]), "phases.0 ends at 1 s, before it starts at 5 s"),
    (_span("waits", 0, [1]), "waits.0 is [1], not a span of 3 values"),
    (_span("comms", 0, ["bogus", "t", 1, 1, 1.0, 2.0]), "comms.0.0 is 'bogus', not one of all_gather, "),
    (_span("comms", 0, ["all_gather", "t", 1, 1, "x", 2.0]), "comms.0.4 is 'x', not a finite number"),
])
def test_report_of_a_profile_lacking_what_its_plots_read_says_what_in_words(tmp_path, capsys, change, said):
    """Refused before any plot is drawn, by what the profile lacks: never by the name of the Python
    exception a plot would raise (KeyError, TypeError, ValueError)."""
    with open(PROFILE) as f:
        document = json.load(f)
    change(document)
    (tmp_path / "profile.json").write_text(json.dumps(document))
    refused = refusal(["report", str(tmp_path), "--out", str(tmp_path / "plots")], capsys)
    assert "is damaged (" in refused and said in refused and refused.endswith("; profile the run again"), refused
    assert "Error" not in refused and not (tmp_path / "plots").exists()


def test_report_of_a_profile_without_steps_plots_nothing(tmp_path, capsys):
    with open(PROFILE) as f:
        document = json.load(f)
    (tmp_path / "profile.json").write_text(json.dumps({**document, "steps": []}))
    assert refusal(["report", str(tmp_path), "--out", str(tmp_path / "plots")], capsys) == (
        f"error: {tmp_path}/profile.json holds no step (its steps list is empty): profile a run of at least one step")
    assert not (tmp_path / "plots").exists()


def test_report_of_two_runs_of_one_name_keeps_the_plots_of_both(tmp_path, capsys):
    """a/run and b/run: each run's plots are named for it, never one written over the other's."""
    with open(PROFILE) as f:
        document = json.load(f)
    document["steps"] = document["steps"][:3]
    timelined(document)  # a timeline of few spans: fewer shapes to draw
    wider = {**document, "world_size": 2, "tokens_per_step": 2 * document["tokens_per_step"],
             "summary": {**document["summary"], "tokens_per_s": 2 * document["summary"]["tokens_per_s"]},
             "timeline": {**document["timeline"], "ranks": document["timeline"]["ranks"] * 2},
             "steps": [{**step, "ranks": step["ranks"] * 2} for step in document["steps"]]}
    for parent, profile in (("a", document), ("b", wider)):
        (tmp_path / parent / "run").mkdir(parents=True)
        (tmp_path / parent / "run" / "profile.json").write_text(json.dumps(profile))
    runs = [str(tmp_path / parent / "run") for parent in ("a", "b")]
    assert main(["report", *runs, "--out", str(tmp_path / "out")]) == 0
    written = capsys.readouterr().out.split()
    assert len(set(written)) == len(written) == 7 and sorted(os.listdir(tmp_path / "out")) == sorted(
        [*(f"run-{world}-ranks-{plot}.png" for world in (1, 2) for plot in ("timeline", "breakdown", "overlap")),
         "scaling.png"])


HF_COMMANDS = {
    "simulate": ["simulate", "--cluster", "a100-100gbe", "--model"],
    "plan": ["plan", "--cluster", "a100-100gbe", "--global-batch", "8", "--model"],
    "train": ["train", "--nproc", "1", "--steps", "1", "--model"],
}


@pytest.mark.parametrize("command", HF_COMMANDS)
def test_an_hf_config_is_read_within_bounds_by_every_command(tmp_path, capsys, command):
    """One reader for an ``hf:`` config, whichever command is given it: deep, huge, not a regular
    file, a name too long for the system, deep inline text: one line, cut short."""
    deep, big, fifo = tmp_path / "deep", tmp_path / "big", tmp_path / "fifo"
    for directory in (deep, big, fifo):
        directory.mkdir()
    (deep / "config.json").write_text(DEEP)
    with open(big / "config.json", "wb") as f:
        f.truncate(3 << 30)  # sparse: 3 GiB that a reader without a bound would hold
    os.mkfifo(fifo / "config.json")
    def said_to(source) -> str:
        try:
            return refusal([*HF_COMMANDS[command], f"hf:{source}"], capsys)
        except SystemExit as end:  # train's checks before its workers start end the command so
            assert "\n" not in str(end.code), end.code
            return str(end.code)

    inline = '{"n_layer": ' + DEEP + "}"
    said = {source: said_to(source) for source in (deep, big, fifo, "a" * 300, inline)}
    assert "nests deeper than any config: flatten it" in said[deep]
    assert "is larger than 1,048,576 bytes" in said[big]
    assert "config.json is not a regular file" in said[fifo]
    assert "does not exist" in said["a" * 300]
    assert "nests deeper than any config: flatten it" in said[inline]
    assert all(len(message) < 400 for message in said.values()), said


def test_a_node_named_by_a_number_of_thousands_of_digits_is_refused_in_one_line():
    """Python refused to read it as a whole number, in a traceback naming its own setting."""
    testbed = spec.Testbed("shardwire-test-node", 2, spec.parse_rate("100mbit"))
    with pytest.raises(spec.TestbedError, match=r"^no node 'node999.*\.\.\..*999' on testbed 'shardwire-test-node': "):
        testbed.node("node" + "9" * 5000)


def test_testbed_names_in_messages_are_cut_short(capsys):
    """As root the preset is refused; elsewhere root is asked for first: either way one short line."""
    refused = refusal(["testbed", "up", "--nodes", "2", "--like", LONG], capsys)
    assert "x" * 100 not in refused and "\n" not in refused.strip()  # the presets it lists are the rest
    with pytest.raises(spec.TestbedError, match=r"--like 'x+\.\.\.x+' is not a cluster preset") as refused:
        regime.like(LONG, 2, 1)
    assert "x" * 100 not in str(refused.value)
    refused = refusal(["testbed", "down", "--name", f"shardwire-{LONG}"], capsys)
    assert "must be 'shardwire' and words" in refused and len(refused) < 400
    with pytest.raises(spec.TestbedError, match="no node 'x+\\.\\.\\.x+' on") as refused:
        spec.Testbed("shardwire-test", 2, spec.MIN_RATE).node(LONG)
    assert len(str(refused.value)) < 400


def test_a_testbed_node_is_named_only_as_up_lists_it():
    bed = spec.Testbed("shardwire-test", 3, spec.MIN_RATE)
    assert [bed.node(name) for name in ("node0", "node2", "1")] == [0, 2, 1]
    for name in ("node01", "node3", "node\u0661", "node-1", ""):  # node01 acted on node1
        with pytest.raises(spec.TestbedError, match="give one of node0 to node2"):
            bed.node(name)


def test_a_damaged_testbed_state_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(spec, "STATE_DIR", tmp_path)
    spec.state_path("shardwire-test").write_text(DEEP)
    with pytest.raises(spec.TestbedError, match="nests deeper than a testbed's state does; run `shardwire testbed "
                                                "down --name shardwire-test` and up again"):
        spec.Testbed.load("shardwire-test")
    spec.state_path("shardwire-test").write_text(json.dumps({"name": "shardwire-test", "nodes": "2", "rate_bits": 1}))
    with pytest.raises(spec.TestbedError, match="is damaged"):
        spec.Testbed.load("shardwire-test")


def _up(name: str, nodes: int) -> subprocess.Popen:
    argv = [sys.executable, "-m", "shardwire", "testbed", "up", "--name", name, "--nodes", str(nodes),
            "--link", "200mbit"]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
@pytest.mark.root
@root_only
def test_two_testbed_commands_at_once_take_turns():
    """Without the lock each `up` saw no testbed, removed what the other had begun, and built over
    it: one failed, and the other's clean-up removed what it reported built."""
    name = "shardwire-test-lock"
    network.down(name)
    try:
        same = [_up(name, 2), _up(name, 2)]
        said = sorted(process.communicate(timeout=50)[0].splitlines()[0] for process in same)
        assert [process.returncode for process in same] == [0, 0], [p.stderr.read() for p in same]
        assert [line.rsplit(": ", 1)[1] for line in said] == ["already up, unchanged", "built"]
        assert network.is_up(spec.Testbed(name, 2, spec.parse_rate("200mbit")))
        other = [_up(name, 3), _up(name, 2)]  # two layouts: each is built in turn, and the last one stands
        for process in other:
            process.communicate(timeout=50)
        assert [process.returncode for process in other] == [0, 0]
        recorded = spec.Testbed.load(name)
        assert network.is_up(recorded) and recorded.nodes in (2, 3)
    finally:
        assert main(["testbed", "down", "--name", name]) == 0


@pytest.mark.slow
@pytest.mark.root
@root_only
def test_a_testbed_runs_one_job_and_is_not_rebuilt_under_it(tmp_path, capsys):
    """A second job failed after its nodes started, blaming an unreachable node for the port the
    first held; `up` rebuilt the testbed under a running job, which ended failed without a word."""
    name = "shardwire-test-job"
    network.down(name)
    (tmp_path / "wait.py").write_text("import time\ntime.sleep(120)\n")
    assert main(["testbed", "up", "--name", name, "--nodes", "2", "--link", "200mbit"]) == 0
    first = subprocess.Popen([sys.executable, "-m", "shardwire", "testbed", "run", "--name", name, "--",
                              str(tmp_path / "wait.py")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while spec.job_on(name) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        owner = f"process {first.pid} on "
        capsys.readouterr()
        for argv, said in (
                (["testbed", "run", "--name", name, "--", str(tmp_path / "wait.py")], "is running another job"),
                (["testbed", "up", "--name", name, "--nodes", "3", "--link", "200mbit"], "is running a job"),
                (["testbed", "down", "--name", name], "is running a job")):
            refused = refusal(argv, capsys)
            assert f"testbed {name!r} {said} ({owner}" in refused, refused
        assert network.is_up(spec.Testbed(name, 2, spec.parse_rate("200mbit")))
    finally:
        first.send_signal(signal.SIGINT)
        first.communicate(timeout=60)
    # a process exec started on a node (a fault-tolerant group, a lighthouse) is a job to a rebuild too
    subprocess.Popen([sys.executable, "-m", "shardwire", "testbed", "exec", "--name", name, "node0", "--", "sleep",
                      "60"])
    deadline = time.monotonic() + 30
    while not network._processes_on(name) and time.monotonic() < deadline:
        time.sleep(0.1)
    refused = refusal(["testbed", "up", "--name", name, "--nodes", "3", "--link", "200mbit"], capsys)
    assert f"testbed {name!r} has 1 process running on its nodes (process " in refused and ": sleep 60): stop " \
        f"them, or run `shardwire testbed down --name {name}` (which stops them) before rebuilding the " \
        f"testbed" in refused, refused
    assert main(["testbed", "down", "--name", name]) == 0  # which stops it


def _rank(step_ms: float, **parts_ms: float) -> dict[str, float]:
    """One rank's figures of a step; what its named parts leave of the step is its wait."""
    figures = {name: 0.0 for name in analysis.FIGURES} | {f"{part}_s": ms / 1e3 for part, ms in parts_ms.items()}
    figures["step_s"] = step_ms / 1e3
    figures["wait_s"] = (step_ms - sum(parts_ms.values())) / 1e3
    return figures


def test_the_summary_line_is_the_slowest_ranks_own_step(tmp_path, capsys):
    """Rank 0 is the slowest (98 ms: 13 + 48 + 1 + 36 waiting), rank 1 waits longest (74 ms):
    the largest of each part added up to 135 ms in a 98 ms step."""
    steps = [analysis.across_ranks([_rank(98, forward=13, backward=48, optimizer=1),
                                    _rank(90, forward=5, backward=10, optimizer=1)])
             for _ in range(3)]
    summary = analysis.over_steps(steps) | {"step_time_s": 0.098, "model_tflops_per_worker": 1.0, "mfu": 0.5}
    profiler = types.SimpleNamespace(save=lambda run_dir: summary)
    loop._save_profile(profiler, types.SimpleNamespace(run_dir=str(tmp_path)), rank=0)
    line = capsys.readouterr().out.splitlines()[0]
    step = int(re.search(r"step (\d+) ms", line)[1])
    parts = dict(re.findall(r"(forward|backward|clip|optimizer|other|waiting for communication) (\d+)", line))
    parts = {name: int(ms) for name, ms in parts.items()}
    assert step == 98 and parts["forward"] == 13 and parts["waiting for communication"] == 36, line
    assert sum(parts.values()) == step, line


def test_the_summary_keeps_the_typical_steps_slowest_rank():
    steps = [analysis.across_ranks([_rank(ms, forward=ms - 10), _rank(50, forward=1)]) for ms in (100, 300, 200)]
    typical = analysis.over_steps(steps)["typical_step"]
    assert typical["slowest_rank"] == 0 and typical["figures"] == steps[2]["ranks"][0]


@pytest.mark.parametrize("kind", ["model", "cluster", "training"])
def test_a_spec_given_as_a_device_or_a_pipe_is_read_as_a_file_within_bounds(kind, tmp_path, capsys):
    """Not taken for an unknown preset's name: read as the file it is, bounded, as --config reads."""
    fifo = tmp_path / "spec"
    os.mkfifo(fifo)
    argv = {"model": "gpt-125m", "cluster": "h100-100gbe", "training": "default"}
    for given, said in (("/dev/zero", f"error: {kind} file /dev/zero is a character device, not a file"),
                        (str(fifo), f"error: {kind} file {fifo} is a FIFO that nothing was written to")):
        assert main(["simulate", *[arg for key, value in {**argv, kind: given}.items()
                                   for arg in (f"--{key}", value)]]) == 2
        err = capsys.readouterr().err
        assert err.startswith(said) and err.count("\n") == 1, err


def _job(change=None, world_size=8) -> dict:
    """A real profile's document at ``world_size`` (its job's tokens per rank kept), changed by ``change``."""
    with open(PROFILE) as f:
        document = json.load(f)
    document["tokens_per_step"] = document["tokens_per_step"] // document["world_size"] * world_size
    document["world_size"] = world_size
    if change is not None:
        change(document)
    return document


@pytest.mark.parametrize("change, said", [
    (lambda d: d["metadata"]["config"].update(layout="hybrid"), "runs differ in --layout: one has 'full', two has "
                                                                "'hybrid'"),
    (lambda d: d["metadata"]["config"].update(activation_checkpointing=True),
     "runs differ in --activation-checkpointing: one has False, two has True"),
    (lambda d: d["metadata"]["config"].update(clip=0.0), "runs differ in --clip: one has 1.0, two has 0.0"),
    (lambda d: (d["metadata"].pop("precision"), d["metadata"]["config"].update(precision="fp32")),
     "runs differ in precision: one has 'bf16', two has 'fp32'"),
    (lambda d: d["metadata"]["config"].update(fault_tolerance="lighthouse=http://head:29510"),
     "runs differ in --fault-tolerance: one has 'none', two has 'asked'"),
])
def test_report_compares_runs_by_every_option_that_sets_a_step(change, said):
    """Runs of another layout, wire or checkpointing were drawn as one job's scaling; a metadata key
    deleted had the runs compared by nothing (None against None), where calibrate read the job."""
    from shardwire.profile.report import ReportError, _check_comparable

    with pytest.raises(ReportError, match=re.escape(said)):
        _check_comparable(["one", "two"], [_job(), _job(change, world_size=16)])
    _check_comparable(["one", "two"], [_job(), _job(lambda d: d["metadata"].pop("model"), world_size=16)])


def test_report_takes_runs_whose_lighthouse_moved_for_one_job():
    """Where fault-tolerant groups met changes nothing a step computes."""
    from shardwire.profile.report import _check_comparable

    def meeting_at(host):
        return lambda d: d["metadata"]["config"].update(fault_tolerance=f"lighthouse=http://{host}:29510,timeout=9")

    _check_comparable(["one", "two"], [_job(meeting_at("head")), _job(meeting_at("head-2"), world_size=16)])


def test_a_profile_of_warmup_steps_alone_is_not_calibrated_on(tmp_path, capsys):
    """A run of one step profiled its warmup alone (allocation, the first gathers): calibrated on,
    it predicted a step 80 times too long."""
    def warmup_alone(document):
        document["steps"] = document["steps"][:document["warmup_steps"]]
        timelined(document)  # of its one step, as a run of one step writes it

    path = profile_with(tmp_path, warmup_alone)
    assert f"{path} holds only its 1 warmup step(s), whose times (allocation, compilation, the first gathers) no " \
           f"later step takes: profile a run of more than 1 steps" in refusal([*CALIBRATE, path], capsys)


@pytest.mark.parametrize("argv", [
    ["simulate", "--model", "tiny", "--cluster", "h100-ib-400", "--nodes", "1" + "0" * 4200],
    ["simulate", "--model", "tiny", "--cluster", "{preset: h100-ib-400, nodes: 1" + "0" * 4200 + "}"],
    ["plan", "--model", "tiny", "--cluster", "h100-ib-400", "--global-batch", "1" + "0" * 4200],
    ["plan", "--model", "tiny", "--cluster", "h100-ib-400", "--global-batch", "-1" + "0" * 4200],
])
def test_a_number_out_of_range_is_shown_cut_short(capsys, argv):
    """Each was echoed whole: 4,313 characters of error."""
    refused = refusal(argv, capsys)
    assert "0...0" in refused and len(refused) < 400, refused


def test_a_new_profile_names_the_report_plots_drawn_before_it_beside_it(tmp_path):
    """They stayed beside it without a word, drawing another job; they are named, not removed (they
    may be of another run, drawn there with --out), and a file of the user's is not among them."""
    from shardwire.files import PLOTS, results_in

    text = b"Software\x00" + PLOTS["report-plot"].encode()
    for name in ("timeline.png", "scaling.png"):
        (tmp_path / name).write_bytes(b"\x89PNG\r\n\x1a\n" + len(text).to_bytes(4, "big") + b"tEXt" + text)
    (tmp_path / "overlap.png").write_bytes(b"\x89PNG\r\n\x1a\n the user's own")
    assert results_in(tmp_path, "report-plot") == ["scaling.png", "timeline.png"]


def test_a_profile_is_read_as_the_model_it_measured():
    """An hf: directory edited between two runs (a tied head: the same FLOPs per token) was one model
    to report, and calibrate fitted a profile's times to the model as edited since: a profile records
    the model's description, and both read it."""
    from shardwire.profile.report import ReportError, _check_comparable
    from shardwire.sim.calibrate import read_profile
    from shardwire.sim.inputs import load_model
    from shardwire.sim.specs import SpecError, as_dict

    described = as_dict(load_model("gpt-1.3b", None))
    recorded = _job(lambda d: d["metadata"].update(model_spec=described))
    edited = _job(lambda d: d["metadata"].update(model_spec={**described, "params": 1_000_000}), world_size=16)
    with pytest.raises(ReportError, match=r"^runs differ in the model: one and two ran models that differ in params; a scaling report "):
        _check_comparable(["one", "two"], [recorded, edited])
    _check_comparable(["one", "two"], [_job(), edited])  # a profile from before: compared by FLOPs per token

    def model_as_edited_since(name, seq_len):
        return load_model("gpt-350m", seq_len)

    with open(PROFILE) as f:
        document = json.load(f)
    with pytest.raises(SpecError, match="is damaged .its model flops_per_token"):  # from before: read as it is now
        read_profile(PROFILE, model_as_edited_since)
    document["metadata"]["model_spec"] = described
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "profile.json")
        with open(path, "w") as f:
            json.dump(document, f)
        assert read_profile(path, model_as_edited_since).model == load_model("gpt-1.3b", None)


@pytest.mark.slow
@pytest.mark.parametrize("argv", [
    ["train", "--model", "tiny", "--wire", "grads=" + "q" * 50_000],
    ["train", "--model", "tiny", "--diloco", "sync_every=2,wire=" + "q" * 50_000],
    ["train", "--layout", "q" * 30_000],
    ["bench", "-e", "9" * 4301],
    ["simulate", "--model", "tiny", "--cluster", "{preset: a100-100gbe, gpu: " + "q" * 30_000 + "}"],
    ["simulate", "--model", "tiny", "--cluster", "h100-ib-400", "--sweep", "k" * 30_000 + "=1"],
    ["simulate", "--model", "tiny", "--cluster", "h100-ib-400", "--calibrate", "/tmp/" + "a" * 30_000],
    ["simulate", "--model", "tiny", "--cluster", "h100-ib-400", "a" * 30_000],
    ["simulate", "--model", "tiny", "--cluster", "h100-ib-400", "--training", "{name: " + "q" * 30_000 + "}"],
    ["q" * 30_000],
], ids=lambda argv: " ".join(word[:20] for word in argv))
def test_a_long_value_given_is_said_cut_short(argv):
    """Each was echoed whole: 30 to 100 KB of one line, from argparse, a parser of settings, a spec's
    name, a path."""
    done = subprocess.run([sys.executable, "-m", "shardwire", *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and len(done.stderr) < 1000, done.stderr[:2000]
