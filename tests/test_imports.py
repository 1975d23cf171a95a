"""What each entry point imports: training never loads the plotting or YAML extras, the command line
and the simulator never load torch, and a missing extra is a one-line error naming it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from shardwire.cli import main
from shardwire.extras import MissingExtra, require


def imported_modules(code: str) -> set[str]:
    """The top-level packages a fresh interpreter holds after running ``code``."""
    script = f"import sys\n{code}\nprint(' '.join(sorted({{m.partition('.')[0] for m in sys.modules}})))"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    return set(done.stdout.split())


def test_the_training_path_imports_no_plotting_or_yaml():
    modules = imported_modules("import shardwire, shardwire.training.loop; shardwire.shard")
    assert "torch" in modules
    assert not modules & {"matplotlib", "yaml"}


def test_the_command_line_help_imports_no_torch():
    modules = imported_modules(
        "from shardwire.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass")
    assert "torch" not in modules


def test_a_json_spec_needs_no_yaml():
    modules = imported_modules(
        "from shardwire.cli import main\n"
        "main(['simulate', '--model', 'gpt2-125m', '--cluster', '{\"preset\": \"a100-100gbe\", \"nodes\": 2}', "
        "'--sweep', 'nodes=1,2', '--json'])")
    assert not modules & {"torch", "yaml", "matplotlib"}


def test_a_missing_extra_is_one_line_naming_it(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an uninstalled package looks like to import
    with pytest.raises(MissingExtra, match=r"--plot needs matplotlib, which is not installed: "
                                           r"pip install 'shardwire\[plots\]'"):
        require("matplotlib", "--plot")
    status = main(["simulate", "--model", "gpt2-125m", "--cluster", "a100-100gbe", "--sweep", "nodes=1,2",
                   "--plot", str(tmp_path / "sweep.png")])
    assert status == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --plot needs matplotlib, which is not installed: pip install 'shardwire[plots]'"]
    monkeypatch.setitem(sys.modules, "yaml", None)
    assert main(["simulate", "--model", "gpt2-125m", "--cluster", "{preset: a100-100gbe}"]) == 2
    assert "pip install 'shardwire[yaml]'" in capsys.readouterr().err


def test_the_gpt_sizes_module_under_its_old_name_warns_and_still_works():
    code = ("import warnings; warnings.simplefilter('error'); "
            "from shardwire.models.sizes import PRESETS")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "shardwire.models.sizes is renamed shardwire.sim.gpt_sizes" in done.stderr
    code = "import shardwire.models.sizes as old, shardwire.sim.gpt_sizes as new; assert old.PRESETS is new.PRESETS"
    assert subprocess.run([sys.executable, "-W", "ignore", "-c", code], timeout=60).returncode == 0
