"""Regions of README that commands generate (bench results, the family matrix), between two marker comments."""

from __future__ import annotations


class ReadmeError(ValueError):
    """The README cannot take generated results: the message says which marker is wrong and how to fix it."""


def replace_region(
    text: str, body: str, where: str, start: str, end: str, section: str,
) -> str:
    """`text` with everything between `start` and `end` replaced by `body` (markers kept, the rest untouched)."""
    starts, ends = text.count(start), text.count(end)
    if starts != 1 or ends != 1:
        raise ReadmeError(
            f"{where} must hold exactly one `{start}` and one `{end}` line (found {starts} and {ends}): put both, "
            f"each on its own line, where the generated text belongs ({section})."
        )
    head, rest = text.split(start, 1)
    if end not in rest:
        raise ReadmeError(f"In {where}, `{end}` comes before `{start}`: swap them.")
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{body.strip()}\n{end}{tail}"
