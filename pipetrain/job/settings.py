"""How a configuration field is declared: its default, its documentation, its command-line flag.

Every field of a :mod:`pipetrain.job.config` section is a dataclass field made by
:func:`setting`, which attaches a :class:`Flag` to the field's metadata. :func:`settings`
lists a section's fields with their flags, the flat key and the flag name filled in; the
command line (:func:`pipetrain.cli.train_cmd.register`) and the flat keys of
``TrainConfig.of`` are derived from it.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["Flag", "setting", "settings"]


@dataclass(frozen=True)
class Flag:
    """How one configuration field is documented and appears on the command line.

    Attributes:
        help: the field's documentation (also its ``--help`` text).
        flag: the command-line flag (``--lr``); ``None`` for fields set from Python only.
        key: the flat key (``TrainConfig.of``), unique over all sections; filled in with the
            field's name by :func:`settings` when not declared.
        kind: ``value`` (takes an argument), ``true`` (a switch setting True), ``false``
            (a switch setting False, e.g. ``--no-fused-grads``), ``append`` (repeatable).
        type: argparse's type for ``value`` flags (``int``, ``float``; default ``str``).
        convert: turns the parsed argument into the field's value (raises RuntimeConfigError).
        choices, metavar: as in argparse.
        hidden: accepted but not shown in ``--help`` (test hooks, expert knobs).
        exclusive: flags with the same group name are mutually exclusive.
        schedule_option: the field is an option of the schedule builder
            (:attr:`ScheduleSpec.options`), passed when set to a non-default value.
    """

    help: str
    flag: str | None = None
    key: str = ""
    kind: str = "value"
    type: Callable[[str], Any] | None = None
    convert: Callable[[Any], Any] | None = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    hidden: bool = False
    exclusive: str | None = None
    schedule_option: bool = False


#: ``setting(flag=...)``'s default: the flag is ``--`` + the flat key with dashes.
_DERIVED = "--"


def setting(default: Any = None, help: str = "", *, flag: str | None = _DERIVED,
            factory: Callable[[], Any] | None = None, **flag_kw: Any) -> Any:
    """A dataclass field with its :class:`Flag` (by default the flag is ``--`` + the key with dashes)."""
    meta = {"flag": Flag(help=help, flag=flag, **flag_kw)}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def settings(section: Any) -> Iterator[tuple[dataclasses.Field[Any], Flag]]:
    """The fields of a section class with their :class:`Flag` (key and flag name filled in)."""
    for f in fields(section):
        fl: Flag | None = f.metadata.get("flag")
        if fl is None:
            continue
        key = fl.key or f.name
        name = fl.flag if fl.flag != _DERIVED else "--" + key.replace("_", "-")
        yield f, dataclasses.replace(fl, key=key, flag=name)
