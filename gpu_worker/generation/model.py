"""The Llama forward pass in plain torch over a paged KV cache (SmolLM2-135M's layout).

One call computes a step: any mix of prefill chunks and single decode tokens from many
sequences, flattened into one row a token. The projections and the feed-forward run on all
rows at once; attention runs the decode rows as one padded batch and each prefill chunk on
its own (NOTE [ Paged attention ]).

NOTE [ Paged attention ]
  The cache holds, per layer, K and V as ``[blocks x block_size, kv_heads, head_dim]``: a
  token's *slot* is ``block * block_size + offset``, its block from the sequence's block
  table. Each step first writes the new tokens' K/V at their slots, then gathers each
  sequence's context (slots of positions ``0 .. last``) for attention, so a chunk sees its
  own tokens and everything before them, and a block shared by two sequences (a cached
  prefix) is read by both and written by neither again.

RoPE rotates adjacent pairs (x[2i], x[2i+1]): the GGUF converter permuted the q/k weights
for that layout, so the weights are used as stored.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import numpy as np
import torch
import torch.nn.functional as F
from redbatch.handlers.smollm2 import LlamaConfig, config, read_gguf


@dataclass(frozen=True, slots=True)
class Layer:
    attn_norm: torch.Tensor
    qkv: torch.Tensor          # [q + k + v out, hidden]
    out: torch.Tensor
    ffn_norm: torch.Tensor
    gate_up: torch.Tensor      # [2 x ffn, hidden]
    down: torch.Tensor


@dataclass(frozen=True, slots=True)
class Weights:
    config: LlamaConfig
    embed: torch.Tensor        # [vocab, hidden], also the output head (tied)
    layers: tuple[Layer, ...]
    norm: torch.Tensor


@cache
def load_weights() -> Weights:
    """Dequantize the GGUF file's tensors to float32, once per process (~2 s)."""
    from gguf import quants

    reader, cfg = read_gguf(), config()
    raw = {t.name: t for t in reader.tensors}

    def get(name: str) -> torch.Tensor:
        t = raw[name]
        values = np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        # F32 tensors come back as views of the read-only mapped file: copy those only.
        return torch.from_numpy(values if values.flags.writeable else values.copy())

    def layer(i: int) -> Layer:
        p = f"blk.{i}."
        return Layer(
            attn_norm=get(p + "attn_norm.weight"),
            qkv=torch.cat([get(p + "attn_q.weight"), get(p + "attn_k.weight"),
                           get(p + "attn_v.weight")]),
            out=get(p + "attn_output.weight"),
            ffn_norm=get(p + "ffn_norm.weight"),
            gate_up=torch.cat([get(p + "ffn_gate.weight"), get(p + "ffn_up.weight")]),
            down=get(p + "ffn_down.weight"))

    return Weights(cfg, get("token_embd.weight"), tuple(layer(i) for i in range(cfg.layers)),
                   get("output_norm.weight"))


class KVCache:
    """K and V of every layer in ``blocks`` blocks of ``block_size`` tokens (float32)."""

    def __init__(self, cfg: LlamaConfig, blocks: int, block_size: int) -> None:
        self.block_size = block_size
        shape = (cfg.layers, blocks * block_size, cfg.kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape)
        self.v = torch.zeros(shape)


def kv_bytes_per_token(cfg: LlamaConfig) -> int:
    """Bytes the cache holds a token (K and V, every layer, float32)."""
    return 2 * cfg.layers * cfg.kv_heads * cfg.head_dim * 4


@dataclass(frozen=True, slots=True)
class Chunk:
    """One sequence's tokens in a step: ``tokens`` at positions ``start ..``, and the
    slots of its whole context (positions ``0 .. start + len(tokens) - 1``)."""

    tokens: Sequence[int]
    start: int
    context_slots: Sequence[int]


