"""torchtitan's argv as a TOML job document, and back.

A plan's ``launch.torchtitan`` is TOML (contract, Plan answer); torchtitan ≥ 0.3 reads no job file but the same
options as argv overrides (``--section.key value``, :func:`pipesched.optimizer.planner.launch.torchtitan_launch`).
The two are one mapping, so a user can keep either and get the other:

* ``--module X`` / ``--config Y`` (no dot) are top-level keys ``module`` / ``config``;
* ``--section.key value`` is ``key = value`` in ``[section]`` (an integer where the value is one, a string
  otherwise); a flag without a value is ``true``; an option followed by several values is an array, each value a
  comma-joined list of names (``--parallelism.module_fqns_per_model_part "tok_embeddings,layers.0" "layers.1"``
  is ``[["tok_embeddings", "layers.0"], ["layers.1"]]``, the shape of torchtitan's ``list[list[str]]``);
* torchtitan 0.3's activation-checkpoint subcommand ``activation-checkpoint:MODE`` (always last) is
  ``[activation_checkpoint] mode = "MODE"`` — the table torchtitan ≤ 0.2's TOML job files used.

Section and key names are torchtitan 0.3.0's (``torchtitan/config/configs.py``); torchtitan ≤ 0.2 job files share
``[parallelism]``, ``[training]`` and ``[activation_checkpoint]`` keys of the same names.
"""

from __future__ import annotations

import tomllib
from typing import Any

import tomli_w

__all__ = ["ACTIVATION_CHECKPOINT_PREFIX", "args_from_toml", "toml_from_args"]

#: torchtitan 0.3's activation-checkpoint subcommand: ``activation-checkpoint:none|selective|full``.
ACTIVATION_CHECKPOINT_PREFIX = "activation-checkpoint:"

_HEADER = (
    "# pipesched plan for torchtitan. torchtitan >= 0.3 reads no job file: pass each key as --section.key VALUE\n"
    "# after `-m torchtitan.train` (module/config as --module/--config, [activation_checkpoint] mode as the last\n"
    "# argument activation-checkpoint:MODE); `pipesched launch` writes that argv to torchtitan.args.\n"
)


def _scalar(value: str) -> int | str:
    digits = value[1:] if value.startswith("-") else value
    return int(value) if digits.isdigit() else value


def _options(args: list[str]) -> list[tuple[str, list[str]]]:
    options: list[tuple[str, list[str]]] = []
    for item in args:
        if item.startswith("--") or item.startswith(ACTIVATION_CHECKPOINT_PREFIX):
            options.append((item, []))
        elif not options:
            raise ValueError(f"torchtitan argv starts with a value, not an option: {item!r}")
        else:
            options[-1][1].append(item)
    return options


def toml_from_args(args: list[str]) -> str:
    """The TOML job document of torchtitan's argv ``args`` (one argument per item), with a header comment.

    Raises:
        ValueError: an argument that is neither an option nor follows one.
    """
    document: dict[str, Any] = {}
    for option, values in _options(args):
        if option.startswith(ACTIVATION_CHECKPOINT_PREFIX):
            document.setdefault("activation_checkpoint", {})["mode"] = option.removeprefix(ACTIVATION_CHECKPOINT_PREFIX)
            continue
        section, _, key = option.removeprefix("--").rpartition(".")
        if not values:
            value: Any = True
        elif len(values) == 1 and section:
            value = _scalar(values[0])
        elif len(values) == 1:
            value = values[0]
        else:
            value = [names.split(",") for names in values]
        (document.setdefault(section, {}) if section else document)[key] = value
    return _HEADER + tomli_w.dumps(document)


def _option_args(name: str, value: Any) -> list[str]:
    if value is True:
        return [f"--{name}"]
    if value is False:
        return []
    if isinstance(value, list):
        return [f"--{name}", *(",".join(item) if isinstance(item, list) else str(item) for item in value)]
    return [f"--{name}", str(value)]


def args_from_toml(text: str) -> list[str]:
    """torchtitan ≥ 0.3's argv (one argument per item) from a TOML job document :func:`toml_from_args` wrote.

    Raises:
        tomllib.TOMLDecodeError: ``text`` is not TOML.
    """
    document = tomllib.loads(text)
    args: list[str] = []
    for name, value in document.items():
        if not isinstance(value, dict):
            args += _option_args(name, value)
    for section, table in document.items():
        if isinstance(table, dict) and section != "activation_checkpoint":
            for key, value in table.items():
                args += _option_args(f"{section}.{key}", value)
    mode = document.get("activation_checkpoint", {}).get("mode")
    if mode is not None:
        args.append(f"{ACTIVATION_CHECKPOINT_PREFIX}{mode}")
    return args
