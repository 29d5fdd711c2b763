"""User-facing errors: what is wrong and where, printed by the CLI without a traceback."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Location:
    """Where a value came from: a file position, or a `--set` override."""

    file: str | None = None
    line: int | None = None  # 1-based
    column: int | None = None  # 1-based
    origin: str | None = None  # e.g. "--set mixer.heads=4"

    def __str__(self) -> str:
        if self.origin is not None:
            return self.origin
        parts = [self.file or "<input>"]
        if self.line is not None:
            parts.append(str(self.line))
            if self.column is not None:
                parts.append(str(self.column))
        return ":".join(parts)


class ArchspecError(Exception):
    """An error the user can fix; the CLI prints `str(error)` and exits with status 2.

    `problems` holds one `(location, dotted_field, message)` per problem so that a spec
    with several mistakes reports all of them at once.
    """

    def __init__(self, message: str, problems: list[tuple[Location | None, str | None, str]] | None = None):
        super().__init__(message)
        self.problems = problems or []

    def __str__(self) -> str:
        head = super().__str__()
        if not self.problems:
            return head
        lines = [head]
        for loc, field, msg in self.problems:
            where = f"{loc}: " if loc is not None else ""
            what = f"{field}: " if field else ""
            lines.append(f"  {where}{what}{msg}")
        return "\n".join(lines)


def first_line(exc: BaseException, limit: int = 200) -> str:
    """`Type: first line of the message`, cut at `limit` characters: an error as one line of
    a report or log."""
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:limit]}"
