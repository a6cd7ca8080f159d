"""One logging configuration for every redbatch process."""

from __future__ import annotations

import logging
import logging.config
import time


def setup_logging(level: str = "INFO") -> None:
    """Log to stderr with timestamps; stdout stays free for results."""
    logging.config.dictConfig({
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {
            "plain": {"format": "%(asctime)s %(levelname)-7s %(processName)s %(name)s: "
                                "%(message)s"},
        },
        "handlers": {
            "stderr": {"class": "logging.StreamHandler", "formatter": "plain",
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
