"""One logging configuration for every redbatch process."""

from __future__ import annotations

import json
import logging
import logging.config
import time

#: Log line formats: ``text`` for people, ``json`` (one object a line) for log collectors.
LOG_FORMATS = ("text", "json")


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``ts`` (UTC, ISO 8601 with milliseconds), ``level``,
    ``process``, ``logger``, ``message``, and ``exception`` (its traceback) when there is
    one. Messages are the same text as in the plain format, secrets redacted alike."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        line: dict[str, object] = {
            "ts": f"{stamp}.{int(record.msecs):03d}Z", "level": record.levelname,
            "process": record.processName, "logger": record.name,
            "message": record.getMessage()}
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def setup_logging(level: str = "INFO", fmt: str = "text") -> None:
    """Log to stderr (``fmt``: one of LOG_FORMATS); stdout stays free for results."""
    logging.config.dictConfig({
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {
            "text": {"format": "%(asctime)s %(levelname)-7s %(processName)s %(name)s: "
                               "%(message)s"},
            "json": {"()": JsonFormatter},
        },
        "handlers": {
            "stderr": {"class": "logging.StreamHandler", "formatter": fmt,
                       "stream": "ext://sys.stderr"},
        },
        "loggers": {"redbatch": {"level": level.upper(), "handlers": ["stderr"]}},
    })


class Throttle:
    """Logs each kind of message at most once per ``every_s`` seconds, then says how many
    like it it held back: a fault that repeats on every batch gives one line a minute, not
    thousands. ``kind`` names the message; keep the set of kinds small."""

    def __init__(self, logger: logging.Logger, every_s: float) -> None:
        self.logger = logger
        self.every_s = every_s
        self._seen: dict[str, tuple[float, int]] = {}  # kind -> (last logged, held back)

    def warning(self, kind: str, msg: str, *args: object) -> None:
        self._log(logging.WARNING, kind, msg, args)

    def error(self, kind: str, msg: str, *args: object) -> None:
        self._log(logging.ERROR, kind, msg, args)

    def _log(self, level: int, kind: str, msg: str, args: tuple[object, ...]) -> None:
        now = time.monotonic()
        last, held = self._seen.get(kind, (float("-inf"), 0))
        if now - last < self.every_s:
            self._seen[kind] = (last, held + 1)
            return
        self._seen[kind] = (now, 0)
        if held:
            msg, args = msg + " (and %d more like it in %.0f s)", (*args, held, now - last)
        self.logger.log(level, msg, *args)
