"""The routes by which FP8-LM settings reach an Accelerate script (from a route sweep): ``lightning-fp8 launch`` flags,
the config file's ``lightning_fp8`` section (given or at Accelerate's default location), the ``LIGHTNING_FP8_*``
variables of a plain launch and ``Accelerator(fp8_lm_recipe=...)``. The same settings by any route train the same model
bit for bit; a repeated flag, a bad pattern list and a refused ``mixed_precision`` stop the launch before anything
starts, with an error that names where they came from."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState, GradientState
from torch import nn

from lightning_fp8 import FP8Recipe
from lightning_fp8.accelerate import Accelerator
from lightning_fp8.integrations.accelerate import cli
from lightning_fp8.integrations.accelerate.config import ENV_EXCLUDE, ENV_RECIPE, ENV_TP_PLAN, resolve_launch_config

ROOT = Path(__file__).resolve().parents[3]
ACCELERATE_KEYS = "compute_environment: LOCAL_MACHINE\ndistributed_type: 'NO'\nnum_processes: 1\nuse_cpu: true\n"


@pytest.fixture(autouse=True)
def _no_launch_settings(monkeypatch, tmp_path):
    # The routes under test start from a shell without LIGHTNING_FP8_* and without Accelerate's default config file;
    # what launch() exports stays in this test's copy of the environment.
    monkeypatch.setattr(os, "environ", dict(os.environ))
    for name in (ENV_RECIPE, ENV_EXCLUDE, ENV_TP_PLAN):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("accelerate.commands.config.config_args.default_config_file", str(tmp_path / "no_default.yaml"))
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _launched(monkeypatch, argv: list[str]) -> dict[str, str]:
    """The LIGHTNING_FP8_* variables `lightning-fp8 launch argv` hands the training processes (none is started)."""
    seen = {}

    def launch_command(args):
        seen.update({k: v for k, v in os.environ.items() if k.startswith("LIGHTNING_FP8_")})

    with monkeypatch.context() as m:
        m.setattr(os, "environ", dict(os.environ))  # what launch() exports does not reach the next launch
        m.setattr("accelerate.commands.launch.launch_command", launch_command)
        assert cli.main(["launch", *argv]) == 0
    return seen


def _config(tmp_path: Path, section: str, name: str = "c.yaml") -> str:
    path = tmp_path / name
    path.write_text(ACCELERATE_KEYS + section)
    return str(path)


def _train(monkeypatch, env: dict[str, str], recipe: FP8Recipe | str | None = None) -> dict:
    """Two AdamW steps of a tiny model under the launch's variables ``env`` (a plain launch: the processes read only
    these) and ``Accelerator(fp8_lm_recipe=recipe)``: what the run used and the weights it ended with."""
    with monkeypatch.context() as m:
        for name, value in env.items():
            m.setenv(name, value)
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        accelerator = Accelerator(cpu=True, fp8_lm_recipe=recipe)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 16))
        model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        for step in range(2):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(8, 32, generator=g), torch.randint(0, 16, (8,), generator=g)
            accelerator.backward(nn.functional.cross_entropy(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
        states = optimizer.optimizer.state.values()
        return {
            "recipe": accelerator.fp8_lm_recipe,
            "high_precision": accelerator.fp8_report.get("high_precision_linears"),
            "state_dtypes": sorted({str(v.dtype) for s in states for v in s.values() if torch.is_tensor(v)}),
            "weights": {k: v.detach().float().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)},
        }


def _same_run(a: dict, b: dict) -> bool:
    same_weights = a["weights"].keys() == b["weights"].keys() and all(
        torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"]
    )
    return same_weights and all(a[key] == b[key] for key in ("recipe", "high_precision", "state_dtypes"))


@pytest.mark.parametrize("name", [*FP8Recipe.names(), "none"])
def test_a_named_recipe_is_the_same_recipe_by_every_route(monkeypatch, tmp_path, name):
    expected = None if name == "none" else FP8Recipe.from_name(name)  # the reference: the named recipe itself
    launches = {
        "flag": ["--cpu", "--fp8-recipe", name],
        "flag=": ["--cpu", f"--fp8_recipe={name}"],
        "section": ["--config_file", _config(tmp_path, f"lightning_fp8:\n  recipe: {name}\n", "a.yaml")],
        "section shorthand": ["--config_file", _config(tmp_path, f"lightning_fp8: {name}\n", "b.yaml")],
    }
    envs = {route: _launched(monkeypatch, argv + ["train.py"]) for route, argv in launches.items()}
    monkeypatch.setenv(ENV_RECIPE, name)
    envs["shell variable"] = _launched(monkeypatch, ["--cpu", "train.py"])
    envs["plain launch"] = {ENV_RECIPE: name}
    for route, env in envs.items():
        monkeypatch.setattr(os, "environ", env)  # all a training process of that launch sees
        config = resolve_launch_config(None)
        assert (None if config is None else config.recipe) == expected, route
    monkeypatch.setattr(os, "environ", {})
    from_code = resolve_launch_config(name)  # Accelerator(fp8_lm_recipe=name)
    assert (None if from_code is None else from_code.recipe) == expected


def test_a_recipe_with_overrides_and_exclusions_trains_alike_by_every_route(monkeypatch, tmp_path):
    # The reference: the plain launch's variables, as docs/accelerate.md writes them.
    reference = _train(monkeypatch, {ENV_RECIPE: '{"name": "fp8-lm-current", "margin": 1}', ENV_EXCLUDE: "2"})
    assert reference["recipe"] == FP8Recipe(scaling="current", margin=1) and reference["high_precision"] == ["2"]
    section = "lightning_fp8:\n  recipe: fp8-lm-current\n  margin: 1\n  exclude_modules: ['2']\n"
    launched = _launched(monkeypatch, ["--config_file", _config(tmp_path, section), "train.py"])
    assert _same_run(_train(monkeypatch, launched), reference)
    # the section without patterns, which come from the flag
    section = "lightning_fp8:\n  recipe: fp8-lm-current\n  margin: 1\n"
    path = _config(tmp_path, section, "d.yaml")
    launched = _launched(monkeypatch, ["--config_file", path, "--fp8-exclude", "2", "train.py"])
    assert _same_run(_train(monkeypatch, launched), reference)
    # the recipe from the script, the patterns from the launch
    from_code = _train(monkeypatch, {ENV_EXCLUDE: "2"}, FP8Recipe(scaling="current", margin=1))
    assert _same_run(from_code, reference)


@pytest.mark.parametrize(
    ("argv", "shell"),
    [
        (["--fp8-recipe", "none", "--fp8-exclude", "2"], {}),
        (["--fp8-recipe", "none"], {ENV_EXCLUDE: "2"}),
        ([], {ENV_RECIPE: "none", ENV_EXCLUDE: "2"}),
        (["--config_file", "SECTION"], {}),
    ],
    ids=["flags", "shell patterns", "shell recipe and patterns", "section"],
)
def test_a_launch_with_the_recipe_none_keeps_its_patterns_for_a_recipe_the_script_turns_on(
    monkeypatch, tmp_path, argv, shell
):
    """The launcher exported LIGHTNING_FP8_EXCLUDE='' with the recipe none: an `Accelerator(fp8_lm_recipe=...)` that
    turns FP8-LM on then trained the excluded layers in FP8, while the same settings by a plain launch kept them out
    (the docs: patterns exported in the shell are kept however the recipe is chosen)."""
    reference = _train(monkeypatch, {ENV_RECIPE: "none", ENV_EXCLUDE: "2"}, "fp8-lm")  # the plain launch
    assert reference["high_precision"] == ["2"]
    section = _config(tmp_path, "lightning_fp8:\n  recipe: none\n  exclude_modules: ['2']\n")
    for name, value in shell.items():
        monkeypatch.setenv(name, value)
    launched = _launched(monkeypatch, [section if a == "SECTION" else a for a in ["--cpu", *argv, "train.py"]])
    assert launched[ENV_RECIPE] == "none"
    assert _same_run(_train(monkeypatch, launched, "fp8-lm"), reference)


@pytest.mark.parametrize(
    ("argv", "shell", "source"),
    [
        (["--fp8-exclude", "[1, 2]"], {}, "--fp8-exclude"),
        (["--fp8-exclude", "[1, 2]"], {ENV_RECIPE: "fp8-lm-o1"}, "--fp8-exclude"),
        (["--fp8-recipe", "fp8-lm"], {ENV_EXCLUDE: "[1, 2]"}, ENV_EXCLUDE),
        (["--config_file", "SECTION"], {ENV_EXCLUDE: "[1, 2]"}, ENV_EXCLUDE),
    ],
    ids=["flag", "flag with a shell recipe", "shell with a flag recipe", "shell with a section"],
)
def test_a_bad_pattern_list_is_named_by_where_it_came_from(monkeypatch, tmp_path, capsys, argv, shell, source):
    """The error named the config section (`lightning_fp8 (in c.yaml).exclude_modules=...`, or `lightning_fp8` with no
    file at all) or the variable for a value given by the flag."""
    section = _config(tmp_path, "lightning_fp8:\n  recipe: fp8-lm\n")
    for name, value in shell.items():
        monkeypatch.setenv(name, value)
    argv = ["launch", *(section if a == "SECTION" else a for a in argv), str(tmp_path / "missing.py")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert re.search(rf"^lightning-fp8 launch: error: {re.escape(source)}='\[1, 2\]' is a JSON array of \['int'\]", err)


@pytest.mark.parametrize("flag", ["--fp8-recipe", "--fp8-exclude", "--fp8-tp-plan"])
def test_a_repeated_fp8_flag_is_refused_before_launching(monkeypatch, tmp_path, capsys, flag):
    """argparse kept the last value: `--fp8-exclude lm_head --fp8-exclude fc` trained lm_head in FP8."""
    launched = []
    monkeypatch.setattr("accelerate.commands.launch.launch_command", launched.append)
    values = {"--fp8-recipe": ("fp8-lm", "none"), "--fp8-exclude": ("0", "2"), "--fp8-tp-plan": ("gpt", "llama")}[flag]
    argv = ["launch", "--cpu", flag, values[0], f"--{flag[2:].replace('-', '_')}={values[1]}", "train.py"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"error: {flag} given 2 times ({list(values)}), the last would silently win: give it once" in err, err
    assert not launched
    # one flag with both patterns is the documented spelling, and keeps both
    if flag == "--fp8-exclude":
        assert _launched(monkeypatch, ["--cpu", flag, "0,2", "train.py"])[ENV_EXCLUDE] == "0,2"


def test_fp8_flags_after_the_script_are_the_scripts(monkeypatch):
    seen = {}
    monkeypatch.setattr("accelerate.commands.launch.launch_command", lambda args: seen.update(vars(args)))
    env = _launched(monkeypatch, ["--cpu", "train.py", "--fp8-recipe", "none", "--fp8-recipe", "x"])
    assert env[ENV_RECIPE] == "fp8-lm"  # the launcher's default, as if no flag was given
    assert cli.main(["launch", "--cpu", "train.py", "--fp8-recipe", "none"]) == 0
    assert seen["training_script_args"] == ["--fp8-recipe", "none"]


@pytest.mark.parametrize(("text", "refused"), [("fp16: true\n", True), ("fp16: false\n", False)])
def test_an_old_config_files_fp16_true_is_refused_before_launching(monkeypatch, tmp_path, capsys, text, refused):
    """Accelerate reads `fp16: true` (without `mixed_precision`) as mixed_precision fp16: the launcher let it through,
    and only the training processes' Accelerator refused it."""
    import accelerate.commands.launch as accelerate_launch

    seen = []

    def launch_command(args):  # accelerate launch's reading of the file, without the launch
        seen.append(accelerate_launch._validate_launch_command(args)[0].mixed_precision)

    monkeypatch.setattr(accelerate_launch, "launch_command", launch_command)
    path = _config(tmp_path, text + "lightning_fp8: fp8-lm\n")
    status = cli.main(["launch", "--config_file", path, "train.py"])
    err = capsys.readouterr().err
    if refused:
        assert status == 2 and not seen
        assert "error: mixed_precision='fp16' cannot be combined with FP8-LM" in err, err
        assert f"(set by `fp16: true` in the config file {path})" in err, err
        assert cli.main(["launch", "--config_file", path, "--fp8-recipe", "none", "train.py"]) == 0
        assert seen == ["fp16"]  # FP8-LM off: Accelerate's business, as it reads the file
    else:
        assert status == 0 and seen == ["no"], err


