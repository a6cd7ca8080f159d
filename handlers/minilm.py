"""all-MiniLM-L6-v2's encoder in plain torch: BERT's forward pass, then the model card's
pooling.

Embeddings (word + position + token type 0, LayerNorm), 6 layers of 12-head
self-attention (query, key and value in one projection, ``scaled_dot_product_attention``
with the padding masked out) and GELU feed-forward, each post-LayerNorm; then the mean of
the real tokens' vectors, L2-normalised. Checked against sentence-transformers with the
same files (tests/test_text_model.py). Imported by the worker only, from the handler's
``load`` (handlers/text.py): pool processes never import torch.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import nn


class Layer(nn.Module):
    def __init__(self, hidden: int, heads: int, inner: int, eps: float) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.norm1 = nn.LayerNorm(hidden, eps=eps)
        self.up = nn.Linear(hidden, inner)
        self.down = nn.Linear(inner, hidden)
        self.norm2 = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        n, t, h = x.shape
        q, k, v = self.qkv(x).view(n, t, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        att = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        x = self.norm1(x + self.out(att.transpose(1, 2).reshape(n, t, h)))
        out: torch.Tensor = self.norm2(x + self.down(torch.nn.functional.gelu(self.up(x))))
        return out


class MiniLM(nn.Module):
    """Slots (N x 2 x T int: token ids, then the attention mask) -> N x 384 unit vectors."""

    def __init__(self, cfg: dict[str, int | float]) -> None:
        super().__init__()
        h = int(cfg["hidden_size"])
        self.words = nn.Embedding(int(cfg["vocab_size"]), h)
        self.positions = nn.Embedding(int(cfg["max_position_embeddings"]), h)
        self.types = nn.Embedding(int(cfg["type_vocab_size"]), h)
        eps = float(cfg["layer_norm_eps"])
        self.norm = nn.LayerNorm(h, eps=eps)
        self.layers = nn.ModuleList(
            Layer(h, int(cfg["num_attention_heads"]), int(cfg["intermediate_size"]), eps)
            for _ in range(int(cfg["num_hidden_layers"])))

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        ids, mask = batch[:, 0], batch[:, 1] > 0  # the mask's values say a row's kind
        # Run at the batch's longest text, not at the slot's MAX_TOKENS: a batch of short
        # texts costs what they hold. (At least one token: warm-up runs on empty slots.)
        longest = max(1, int(mask.sum(1).max()))
        ids, mask = ids[:, :longest].long(), mask[:, :longest]
        pos = torch.arange(longest, device=ids.device)
        x = self.norm(self.words(ids) + self.positions(pos) + self.types.weight[0])
        keep = mask.bool()
        bias = torch.zeros(keep.shape, dtype=x.dtype, device=x.device)
        bias = bias.masked_fill(~keep, -math.inf)[:, None, None, :]
        for layer in self.layers:
            x = layer(x, bias)
        weights = keep.unsqueeze(-1).to(x.dtype)
        pooled = (x * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, dim=1)


class SlotEncoder(nn.Module):
    """The text model's slots (N x R x 2 x T: NOTE [ Text slots ] in handlers/text.py) ->
    N x R x (384 + 1): each row's unit vector (zeros for a row without text), then the
    row's kind, the mask's value at its first token. Only the rows holding a text run."""

    def __init__(self, encoder: MiniLM) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        n, r, _, t = batch.shape
        rows = batch.reshape(n * r, 2, t)
        kind = rows[:, 1, 0]  # every text starts with [CLS]: its row's mask is set there
        held = (kind > 0).nonzero().squeeze(1)
        width = self.encoder.words.embedding_dim
        if held.numel() == 0:
            out = torch.zeros(n * r, width + 1, device=batch.device)
        else:
            vectors = self.encoder(rows.index_select(0, held))
            out = torch.zeros(n * r, width + 1, dtype=vectors.dtype, device=batch.device)
            out[held, :width] = vectors
        out[:, width] = kind.to(out.dtype)
        return out.reshape(n, r, width + 1)


def load_encoder(d: Path) -> MiniLM:
    """The encoder with the weights of ``d/model.safetensors`` (BERT's names mapped onto
    this module's: query, key and value fused into one projection)."""
    from safetensors.torch import load_file

    model = MiniLM(json.loads((d / "config.json").read_text()))
    w = load_file(str(d / "model.safetensors"))
    state = {"words.weight": w["embeddings.word_embeddings.weight"],
             "positions.weight": w["embeddings.position_embeddings.weight"],
             "types.weight": w["embeddings.token_type_embeddings.weight"],
             "norm.weight": w["embeddings.LayerNorm.weight"],
             "norm.bias": w["embeddings.LayerNorm.bias"]}
    for i in range(len(model.layers)):
        p = f"encoder.layer.{i}."
        for part in ("weight", "bias"):
            state[f"layers.{i}.qkv.{part}"] = torch.cat(
                [w[f"{p}attention.self.{n}.{part}"] for n in ("query", "key", "value")])
            state[f"layers.{i}.out.{part}"] = w[f"{p}attention.output.dense.{part}"]
            state[f"layers.{i}.norm1.{part}"] = w[f"{p}attention.output.LayerNorm.{part}"]
            state[f"layers.{i}.up.{part}"] = w[f"{p}intermediate.dense.{part}"]
            state[f"layers.{i}.down.{part}"] = w[f"{p}output.dense.{part}"]
            state[f"layers.{i}.norm2.{part}"] = w[f"{p}output.LayerNorm.{part}"]
    model.load_state_dict(state)
    return model.eval()