class StepBatch:
    """The index tensors of one step, built once and shared by every layer."""

    def __init__(self, chunks: Sequence[Chunk]) -> None:
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        last: list[int] = []
        for c in chunks:
            n = len(c.tokens)
            ids += c.tokens
            pos += range(c.start, c.start + n)
            slots += c.context_slots[c.start:c.start + n]
            last.append(len(ids) - 1)
        self.ids = torch.tensor(ids, dtype=torch.long)
        self.positions = torch.tensor(pos, dtype=torch.long)
        self.slots = torch.tensor(slots, dtype=torch.long)
        self.last_rows = torch.tensor(last, dtype=torch.long)
        self.decode_rows: torch.Tensor | None = None
        self.decode_index = torch.zeros((0, 0), dtype=torch.long)
        self.decode_mask = torch.zeros((0, 1, 1, 0), dtype=torch.bool)
        #: Each prefill chunk: (first row, rows, context slots, causal mask [rows, context]).
        self.prefills: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []
        self._split(chunks)

    def _split(self, chunks: Sequence[Chunk]) -> None:
        decodes: list[tuple[int, Sequence[int]]] = []
        row = 0
        for c in chunks:
            n = len(c.tokens)
            if n == 1:
                decodes.append((row, c.context_slots))
            else:
                keys = torch.arange(len(c.context_slots))
                queries = torch.arange(c.start, c.start + n)
                self.prefills.append((row, n, torch.tensor(c.context_slots, dtype=torch.long),
                                      keys[None, :] <= queries[:, None]))
            row += n
        if decodes:
            width = max(len(s) for _, s in decodes)
            self.decode_index = torch.zeros((len(decodes), width), dtype=torch.long)
            self.decode_mask = torch.zeros((len(decodes), 1, 1, width), dtype=torch.bool)
            for i, (_, s) in enumerate(decodes):
                self.decode_index[i, :len(s)] = torch.tensor(s, dtype=torch.long)
                self.decode_mask[i, 0, 0, :len(s)] = True
            self.decode_rows = torch.tensor([r for r, _ in decodes], dtype=torch.long)


class Llama:
    """The model: ``forward(chunks, cache)`` returns each chunk's last-token logits."""

    def __init__(self, weights: Weights) -> None:
        self.w, cfg = weights, weights.config
        self.cfg = cfg
        inv = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64)
                                       / cfg.head_dim)
        angles = torch.arange(cfg.context, dtype=torch.float64)[:, None] * inv[None, :]
        self.cos, self.sin = angles.cos().float(), angles.sin().float()

    @torch.inference_mode()
    def forward(self, chunks: Sequence[Chunk], cache: KVCache,
                every_token: bool = False) -> torch.Tensor:
        """Logits ``[len(chunks), vocab]`` at each chunk's last token (with ``every_token``:
        ``[tokens, vocab]``, a row a token in chunk order), after writing every chunk's K/V
        into ``cache`` (NOTE [ Paged attention ])."""
        batch = StepBatch(chunks)
        x = self.w.embed[batch.ids]
        cos, sin = self.cos[batch.positions], self.sin[batch.positions]
        for i, layer in enumerate(self.w.layers):
            x = x + self._attention(layer, _rms(x, layer.attn_norm, self.cfg.rms_eps),
                                    cos, sin, cache.k[i], cache.v[i], batch)
            gate, up = F.linear(_rms(x, layer.ffn_norm, self.cfg.rms_eps),
                                layer.gate_up).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer.down)
        last = _rms(x if every_token else x[batch.last_rows], self.w.norm, self.cfg.rms_eps)
        return F.linear(last, self.w.embed)

    def _attention(self, layer: Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor,
                   batch: StepBatch) -> torch.Tensor:
        cfg, d = self.cfg, self.cfg.head_dim
        q, k, v = torch.split(F.linear(h, layer.qkv),
                              [cfg.heads * d, cfg.kv_heads * d, cfg.kv_heads * d], dim=-1)
        q = _rope(q.view(-1, cfg.heads, d), cos, sin)
        k_cache[batch.slots] = _rope(k.reshape(-1, cfg.kv_heads, d), cos, sin)
        v_cache[batch.slots] = v.reshape(-1, cfg.kv_heads, d)
        out = torch.empty_like(q)
        if batch.decode_rows is not None:
            rows, index, mask = batch.decode_rows, batch.decode_index, batch.decode_mask
            out[rows] = _sdpa(q[rows][:, None], k_cache[index], v_cache[index], mask)[:, 0]
        for row, n, slots, mask in batch.prefills:
            out[row:row + n] = _sdpa(q[None, row:row + n], k_cache[slots][None],
                                     v_cache[slots][None], mask[None, None])[0]
        return F.linear(out.reshape(-1, cfg.heads * d), layer.out)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q ``[B, Q, H, d]``, k and v ``[B, K, kv_heads, d]`` -> ``[B, Q, H, d]``."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                          v.transpose(1, 2), attn_mask=mask,
                                          enable_gqa=True).transpose(1, 2)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs of ``x [T, heads, d]`` by each row's angles ``[T, d/2]``."""
    pairs = x.reshape(*x.shape[:-1], -1, 2)
    a, b = pairs[..., 0], pairs[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
