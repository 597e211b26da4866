"""``lightning-fp8``: a thin wrapper around ``accelerate launch`` that turns FP8-LM on.

::

    lightning-fp8 launch [--fp8-recipe NAME] [--fp8-exclude PATTERNS] [--fp8-tp-plan PLAN] [accelerate launch options]
                         train.py [args]
    lightning-fp8 recipes

``launch`` parses its arguments with Accelerate's own ``accelerate launch`` parser (so every Accelerate option
works and means what it means there) plus three options of ours (``--fp8-recipe``, ``--fp8-exclude``,
``--fp8-tp-plan``), then:

1. takes the ``lightning_fp8:`` section out of the Accelerate config file (Accelerate rejects unknown keys) and
   hands Accelerate a copy without it; a file without Accelerate's required ``distributed_type`` stops here, with
   what to add;
2. resolves the FP8 settings, each from its flag, else the config section, else the ``LIGHTNING_FP8_*`` variable
   already in the environment, else its default (the ``fp8-lm`` recipe, no excluded module, the ``gpt`` plan; see
   :func:`resolve_environment`); a bad recipe name stops here with the list of valid names;
3. exports them as ``LIGHTNING_FP8_RECIPE`` / ``LIGHTNING_FP8_EXCLUDE`` / ``LIGHTNING_FP8_TP_PLAN`` and runs
   ``accelerate launch``.

One deliberate difference: on CPU with more than one process and no ``mpirun`` hostfile, ``accelerate launch``
runs a single process (its CPU multi-process path needs MPI). ``lightning-fp8 launch`` starts the processes with
torchrun instead, with ``ACCELERATE_USE_CPU=true`` so each one joins a gloo process group, and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from lightning_fp8.integrations.accelerate.config import (
    CONFIG_KEY,
    ENV_EXCLUDE,
    ENV_RECIPE,
    OFF,
    TP_PLANS,
)
from lightning_fp8.integrations.accelerate.launch_config import (
    check_accelerate_keys,
    read_config,
    resolve_environment,
    write_config,
)
from lightning_fp8.recipe import FP8Recipe

USAGE = """usage: lightning-fp8 launch [--fp8-recipe NAME] [--fp8-exclude PATTERNS] [--fp8-tp-plan PLAN]
                            [accelerate launch options] training_script [script args]
       lightning-fp8 recipes

  launch   `accelerate launch` with FP8-LM on (see `lightning-fp8 launch --help`)
  recipes  list the FP8 recipe names and their fields
"""


FP8_OPTIONS = f"""lightning-fp8 launch options (FP8-LM; docs/accelerate.md):
  --fp8-recipe NAME        one of {FP8Recipe.names()}, or '{OFF}'; overrides `{CONFIG_KEY}.recipe`
                           of the config file (default: the config section, else ${ENV_RECIPE}, else fp8-lm)
  --fp8-exclude PATTERNS   comma-separated module name patterns kept in high precision (e.g. lm_head);
                           overrides `{CONFIG_KEY}.exclude_modules` (default: the config section, else
                           ${ENV_EXCLUDE})
  --fp8-tp-plan PLAN       with --parallelism_config_tp_size N > 1: one of {list(TP_PLANS)} (default gpt;
                           'none': the script shards the model); overrides `{CONFIG_KEY}.tp_plan`