@pytest.mark.parametrize("section", ["", "lightning_fp8: fp8-lm\n"], ids=["without section", "with section"])
def test_a_default_config_file_launches_its_cpu_processes_as_when_given_by_config_file(monkeypatch, tmp_path, section):
    """The CPU processes' torchrun launch replaced Accelerate's default config file by a bare CPU launch when the file
    had no lightning_fp8 section: its mixed_precision (bf16) and main_process_port were dropped, which the same file
    given with --config_file (or with a section) kept."""
    import accelerate.commands.launch as accelerate_launch

    default = tmp_path / "default_config.yaml"
    default.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nnum_processes: 2\nuse_cpu: true\n"
        "mixed_precision: bf16\nmain_process_port: 0\n" + section
    )
    monkeypatch.setattr("accelerate.commands.config.config_args.default_config_file", str(default))
    monkeypatch.setattr(accelerate_launch, "default_config_file", str(default))
    seen = []

    def launch_command(args):  # accelerate launch's checks and defaults, without the launch
        args = accelerate_launch._validate_launch_command(args)[0]
        seen.append({key: getattr(args, key) for key in ("mixed_precision", "num_processes", "main_process_port")})

    monkeypatch.setattr(accelerate_launch, "launch_command", launch_command)
    assert cli.main(["launch", "--config_file", str(default), "train.py"]) == 0  # the reference: the file given
    assert cli.main(["launch", "train.py"]) == 0
    assert seen[0] == {"mixed_precision": "bf16", "num_processes": 2, "main_process_port": 0}
    assert seen[1] == seen[0]


