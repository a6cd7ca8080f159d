"""The generation worker (PROTOCOL.md "Generation", docs/generation.md): a chat model served
with continuous batching, its answers streamed to Redis, its results written with the ack.

Three threads, so that Redis I/O never runs on the compute loop:

    reader   intake.read (XREADGROUP, takeovers, validation, as every worker) -> parse the
             payload, tokenize, read what a dead worker streamed already -> engine inbox
    engine   add what came, cancel what was stopped, Engine.step() -> outbox, in order
    writer   coalesce the outbox's tokens for stream_interval_ms, then ONE pipeline: every
             chunk (XADD 0-n, PEXPIRE), the running requests' stop keys, the leases due;
             then the finished requests' results in the result transaction with the ack

A job taken over from a dead worker starts from its token stream: the prompt and the tokens
already streamed are computed again (Engine.add ``replay``) and chunks go on from the next
index; one whose stream already holds its last chunk is only answered.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from contextlib import ExitStack, closing
from typing import Any

import redis
import torch
from redbatch import __version__
from redbatch.common.config import Settings
from redbatch.common.protocol import Keys, ProtocolError
from redbatch.common.protocol.errors import ErrorCode
from redbatch.common.protocol.generation import GenerationRequest, parse_payload
from redbatch.common.protocol.keys import stream_partition
from redbatch.common.redis_io import connect
from redbatch.gpu_worker.device.watchdog import Watchdog
from redbatch.gpu_worker.generating.metrics import GenerationMetrics
from redbatch.gpu_worker.generating.writing import Gen, WriteState, gen_chunk, result_of
from redbatch.gpu_worker.generation.engine import Engine, EngineConfig, GenerationError
from redbatch.gpu_worker.generation.model import Llama, load_weights
from redbatch.gpu_worker.generation.sampling import SamplingParams
from redbatch.gpu_worker.generation.scheduler import SchedulerConfig
from redbatch.gpu_worker.metrics import Health, MetricsServer, WorkerMetrics
from redbatch.gpu_worker.startup import connect_model, connect_waiting
from redbatch.gpu_worker.streams.heartbeat import Heartbeat
from redbatch.gpu_worker.streams.intake import Intake, Job
from redbatch.gpu_worker.streams.reclaim import Leases
from redbatch.gpu_worker.streams.results import Answer, ResultWriter
from redbatch.gpu_worker.streams.sampler import Sampler
from redbatch.gpu_worker.streams.tokens import TokenStreams
from redbatch.handlers import smollm2

logger = logging.getLogger(__name__)

#: How long an idle thread waits for work before it looks at its stop flag again, s.
IDLE_WAIT_S = 0.05
#: Back-off after a failed write, s.
RETRY_S = 0.5


def request_prompt(req: GenerationRequest) -> list[int]:
    """The prompt's token ids (the chat template applied to ``messages``)."""
    text = smollm2.chat_prompt(req.messages) if req.messages is not None else req.prompt
    assert text is not None
    return smollm2.encode(text)


