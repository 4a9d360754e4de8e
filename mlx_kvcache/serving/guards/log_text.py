"""Client text in the log, escaped: one record is one line, and no byte a client chose
reaches the terminal of whoever tails the log as a control sequence.

A session name (``metadata.user_id``, ``prompt_cache_key``), a path, a tool type or a
prompt excerpt is client text; a newline in it would start what reads as a line of the
server's own (a forged ``[cache]`` line), and an ESC would drive the reader's terminal.
`printable` escapes every character that is not printable as Python's ``repr`` writes it
(``\\n``, ``\\x1b``, ``\\u2028``); `EscapedLines` does it to every record a log handler
writes (the message with its arguments; a traceback, which the formatter adds after it,
keeps its lines).
"""

from __future__ import annotations

import logging

__all__ = ["printable", "EscapedLines", "escape_handlers"]


def printable(text: str) -> str:
    """``text`` with each character that is not printable (controls, line and paragraph
    separators, format characters) escaped as ``repr`` escapes it; printable text is
    returned as it is."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


class EscapedLines(logging.Filter):
    """A handler filter: the record's message, arguments filled in, made `printable`."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format is the logging module's to report
            return True
        if not message.isprintable():
            record.msg, record.args = printable(message), None
        return True


def escape_handlers(logger: logging.Logger) -> None:
    """Give every handler of ``logger`` (the root logger: mlx-lm's ``basicConfig``
    handler, which our records reach too) the `EscapedLines` filter, once."""
    for handler in logger.handlers:
        if not any(isinstance(f, EscapedLines) for f in handler.filters):
            handler.addFilter(EscapedLines())
