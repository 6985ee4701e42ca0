"""Structured logging: one `event key=value ...` line per thing that happened, on stderr.

journald adds the time and the unit, so a line carries only the level, the event and
its fields. Values with spaces or quotes are quoted so a line stays one parseable record.
"""

import logging
import sys

_SAFE = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_./:@+,")


def _quote(value) -> str:
    text = str(value)
    if text and all(c in _SAFE for c in text):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def fields(event: str, **kv) -> str:
    """Render an event and its fields as one logfmt-style line."""
    parts = [event]
    parts.extend(f"{k}={_quote(v)}" for k, v in kv.items() if v is not None)
    return " ".join(parts)


class Logger:
    """A thin wrapper that logs events with fields: `log.info("started", port=8080)`."""

    def __init__(self, name: str):
        self._log = logging.getLogger(name)

    @property
    def debugging(self) -> bool:
        """Whether debug lines are written: check before building costly fields."""
        return self._log.isEnabledFor(logging.DEBUG)

    def debug(self, event: str, **kv):
        if self._log.isEnabledFor(logging.DEBUG):
            self._log.debug(fields(event, **kv))

    def info(self, event: str, **kv):
        if self._log.isEnabledFor(logging.INFO):
            self._log.info(fields(event, **kv))

    def warning(self, event: str, **kv):
        self._log.warning(fields(event, **kv))

    def error(self, event: str, **kv):
        self._log.error(fields(event, **kv))


def get(name: str) -> Logger:
    return Logger(name)


def setup(tool: str, level: str = "info") -> None:
    """Send the tool's log lines to stderr as `level tool: event key=value`."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(levelname)s {tool}: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # aiohttp's access log would write one line per request; usage rows are the record.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
