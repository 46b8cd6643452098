"""Source globs (a manifest's ``glob`` and ``exclude``) as regular expressions over posix relative paths.

A manifest checks its patterns here when it is loaded, so a pattern that cannot compile (``[z-a]*.txt``: a
range from high to low) is one error naming its key before anything runs, not a ``re.error`` mid-flow.
"""

from __future__ import annotations

import re


def glob_regex(pattern: str) -> re.Pattern[str]:
    """Compile a glob over posix relative paths: ``**`` spans folders, ``*``, ``?`` and ``[...]`` stay in one.

    Raises ``re.error`` for a ``[...]`` that is no valid character set (:func:`checked_glob` says why).
    """
    parts = pattern.strip("/").split("/")
    regex = ""
    for index, part in enumerate(parts):
        if part == "**" and index == len(parts) - 1:
            regex += "(?:/.*)?" if index else ".*"  # "dir/**" is the folder and everything under it
        elif part == "**":
            regex += "(?:.*/)?" if not index else "/(?:.*/)?"
        else:
            separator = "/" if index and not regex.endswith("/)?") else ""
            regex += separator + component_regex(part)
    return re.compile(regex, re.DOTALL)


def checked_glob(pattern: str) -> str:
    """``pattern`` when it compiles; ValueError saying what is wrong with it otherwise (pydantic names the key)."""
    try:
        glob_regex(pattern)
    except re.error as err:
        raise ValueError(f"{pattern!r} is not a valid glob ({err.msg}); a [...] set lists characters or ranges "
                         "from low to high, e.g. [a-z]*.txt") from None
    return pattern


def glob_reaches(pattern: str, folder: str) -> bool:
    """Whether ``pattern`` (a source glob) can match a path inside ``folder`` (posix, relative)."""
    parts = pattern.strip("/").split("/")
    names = folder.split("/")
    for index, part in enumerate(parts):
        if part == "**":
            return True
        if index == len(names):
            return True  # the folder's own components matched; this one can match what is inside it
        if not re.fullmatch(component_regex(part), names[index], re.DOTALL):
            return False
    return False


def component_regex(part: str) -> str:
    """One path component of a glob as a regex (patterns are short: a loop over characters is fine)."""
    out, index = [], 0
    while index < len(part):
        char = part[index]
        close = part.find("]", index + 2) if char == "[" else -1
        if char == "*":
            out.append("[^/]*")
        elif char == "?":
            out.append("[^/]")
        elif close != -1:
            body = part[index + 1 : close]
            out.append("[" + ("^/" + body[1:] if body.startswith("!") else body).replace("\\", "\\\\") + "]")
            index = close
        else:
            out.append(re.escape(char))
        index += 1
    return "".join(out)
