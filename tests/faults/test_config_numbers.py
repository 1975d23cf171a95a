"""A value in a YAML config file means what it means on the command line: YAML 1.1 reads ``010``
as 8 and ``1:30`` as 90, where ``--steps 010`` is 10 and ``--save-every 1:30`` is refused. The
simulator's specs read numbers the same way."""

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
    ("save_every: 1:30\n", "save_every: '1:30' is not an integer"),
    ("log_every: 0x10\n", "log_every: '0x10' is not an integer"),
    ("steps: 0b11\n", "steps: '0b11' is not an integer"),
    ("lr: 1:30.5\n", "lr: '1:30.5' is not a number"),
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
    assert main(["simulate", "--model", "gpt2-125m", "--cluster", "{preset: a100-100gbe, nodes: 1:30}"]) == 2
    assert "'1:30' at line 1, column 30 is a YAML 1.1 number that the command line reads otherwise" in \
        capsys.readouterr().err
