"""A value in a YAML config file means what it means on the command line: YAML 1.1 reads ``010``
as 8 and ``1:30`` as 90, where ``--steps 010`` is 10 and ``--save-every 1:30`` is refused. The
simulator's specs read numbers the same way. A number is written in ASCII digits wherever it is
given, though Python's ``int`` and ``float`` read any script's (``١٠`` as 10)."""

from __future__ import annotations

import pytest
import yaml

from shardwire.cli import main


def printed_config(tmp_path, capsys, text: str) -> dict:
    config = tmp_path / "job.yaml"
    config.write_text(text)
    assert main(["train", "--config", str(config), "--print-config"]) == 0
    return yaml.safe_load(capsys.readouterr().out)


def test_numbers_read_as_the_command_line_reads_them(tmp_path, capsys):
    printed = printed_config(tmp_path, capsys, "steps: 010\nseed: 0_7\nlr: 1.5e-3\nrun_dir: 2024_01\n"
                                               "checkpoint_dir: 2001-12-14t21:59:43.10-05:00\n")
    assert (printed["steps"], printed["seed"], printed["lr"]) == (10, 7, 1.5e-3)
    # text is text, not YAML 1.1's integer 202401 or a timestamp in another form
    assert (printed["run_dir"], printed["checkpoint_dir"]) == ("2024_01", "2001-12-14t21:59:43.10-05:00")
    main(["train", "--steps", "010", "--print-config"])
    assert yaml.safe_load(capsys.readouterr().out)["steps"] == printed["steps"]


@pytest.mark.parametrize("text, message", [
    ("save_every: 1:30\n", "'1:30' at line 1, column 13 is a YAML 1.1 number that the command line reads otherwise"),
    ("log_every: 0x10\n", "'0x10' at line 1, column 12 is a YAML 1.1 number that the command line reads otherwise"),
    ("steps: 0b11\n", "'0b11' at line 1, column 8 is a YAML 1.1 number that the command line reads otherwise"),
    ("lr: 1:30.5\n", "'1:30.5' at line 1, column 5 is a YAML 1.1 number that the command line reads otherwise"),
])
def test_numbers_the_command_line_would_refuse_are_refused(text, message, tmp_path, capsys):
    config = tmp_path / "job.yaml"
    config.write_text(text)
    assert main(["train", "--config", str(config)]) == 2
    assert message in capsys.readouterr().err


def test_spec_numbers_are_decimal_or_refused(capsys):
    assert main(["simulate", "--model", "{preset: gpt2-125m, layers: 012, params: null}", "--cluster",
                 "a100-100gbe", "--json"]) == 0
    assert '"layers": 12' in capsys.readouterr().out
    # exponents without a dot, which YAML 1.1 leaves as text, are numbers as in JSON and on the command line
    assert main(["simulate", "--model", "gpt2-125m", "--cluster", "{preset: a100-100gbe, peak_tflops: 3e2}",
                 "--training", "{micro_batch: 1e1}", "--json"]) == 0
    printed = capsys.readouterr().out
    assert '"peak_tflops": 300.0' in printed and '"micro_batch": 10' in printed
    assert main(["simulate", "--model", "gpt2-125m", "--cluster", "{preset: a100-100gbe, nodes: 1:30}"]) == 2
    assert "'1:30' at line 1, column 30 is a YAML 1.1 number that the command line reads otherwise" in \
        capsys.readouterr().err
    # past Python's bound on a whole number's digits, read as infinity ("must be a whole number, got inf")
    cluster = "{preset: a100-100gbe, nodes: 1%s}" % ("0" * 5000)
    assert main(["simulate", "--model", "gpt2-125m", "--cluster", cluster]) == 2
    said = capsys.readouterr().err
    assert "0...0" in said and "' at line 1, column 30 has 5,001 digits, more than any value takes" in said, said


SWEEP = ["simulate", "--model", "gpt2-125m", "--cluster", "a100-100gbe"]


@pytest.mark.parametrize("argv, said", [
    (["train", "--steps", "١٠"], "argument --steps: '١٠' is not an integer in ASCII digits (0-9)"),
    (["train", "--steps", ""], "argument --steps: an empty value is not an integer: give one"),
    (["train", "--lr", " "], "argument --lr: an empty value is not a number: give one"),
    (["train", "--lr", "１e-3"], "argument --lr: '１e-3' is not a number in ASCII digits (0-9)"),
    (["train", "--layout", "hybrid", "--diloco", "sync_every=١٠"], "--diloco sync_every must be a positive integer, "
                                                                   "got '١٠'"),
    (["train", "--layout", "hybrid", "--diloco", "sync_every=20,fragment_sync_delay=٣"],
     "--diloco fragment_sync_delay must be an integer, got '٣'"),
    (["bench", "-b", "١K"], "argument -b/--min-bytes: '١K' is not a size"),
    (["plan", "--model", "gpt2-125m", "--cluster", "a100-100gbe", "--global-batch", "٨"],
     "argument --global-batch: '٨' is not an integer in ASCII digits"),
    ([*SWEEP, "--nodes", "٢"], "argument --nodes: '٢' is not an integer in ASCII digits"),
    ([*SWEEP, "--node-mtbf", "٢٠"], "argument --node-mtbf: '٢٠' is not a number in ASCII digits"),
])
def test_a_number_in_other_digits_than_ascii_or_an_empty_one_is_refused(argv, said, capsys):
    with pytest.raises(SystemExit) as stopped:
        main([*argv, "--print-config"])
    message = f"{stopped.value.code}{capsys.readouterr().err}"
    assert stopped.value.code != 0 and said in message and message.count("\n") <= 1, message


def test_a_number_in_other_digits_than_ascii_is_refused_in_a_config_file(tmp_path, capsys):
    config = tmp_path / "job.yaml"
    config.write_text("steps: ١٠\n")  # YAML reads it as text, which the option then reads
    assert main(["train", "--config", str(config), "--print-config"]) == 2
    assert "steps: '١٠' is not an integer in ASCII digits (0-9)" in capsys.readouterr().err