def test_a_default_config_file_with_a_bom_and_crlf_trains_as_the_plain_launch(tmp_path):
    """Two real launches: `lightning-fp8 launch` reading the section from Accelerate's default config file (in
    $HF_HOME, written on Windows: a UTF-8 BOM, CRLF line ends) and `python` with the documented variables."""
    script = tmp_path / "train.py"
    script.write_text(
        "import json, sys, torch\nfrom torch import nn\nfrom lightning_fp8.accelerate import Accelerator\n"
        "torch.set_num_threads(1)\naccelerator = Accelerator()\ntorch.manual_seed(0)\n"
        "model = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 16))\n"
        "model, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))\n"
        "for step in range(2):\n"
        "    g = torch.Generator().manual_seed(step)\n"
        "    x, y = torch.randn(8, 32, generator=g), torch.randint(0, 16, (8,), generator=g)\n"
        "    accelerator.backward(nn.functional.cross_entropy(model(x), y))\n"
        "    opt.step()\n    opt.zero_grad()\n"
        "torch.save({'recipe': accelerator.fp8_lm_recipe.to_dict(), 'report': accelerator.fp8_report,\n"
        "            'weights': model.state_dict()}, sys.argv[1])\n"
    )
    section = "lightning_fp8:\n  recipe: fp8-lm-current\n  margin: 1\n  exclude_modules: ['2']\n"
    default = tmp_path / "hf" / "accelerate" / "default_config.yaml"
    default.parent.mkdir(parents=True)
    default.write_bytes(b"\xef\xbb\xbf" + (ACCELERATE_KEYS + section).replace("\n", "\r\n").encode())
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("LIGHTNING_FP8_", "ACCELERATE_"))}
    environ.update({"HF_HOME": str(tmp_path / "hf"), "PYTHONPATH": str(ROOT)})
    launcher = [sys.executable, "-m", "lightning_fp8.integrations.accelerate.cli", "launch", str(script)]
    plain = {ENV_RECIPE: json.dumps({"name": "fp8-lm-current", "margin": 1}), ENV_EXCLUDE: "2"}
    for cmd, env, out in [(launcher, environ, "a.pt"), ([sys.executable, str(script)], {**environ, **plain}, "b.pt")]:
        proc = subprocess.run([*cmd, str(tmp_path / out)], cwd=ROOT, env=env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = (torch.load(tmp_path / out, weights_only=False) for out in ("a.pt", "b.pt"))
    assert a["recipe"] == b["recipe"] == FP8Recipe(scaling="current", margin=1).to_dict()
    assert a["report"]["high_precision_linears"] == b["report"]["high_precision_linears"] == ["2"]
    assert all(torch.equal(a["weights"][k], b["weights"][k]) for k in b["weights"])


def test_the_user_facing_module_names_the_three_variables_the_docs_table_lists():
    """``lightning_fp8.accelerate`` re-exported the recipe and exclusion variables' names but not the plan's."""
    import lightning_fp8.accelerate as public

    table = (ROOT / "docs" / "accelerate.md").read_text()
    for name in ("ENV_RECIPE", "ENV_EXCLUDE", "ENV_TP_PLAN"):
        assert name in public.__all__
        assert f"| `{getattr(public, name)}` |" in table
    assert (public.ENV_RECIPE, public.ENV_EXCLUDE, public.ENV_TP_PLAN) == (ENV_RECIPE, ENV_EXCLUDE, ENV_TP_PLAN)
