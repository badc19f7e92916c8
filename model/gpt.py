"""The decoder-only Transformer: embeddings, a stack of blocks, and the output layer
that scores every vocabulary entry as the next token. Also the KV cache that makes
generation cost one token's work per step."""
from __future__ import annotations

from typing import Iterator, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.registry import check as check_config
from model.config import ModelConfig, ModelError
from model.layers import NORMS, Block
from model.mask import Mask
from model.positions import POSITION_ENCODINGS
from model.sampling import sample_next


class Output(NamedTuple):
    logits: torch.Tensor                     # (B, T, vocab_size)
    loss: torch.Tensor | None                # mean cross-entropy when targets are given
    attentions: list | None                  # per layer (B, H, T, T_keys) when asked for


class KVCache:
    """Keys and values of the tokens seen so far, per layer, so that decoding a new
    token computes only its own query, key and value.

    The model, not a layer, does the bookkeeping: `begin(T)` before the layers says
    which key positions the next T tokens will attend to, each layer's `update` writes
    its keys and values, and `end(T)` advances. Without a window the buffer holds every
    token up to `max_len`. With a sliding window W it is a rolling buffer: it keeps the
    n_global first tokens and the newest W-1, which is all a future query can see, so
    its memory stays bounded by n_global + 2·W however long generation runs."""

    def __init__(self, n_layer: int, max_len: int, window: int = 0, n_global: int = 0):
        self.n_layer, self.window, self.n_global = n_layer, window, n_global
        self.capacity = n_global + 2 * window if window else max_len
        self.k: torch.Tensor | None = None   # (n_layer, B, H_kv, capacity, d_k)
        self.v: torch.Tensor | None = None
        self.positions = torch.empty(0, dtype=torch.long)   # absolute position of each slot
        self.stored = 0                      # filled slots
        self.length = 0                      # tokens seen: the position of the next one
        self.first = 0                       # the smallest position still stored

    def begin(self, T: int, device) -> tuple[torch.Tensor, int]:
        """Make room for T new tokens; return the key positions they will see and the
        smallest of them."""
        if self.positions.device != torch.device(device):
            self.positions = self.positions.to(device)
        if self.stored + T > self.capacity:
            if not self.window:
                raise ValueError(f"KV cache holds {self.capacity} tokens; "
                                 f"{self.stored + T} requested")
            self._compact()
            if self.stored + T > self.capacity:          # a long chunk: grow to fit it
                self._grow(self.stored + T)
        new = torch.arange(self.length, self.length + T, device=device)
        self.positions = torch.cat([self.positions[:self.stored], new])
        return self.positions, (self.first if self.stored else self.length)

    def _compact(self) -> None:
        """Keep the global tokens and the newest window-1: the only ones still visible."""
        g = min(self.n_global, self.stored)
        recent = min(self.window - 1, self.stored - g)
        keep = list(range(g)) + list(range(self.stored - recent, self.stored))
        idx = torch.tensor(keep, dtype=torch.long, device=self.positions.device)
        if self.k is not None:
            n = len(keep)
            self.k[:, :, :, :n] = self.k[:, :, :, idx].clone()
            self.v[:, :, :, :n] = self.v[:, :, :, idx].clone()
        self.positions = self.positions[idx]
        self.stored = len(keep)
        self.first = 0 if g else self.length - recent

    def _grow(self, capacity: int) -> None:
        if self.k is not None:
            extra = list(self.k.shape)
            extra[3] = capacity - self.capacity
            self.k = torch.cat([self.k, self.k.new_zeros(extra)], dim=3)
            self.v = torch.cat([self.v, self.v.new_zeros(extra)], dim=3)
        self.capacity = capacity

    def update(self, layer: int, k_new, v_new):
        """Store this chunk's keys/values; return every key/value the chunk attends to."""
        if self.k is None:
            B, H_kv, _, D = k_new.shape
            shape = (self.n_layer, B, H_kv, self.capacity, D)
            self.k = torch.zeros(shape, dtype=k_new.dtype, device=k_new.device)
            self.v = torch.zeros(shape, dtype=v_new.dtype, device=v_new.device)
        start, end = self.stored, self.stored + k_new.shape[2]
        self.k[layer, :, :, start:end] = k_new
        self.v[layer, :, :, start:end] = v_new
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def end(self, T: int) -> None:
        self.stored += T
        self.length += T

    def nbytes(self) -> int:
        return 0 if self.k is None else 2 * self.k.numel() * self.k.element_size()


