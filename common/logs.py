"""One logging configuration for every redbatch process."""

from __future__ import annotations

import logging.config


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
