"""The YAML files a command line names (``-c FILE``, ``--config FILE``), checked before jsonargparse reads them.

jsonargparse reports a YAML syntax error in the text it was handed (``in "<unicode string>", line 2``), without
the file's name, over several lines; here the error names the flag, the file, the line and the column.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Sequence

import yaml

from lm_systems.errors import InputError

CONFIG_FLAGS = ("-c", "--config")


def config_files(args: Sequence[str]) -> Iterator[tuple[str, str]]:
    """``(flag, path)`` for each config file in ``args``: ``-c FILE``, ``--config FILE`` or ``--config=FILE``."""
    for index, arg in enumerate(args):
        if arg in CONFIG_FLAGS and index + 1 < len(args):
            yield arg, args[index + 1]
        elif arg.startswith("--config="):
            yield "--config", arg.split("=", 1)[1]


def check_config_files(args: Sequence[str]) -> None:
    """Raise InputError naming the flag and the file when a config file is missing or not a YAML mapping."""
    for flag, name in config_files(args):
        path = Path(name)
        if not path.is_file():
            continue  # jsonargparse's own error names a missing file well; a YAML string after -c is allowed too
        try:
            value = yaml.safe_load(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as error:
            raise InputError(f"{flag} {name!r} is not UTF-8 text (byte {error.start})") from error
        except yaml.YAMLError as error:
            mark = getattr(error, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(error, "problem", None) or str(error).splitlines()[0]
            raise InputError(f"{flag} {name!r} is not valid YAML{where}: {problem}; fix the file") from error
        if value is not None and not isinstance(value, dict):
            raise InputError(
                f"{flag} {name!r} holds a YAML {type(value).__name__}, not a mapping of keys such as "
                "'model:' and 'trainer:'"
            )
