"""``redbatch generate "prompt"``: ask a chat model and stream its answer to the terminal."""

from __future__ import annotations

from typing import Any

import click
from redbatch.cli import options as o
from redbatch.cli.redis_target import redis_for
from redbatch.cli.signals import signals_raise
from redbatch.common.logs import setup_logging
from redbatch.common.protocol.generation import DEFAULT_MAX_NEW_TOKENS
from redbatch.producer.client import Client

#: The chat model generate asks unless --model names another.
DEFAULT_CHAT_MODEL = "smollm2_135m"


@click.command()
@o.together(o.REDIS(help=o.PRIVATE_REDIS_HELP), o.PREFIX(),
            o.MODEL(default=DEFAULT_CHAT_MODEL), o.MODEL_NAME(), o.LOG_LEVEL(default="WARNING"))
@click.argument("prompt")
@o.opt("--max-new-tokens", env="MAX_NEW_TOKENS", type=click.IntRange(min=1),
       default=DEFAULT_MAX_NEW_TOKENS, help="Most tokens of the answer.")
@o.opt("--temperature", env="TEMPERATURE", type=click.FloatRange(min=0.0), default=0.0,
       help="0 answers greedily; higher samples.")
@o.opt("--seed", env="SEED", type=int, default=None, help="Seed of the sampling.")
@o.TIMEOUT_S(default=120.0, help="Deadline of the job and how long to wait for it, seconds.")
def generate(prompt: str, max_new_tokens: int, temperature: float, seed: int | None,
             timeout_s: float, **options: Any) -> None:
    """Ask the chat model PROMPT (one user message) and stream the answer as it comes.

    Without --redis, a private Redis and worker are started (loading the model takes
    seconds)."""
    setup_logging(options["log_level"])
    with (signals_raise(), redis_for(options) as url,
          Client(url, model=o.served_name(options), prefix=options["prefix"]) as client):
        for delta in client.stream(messages=[{"role": "user", "content": prompt}],
                                   max_new_tokens=max_new_tokens, temperature=temperature,
                                   seed=seed, timeout_s=timeout_s):
            click.echo(delta, nl=False)
        click.echo()