"""


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``lightning-fp8`` console script; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "launch":
        return launch(rest)
    if command == "recipes":
        if rest in (["-h"], ["--help"]):
            print(USAGE)
            return 0
        if rest:  # `recipes fp8-lm` printed every recipe, as if the name had been read
            print(f"lightning-fp8 recipes: takes no arguments, got {rest}\n\n{USAGE}", file=sys.stderr)
            return 2
        for name in FP8Recipe.names():
            print(f"{name}: {json.dumps(FP8Recipe.from_name(name).to_dict())}")
        return 0
    print(f"lightning-fp8: unknown command {command!r}: use 'launch' or 'recipes'\n\n{USAGE}", file=sys.stderr)
    return 2


def _parser() -> argparse.ArgumentParser:
    from accelerate.commands.launch import launch_command_parser

    parser = launch_command_parser()
    parser.prog = "lightning-fp8 launch"
    group = parser.add_argument_group("lightning_fp8", "FP8-LM training (lightning_fp8.accelerate.Accelerator)")
    group.add_argument(
        "--fp8-recipe",
        "--fp8_recipe",
        dest="lightning_fp8_recipe",
        action="append",  # given twice: refused in launch() (see _FP8_FLAGS)
        help=f"FP8 recipe name: one of {FP8Recipe.names()}, or '{OFF}' to turn FP8-LM off. Overrides the "
        f"config file's `{CONFIG_KEY}.recipe`.",
    )
    group.add_argument(
        "--fp8-exclude",
        "--fp8_exclude",
        dest="lightning_fp8_exclude",
        action="append",
        help="Comma-separated module name patterns kept in high precision (e.g. 'lm_head'). Overrides the config "
        f"file's `{CONFIG_KEY}.exclude_modules` (default: that, else ${ENV_EXCLUDE} from the environment).",
    )
    group.add_argument(
        "--fp8-tp-plan",
        "--fp8_tp_plan",
        dest="lightning_fp8_tp_plan",
        action="append",
        help=f"Tensor-parallel plan applied with --parallelism_config_tp_size > 1: one of {list(TP_PLANS)}. "
        f"Overrides the config file's `{CONFIG_KEY}.tp_plan`.",
    )
    # Accelerate's help formatter lists only its own argument groups: ours go first, wherever -h/--help was given.
    accelerate_help = parser.format_help
    ours = f"{FP8_OPTIONS}\nAll other options are those of `accelerate launch`:\n\n"

    def format_help() -> str:
        # That formatter also filters the groups by sys.argv as `accelerate launch` would see it: under another program
        # name (lightning-fp8) it hid most of them (--config_file, --cpu, ...). Formatted as `accelerate launch --help`.
        argv, sys.argv = sys.argv, ["accelerate", "launch", "--help"]
        try:
            return ours + accelerate_help()
        finally:
            sys.argv = argv

    parser.format_help = format_help
    return parser


# Accelerate's own FP8 options (for its TransformerEngine and torchao backends, MS-AMP's before 1.16), which
# lightning_fp8's Accelerator replaces: accepted by its parser, they would do nothing here.
def _accelerate_fp8_options(parser: argparse.ArgumentParser) -> dict[str, str]:
    return {opt: action.option_strings[0] for action in parser._actions if action.dest.startswith("fp8_")
            for opt in action.option_strings}  # fmt: skip


def _check_no_accelerate_fp8_options(parser: argparse.ArgumentParser, argv: list[str], script: str) -> None:
    """Raise for an ``accelerate launch`` FP8 option (``--fp8_margin``...) given before the training script."""
    options = _accelerate_fp8_options(parser)
    launcher_args = argv[: argv.index(script)] if script in argv else argv
    given = sorted({options[a.split("=")[0]] for a in launcher_args if a.split("=")[0] in options})
    if given:
        raise ValueError(
            f"{', '.join(given)}: options of Accelerate's own FP8 backends (TransformerEngine, torchao), which "
            f"lightning_fp8's Accelerator replaces, so they would do nothing. Set FP8-LM's with --fp8-recipe (see "
            f"`lightning-fp8 recipes`) or the config file's `{CONFIG_KEY}:` section (docs/accelerate.md)"
        )


# Our options and their argparse destinations (lists: each is parsed with action="append", to refuse a repeat).
_FP8_FLAGS = {
    "--fp8-recipe": "lightning_fp8_recipe",
    "--fp8-exclude": "lightning_fp8_exclude",
    "--fp8-tp-plan": "lightning_fp8_tp_plan",
}


def _given_once(flag: str, values: list[str] | None) -> str | None:
    """The value of one of :data:`_FP8_FLAGS`; ValueError when it was given more than once, which argparse would
    settle silently by the last (``--fp8-exclude a --fp8-exclude b`` trained ``a`` in FP8)."""
    if values is None or len(values) == 1:
        return None if values is None else values[0]
    hint = f", with several patterns comma-separated ({flag} {','.join(values)})" if flag == "--fp8-exclude" else ""
    raise ValueError(f"{flag} given {len(values)} times ({values}), the last would silently win: give it once{hint}")


def launch(argv: list[str]) -> int:
    """``lightning-fp8 launch``: resolve the FP8 settings, then run ``accelerate launch`` in this process."""
    from accelerate.commands.config.config_args import default_config_file

    parser = _parser()
    args = parser.parse_args(argv)
    given = {flag: vars(args).pop(dest) for flag, dest in _FP8_FLAGS.items()}
    # Accelerate reads its default config file unless --cpu is given; mirror that to find our section.
    config_path = args.config_file
    if config_path is None and os.path.isfile(default_config_file) and not args.cpu:
        config_path = default_config_file
    # A missing file is left to Accelerate, which says what to do about it.
    read = bool(config_path and os.path.isfile(config_path))
    try:
        recipe_flag, exclude_flag, tp_plan_flag = (_given_once(flag, values) for flag, values in given.items())
        config = read_config(config_path) if read else {}
        has_section = CONFIG_KEY in config
        section = config.pop(CONFIG_KEY, None)
        if has_section and section is None:  # `lightning_fp8:` with nothing under it: every key at its default
            section = {}
        _check_no_accelerate_fp8_options(parser, argv, args.training_script)
        if read:
            check_accelerate_keys(config, config_path)
        _check_no_fsdp_on_cpu(args, config)
        settings = resolve_environment(section, recipe_flag, exclude_flag, config_path, tp_plan_flag)
        if settings.get(ENV_RECIPE) != OFF:  # Accelerate's launcher would fail on fp8 first, with a traceback
            from lightning_fp8.integrations.accelerate import refusals

            try:
                refusals.check_mixed_precision(args.mixed_precision or _config_mixed_precision(config))
            except ValueError as err:
                key = "mixed_precision" if "mixed_precision" in config else "fp16: true"  # the old form of fp16
                where = "--mixed_precision" if args.mixed_precision else f"`{key}` in the config file {config_path}"
                raise ValueError(f"{err} (set by {where})") from None
            if read and "fp8_config" in config:  # as the command line's --fp8_* options, refused there
                raise ValueError(
                    f"config file {config_path} has an `fp8_config` section: settings of Accelerate's own FP8 "
                    f"backends, which FP8-LM does not read; remove it and set FP8-LM's in the `{CONFIG_KEY}` section"
                )
    except ValueError as err:
        print(f"lightning-fp8 launch: error: {err}", file=sys.stderr)
        return 2
    _use_parallelism_config_if_sized(args)
    return _launch_accelerate(args, config, config_path, has_section, settings)


def _config_mixed_precision(config: dict[str, Any]) -> Any:
    """The config file's ``mixed_precision`` as Accelerate reads it: an old file's ``fp16: true`` (no
    ``mixed_precision`` key) is ``fp16``."""
    if "mixed_precision" in config:
        return config["mixed_precision"]
    return "fp16" if config.get("fp16") else None


def _launch_accelerate(
    args: argparse.Namespace, config: dict[str, Any], path: str | None, has_section: bool, settings: dict[str, str]
) -> int:
    """Export ``settings`` and run ``accelerate launch`` in this process (with the config file ``path`` copied without
    our section when it ``has_section``); its exit status."""
    from accelerate.commands.launch import launch_command

    with tempfile.TemporaryDirectory(prefix="lightning_fp8_") as tmp:
        if has_section:  # Accelerate rejects unknown keys: it gets the file without our section
            args.config_file = write_config(config, Path(tmp) / Path(path).name)
        os.environ.update(settings)
        if _launch_cpu_processes_with_torchrun(args, config) and path is None:
            # With --cpu off, Accelerate would read its default config file, which --cpu kept out (unfiltered: our
            # section fails it, its mixed_precision would leak in): it gets the command line's CPU launch instead.
            # A config file the launch reads (``path``, the default one without --cpu too) stays Accelerate's.
            args.config_file = write_config(_cpu_launch_config(args), Path(tmp) / "cpu_launch.yaml")
        try:
            launch_command(args)
        except subprocess.CalledProcessError as err:
            return err.returncode or 1
    return 0


_PARALLEL_SIZES = ("dp_replicate", "dp_shard", "tp", "cp", "sp")


def _use_parallelism_config_if_sized(args: argparse.Namespace) -> None:
    # accelerate launch ignores --parallelism_config_<dim>_size without --use_parallelism_config (a tensor-parallel
    # launch would silently train data-parallel), and accepts that switch only with FSDP2 in its flags, although its
    # Accelerator runs pure tensor parallelism. The switch only exports these variables: export them here.
    sizes = {d: getattr(args, f"parallelism_config_{d}_size", 1) or 1 for d in _PARALLEL_SIZES}
    if getattr(args, "use_parallelism_config", False) or all(size == 1 for size in sizes.values()):
        return
    env = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true"}
    env.update({f"PARALLELISM_CONFIG_{d.upper()}_SIZE": str(size) for d, size in sizes.items()})
    print(f"lightning-fp8 launch: parallelism sizes given: exporting {env}", file=sys.stderr)
    os.environ.update(env)


def _check_no_fsdp_on_cpu(args: argparse.Namespace, config: dict[str, Any]) -> None:
    """Raise ValueError for FSDP on a multi-process CPU launch: Accelerate runs FSDP on CUDA devices only, and the
    torchrun launch below would have trained the model unsharded under DDP, without a word."""
    fsdp = args.use_fsdp or config.get("distributed_type") == "FSDP"
    num_processes = args.num_processes if args.num_processes is not None else config.get("num_processes", 1)
    cpu = args.cpu or config.get("use_cpu", False)
    if fsdp and cpu and (num_processes or 1) > 1:
        raise ValueError(
            "FSDP on the CPU (--cpu or use_cpu: true): Accelerate runs FSDP on CUDA devices only, so the model would "
            "train unsharded under DDP. Launch on GPUs, or drop the FSDP settings (distributed_type: MULTI_CPU) to "
            "train with DDP on the CPU"
        )


def _launch_cpu_processes_with_torchrun(args: argparse.Namespace, config: dict[str, Any]) -> bool:
    """Turn a multi-process CPU launch without an mpirun hostfile into a torchrun launch; whether it did."""
    # accelerate launch on CPU starts N processes only through mpirun (--mpirun_hostfile); without it, it starts
    # one. torchrun (Accelerate's multi-GPU launcher) starts N, and ACCELERATE_USE_CPU makes each a gloo rank.
    cpu = args.cpu or config.get("use_cpu", False) or config.get("distributed_type") == "MULTI_CPU"
    num_processes = args.num_processes if args.num_processes is not None else config.get("num_processes", 1)
    num_machines = args.num_machines if args.num_machines is not None else config.get("num_machines", 1)
    hostfile = args.mpirun_hostfile or (config.get("mpirun_config") or {}).get("mpirun_hostfile")
    if not cpu or hostfile or (num_processes or 1) <= 1 or (num_machines or 1) > 1:
        return False
    print(
        f"lightning-fp8 launch: {num_processes} CPU processes without an mpirun hostfile: starting them with "
        "torchrun (ACCELERATE_USE_CPU=true, gloo backend)",
        file=sys.stderr,
    )
    os.environ["ACCELERATE_USE_CPU"] = "true"
    args.cpu = False
    args.multi_gpu = True
    args.num_processes = num_processes
    return True


def _cpu_launch_config(args: argparse.Namespace) -> dict[str, Any]:
    """The Accelerate config of a one-machine CPU launch of ``args.num_processes`` processes; the flags given on the
    command line override it, as they override any config file."""
    return {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "MULTI_CPU",
        "use_cpu": True,
        "num_processes": args.num_processes,
        "num_machines": 1,
        "mixed_precision": "no",
        "debug": False,
    }


if __name__ == "__main__":
    raise SystemExit(main())