class GenerationWorker:
    """Serves one chat model from its streams until stopped (module docstring)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._stop = threading.Event()      # read no more; finish what runs
        self._abort = threading.Event()     # leave now; unanswered jobs stay pending
        self._inbox: queue.SimpleQueue[Gen] = queue.SimpleQueue()
        self._outbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._cancels: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._leases = Leases()
        self._inflight = 0
        self._lock = threading.Lock()
        self._health = Health()
        self._metrics: WorkerMetrics | None = None
        self._gen_metrics: GenerationMetrics | None = None
        #: A step raised: the process should exit DEVICE_EXIT_CODE (cli/worker.py does).
        self.device_failed = False

    def stop(self) -> None:
        self._stop.set()

    def abort(self) -> None:
        self._stop.set()
        self._abort.set()

    def run(self) -> None:
        """Load the model, connect, serve until stopped, always stop the threads."""
        s = self.settings
        logger.info("starting generation worker %s for %s", s.consumer, s.model.served_name)
        self._metrics = metrics = WorkerMetrics(s.model.served_name, s.generation.max_running)
        with ExitStack() as stack:
            server = MetricsServer(metrics, self._health)
            metrics_on = bool(s.metrics_port) and server.start(s.metrics_host, s.metrics_port)
            stack.callback(server.close)
            engine = self._engine()
            # A step that never returns (a hung device) ends the process with code 3.
            self._watchdog = stack.enter_context(closing(Watchdog(s.batch_timeout_s)))
            self._gen_metrics = GenerationMetrics(metrics.registry, s.model.served_name,
                                                  engine.pool.blocks)
            metrics.started(s.consumer, __version__, "cpu", 0, 0)
            self._health.model_loaded = True
            intake, writer = connect_model(s, metrics, self._health, self._stop, charges=True)
            tokens = TokenStreams(connect(s.redis), s.consumer, s.result_ttl_s * 1000)
            beat = Heartbeat.for_worker(connect(s.redis), intake.keys, s.consumer, "cpu",
                                        s.generation.max_running, lambda: self._inflight,
                                        server.port if metrics_on else None,
                                        health=self._health)
            sampler = Sampler(connect_waiting(s.redis, self._stop), intake.keys, metrics,
                              self._health, "cpu")
            self._serve(engine, intake, writer, tokens, beat, sampler)

    def _engine(self) -> Engine:
        """The model loaded (on the CPU, with --torch-threads when given) and its engine."""
        g, threads = self.settings.generation, self.settings.model.torch_threads
        if threads > 0:
            torch.set_num_threads(threads)
        engine = Engine(Llama(load_weights()), smollm2.decode, EngineConfig(
            kv_memory_bytes=g.kv_memory_mib * 2**20,
            scheduler=SchedulerConfig(max_running=g.max_running,
                                      max_step_tokens=max(256, g.max_running))))
        logger.info("model ready: device=cpu torch_threads=%d max_running=%d kv_blocks=%d "
                    "stream_interval_ms=%g", torch.get_num_threads(), g.max_running,
                    engine.pool.blocks, g.stream_interval_ms)
        return engine

    def _serve(self, engine: Engine, intake: Intake, writer: ResultWriter,
               tokens: TokenStreams, beat: Heartbeat, sampler: Sampler) -> None:
        """Run the three threads (and the heartbeat, the sampler) until stopped; then give
        what runs the shutdown grace, and join them."""
        s = self.settings
        threads = [threading.Thread(target=fn, name=f"redbatch-gen-{name}", daemon=True)
                   for name, fn in (("reader", lambda: self._read(intake, writer, tokens)),
                                    ("engine", lambda: self._compute(engine)),
                                    ("writer", lambda: self._write(writer, tokens)),
                                    ("sampler", lambda: sampler.run(self._abort)))]
        beat.start()
        for t in threads:
            t.start()
        logger.info("worker %s serving %s (generation)", s.consumer, s.model.served_name)
        try:
            while not self._stop.wait(IDLE_WAIT_S):
                pass
            self._health.stopping = True
            deadline = time.monotonic() + s.shutdown_grace_s
            while self._inflight and time.monotonic() < deadline and not self._abort.is_set():
                time.sleep(IDLE_WAIT_S)
        finally:
            self._abort.set()
            for t in threads:
                t.join(timeout=10)
            beat.stop()
            logger.info("worker %s stopped", s.consumer)

    # ------------------------------------------------------------------ reader

    def _read(self, intake: Intake, writer: ResultWriter, tokens: TokenStreams) -> None:
        cfg = self.settings.generation
        while not self._stop.is_set():
            free = 2 * cfg.max_running - self._inflight
            if free <= 0:
                time.sleep(IDLE_WAIT_S)
                continue
            try:
                jobs, bad = intake.read(free, free, self.settings.block_ms)
                answers = [writer.rejected(b) for b in bad]
                held = [(j.stream, j.entry_id) for j in jobs]
                intake.reclaimer.leases.release(held)
                self._leases.hold(held)
                gens = self._accept(jobs, answers, writer)
                self._resume(gens, tokens)
            except redis.RedisError as e:
                logger.warning("reading jobs failed (%s); retrying", e)
                time.sleep(RETRY_S)
                continue
            for gen in gens:
                self._add_inflight(1)
                if gen.last is not None:
                    self._outbox.put(("end", gen))
                else:
                    self._inbox.put(gen)
            if answers:
                self._outbox.put(("answers", answers))

    def _accept(self, jobs: Sequence[Job], answers: list[Answer],
                writer: ResultWriter) -> list[Gen]:
        """The jobs that can run; the others answered into ``answers`` (bad_input, ...)."""
        gens = []
        now = time.monotonic()
        for job in jobs:
            try:
                if job.deadline_s is not None and now >= job.deadline_s:
                    raise ProtocolError(ErrorCode.EXPIRED, "the deadline passed before it ran")
                req = parse_payload(job.envelope.payload, self.settings.generation.max_new_tokens)
                prompt = request_prompt(req)
                if not prompt:
                    raise ProtocolError(ErrorCode.BAD_INPUT, "the prompt has no tokens")
                params = SamplingParams(req.max_new_tokens, req.temperature, req.top_p,
                                        req.seed, req.stop)
            except ProtocolError as e:
                answers.append(writer.failed(job, e.code, e.message))
                continue
            part, _ = stream_partition(job.stream)
            gens.append(Gen(job, Keys(self.settings.model.served_name,
                                      self.settings.redis.prefix, part), prompt, params))
        return gens

    def _resume(self, gens: Sequence[Gen], tokens: TokenStreams) -> None:
        """Jobs delivered before: go on from what their token stream holds."""
        again = [g for g in gens if g.job.taken_over or g.job.deliveries > 1]
        streamed = tokens.streamed([g.token_key for g in again])
        for gen in again:
            chunks = streamed.get(gen.token_key, [])
            if not chunks or [c.index for c in chunks] != list(range(1, len(chunks) + 1)):
                continue
            gen.next_index = chunks[-1].index + 1
            for c in chunks:
                gen.tokens += c.token_ids
                gen.text.append(c.text)
            if chunks[-1].finish is not None or len(gen.tokens) >= gen.params.max_new_tokens:
                gen.last = chunks[-1]
            else:
                gen.replay = list(gen.tokens)
            logger.info("took over %s at chunk %d (%d tokens streamed)", gen.rid,
                        gen.next_index, len(gen.tokens))

    def _add_inflight(self, n: int) -> None:
        with self._lock:
            self._inflight += n

    # ------------------------------------------------------------------ engine

    def _compute(self, engine: Engine) -> None:
        """The compute loop: nothing here waits on Redis."""
        gm = self._gen_metrics
        assert gm is not None
        while not self._abort.is_set():
            self._health.stepped()
            self._take_new(engine, block=not engine.has_work())
            while True:
                try:
                    engine.cancel(self._cancels.get_nowait())
                except queue.Empty:
                    break
            if engine.has_work():
                started = time.monotonic()
                try:
                    with self._watchdog.watch("generation step"):
                        outputs = engine.step()
                except Exception as e:
                    self._device_lost(e)
                    return
                self._outbox.put(("step", outputs))
                sched = engine.scheduler
                gm.step(outputs, time.monotonic() - started, len(sched.running),
                        len(sched.waiting), engine.pool.used)

    def _device_lost(self, e: Exception) -> None:
        """A step raised: the device (or the model on it) cannot be trusted any more, as
        the image worker's DeviceLost. Leave at once for a restart; what runs stays
        pending, and whoever takes it over goes on from its token stream."""
        logger.critical("device failure in a generation step, exiting for a restart "
                        "(generations in flight stay pending and are taken over from their "
                        "token streams): %s: %s", type(e).__name__, e)
        logger.debug("the failed step", exc_info=e)
        self.device_failed = True
        self.abort()

    def _take_new(self, engine: Engine, block: bool) -> None:
        try:
            gen = self._inbox.get(timeout=IDLE_WAIT_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._outbox.put(("start", gen))
            try:
                engine.add(gen.rid, gen.prompt, gen.params, interactive=not gen.job.bulk,
                           deadline_s=gen.job.deadline_s, replay=gen.replay)
            except GenerationError as e:
                self._outbox.put(("refused", (gen, e)))
            try:
                gen = self._inbox.get_nowait()
            except queue.Empty:
                return

    # ------------------------------------------------------------------ writer

    def _write(self, writer: ResultWriter, tokens: TokenStreams) -> None:
        """Coalesce, then one round trip for the chunks, stop keys and leases; then the
        results of what ended, with their ack. Nothing is lost to a failed write: a chunk
        keeps its index until Redis has it, an answer stays until it is written."""
        state = WriteState()
        interval = self.settings.generation.stream_interval_ms / 1000
        renew_s = self.settings.reclaim_idle_ms / 3000
        last_flush = 0.0
        while not self._abort.is_set():
            self._drain(state, writer)
            now = time.monotonic()
            # A first token goes out at once (time to first token); the rest coalesce.
            if not (state.ended or state.answers
                    or (state.gens and now - last_flush >= interval)
                    or any(g.next_index == 1 and g.pending_tokens
                           for g in state.gens.values())):
                continue
            try:
                self._flush(state, writer, tokens, self._leases.due(renew_s))
                last_flush = now
            except redis.RedisError as e:
                logger.warning("writing token chunks or results failed (%s); retrying", e)
                self._abort.wait(RETRY_S)

    def _drain(self, state: WriteState, writer: ResultWriter) -> None:
        """Take every message the outbox holds (waiting a little for the first)."""
        try:
            kind, item = self._outbox.get(timeout=IDLE_WAIT_S)
        except queue.Empty:
            return
        while True:
            state.take(kind, item, writer)
            try:
                kind, item = self._outbox.get_nowait()
            except queue.Empty:
                return

    def _flush(self, state: WriteState, writer: ResultWriter, tokens: TokenStreams,
               leases: dict[str, list[bytes]]) -> None:
        for gen in state.gens.values():
            gen_chunk(gen)
        running = [g for g in state.gens.values() if g.last is None]
        sent = tokens.write_step([(g.token_key, c) for g in state.gens.values()
                                  for c in g.unsent],
                                 [g.keys.stop(g.rid) for g in running], leases)
        for gen in state.gens.values():
            gen.unsent.clear()
        for gen in running:
            if gen.keys.stop(gen.rid) in sent.stopped and not gen.cancel_sent:
                gen.cancel_sent = True
                self._cancels.put(gen.rid)
        answers = state.answers + [result_of(g, writer) for g in state.ended]
        if not answers:
            return
        flushed = writer.write_and_ack(answers)
        retry = {id(a) for a in (*flushed.held, *flushed.failed)}
        done = [a for a in answers if id(a) not in retry]
        self._leases.release((a.stream, a.entry_id) for a in done)
        if self._metrics is not None:
            self._metrics.answered((stream_partition(a.stream)[1].value, a.outcome, a.timings,
                                    a.dead_letter is not None) for a in done)
            self._metrics.dead_lettered.inc(flushed.undeliverable)
        finished = {a.request_id for a in done}
        self._add_inflight(-sum(1 for g in state.ended if g.rid in finished))
        self._add_inflight(-sum(1 for a in state.answers if id(a) not in retry
                                and a.request_id in state.counted))
        for g in state.ended:
            if g.rid in finished:
                state.gens.pop(g.rid, None)
        tokens.forget(g.token_key for g in state.ended if g.rid in finished)
        state.ended = [g for g in state.ended if g.rid not in finished]
        state.answers = [a for a in state.answers if id(a) in retry]