class GPT(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        check_config(config)
        if config.vocab_size <= 0:
            raise ModelError("model.vocab_size must be set (it comes from the tokenizer)")
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)    # token -> vector
        self.positions = POSITION_ENCODINGS[config.position](config)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.norm_f = NORMS[config.norm](config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            # The same matrix reads tokens in and scores them out (arXiv:1608.05859).
            self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        # GPT-2: scale the layers that write into the residual stream by 1/√(2·n_layer),
        # so the stream's variance does not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith(("w_o.weight", "mlp.proj.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / (2 * config.n_layer) ** 0.5)

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameters, counting a tied matrix once; non_embedding leaves out the
        token and position tables (the usual count for scaling laws)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.wte.weight.numel()
            n -= sum(p.numel() for p in self.positions.parameters())
            if not self.config.tie_embeddings:
                n += self.lm_head.weight.numel()     # the output matmul still does work
        return n

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token (forward + backward): 6 per weight that multiplies
        (the output layer included) plus 12·L·d·T for the attention scores and the
        weighted sum (PaLM, arXiv:2204.02311, appendix B)."""
        c = self.config
        T = seq_len or c.block_size
        matmul_weights = self.num_params(non_embedding=True)
        if c.tie_embeddings:
            matmul_weights += self.lm_head.weight.numel()
        return 6 * matmul_weights + 12 * c.n_layer * c.n_embd * T

    def forward(self, idx, targets=None, cache: KVCache | None = None,
                return_attention: bool = False) -> Output:
        B, T = idx.shape
        c = self.config
        if cache is None:
            start, k_pos, k_first = 0, torch.arange(T, device=idx.device), 0
        else:
            start = cache.length
            k_pos, k_first = cache.begin(T, idx.device)
        mask = Mask(q_start=start, q_len=T, k_pos=k_pos, k_first=k_first, window=c.sliding_window,
                    n_global=c.n_global, bias_fn=self.positions.score_bias())
        x = self.drop(self.positions.embed(self.wte(idx), start))   # (B, T, C)
        attentions = [] if return_attention else None
        for block in self.blocks:
            x, weights = block(x, self.positions, mask, cache, return_attention)
            if return_attention:
                attentions.append(weights)
        if cache is not None:
            cache.end(T)
        logits = self.lm_head(self.norm_f(x))                        # (B, T, vocab)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)),
                                   targets.reshape(-1), ignore_index=-1)
        return Output(logits, loss, attentions)

    def new_cache(self, max_len: int) -> KVCache:
        return KVCache(self.config.n_layer, max_len, self.config.sliding_window,
                       self.config.n_global)

    @property
    def rolls(self) -> bool:
        """A windowed model whose positions are relative (or absent) can decode for
        ever from a rolling cache; learned and sinusoidal positions are absolute."""
        return bool(self.config.sliding_window) and not self.positions.absolute

    @torch.no_grad()
    def generate(self, idx, max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0, generator: torch.Generator | None = None,
                 use_cache: bool = True, on_step=None) -> Iterator[torch.Tensor]:
        """Yield (B, 1) new tokens one at a time, so a caller can print them as they come.

        A windowed model with relative positions decodes from a rolling cache with no
        limit. Otherwise the model sees at most block_size tokens: with the cache, when
        it fills up the oldest half of the context is dropped and the rest is re-read
        in one pass (positions restart at 0), so every token is still predicted from
        between block_size/2 and block_size tokens of context. `on_step(logits, token)`,
        if given, sees each step's last-position logits and the token drawn from them."""
        window = self.config.block_size
        context = idx if self.rolls and use_cache else idx[:, -window:]
        cache = None
        for _ in range(max_new_tokens):
            if not use_cache:
                logits = self(context[:, -window:]).logits
            elif cache is None:
                cache = self.new_cache(window)
                logits = self(context, cache=cache).logits
            elif cache.length >= window and not self.rolls:
                context = context[:, -(window // 2 or 1):]
                cache = self.new_cache(window)
                logits = self(context, cache=cache).logits
            else:
                logits = self(context[:, -1:], cache=cache).logits
            logits = logits[:, -1].float()        # sampling maths in fp32 whatever the weights
            token = sample_next(logits, temperature, top_k, top_p, generator)
            if on_step is not None:
                on_step(logits, token)
            # Keep only what a later step can read: the newest block_size tokens.
            context = torch.cat([context, token], dim=1)[:, -window:]
            yield token
