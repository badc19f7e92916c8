"""The decoder-only Transformer the article builds: token embeddings, a stack of
blocks (model/layers.py), a final norm and the output layer that scores every
vocabulary entry as the next token. Read top to bottom: __init__ builds the parts,
forward runs them. A variant (segment embeddings, value embeddings, U-net skips, another
readout) is built only when its config field asks for it, and forward meets it only
behind an `if`; generation (model/decode.py) reads the model through forward and
new_cache."""
from __future__ import annotations

from dataclasses import astuple, replace
from typing import Iterator, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.decode import generate as generate_tokens
from model.cache import KVCache
from model.config import ModelConfig, ModelError
from model.extras import TokenTypes, UNetSkips, ValueEmbeddings
from model.layers import BLOCKS, NORMS, Block, layer_names
from model.attention import Mask, MultiHeadAttention
from model.mechanisms import MECHANISMS
from model.meta import Unfilled
from model.mtp import MultiTokenPrediction
from model.positions import POSITION_ENCODINGS
from model.readout import READOUTS, AdaptiveReadout, MaskedLMTransform, head_macs
from model.registry import CHECKED, check as check_config, wants_variants


# The parameters GPT-2's init scales (a mechanism's layer writes through its w_o, as
# tests/test_mechanisms_in_a_gpt.py checks of every entry); a multi-token prediction
# module's blocks (model/mtp.py) end the same way and are scaled alike.
RESIDUAL_WRITERS = (".attn.w_o.weight", ".mlp.proj.weight")


class Output(NamedTuple):
    logits: torch.Tensor | None              # (B, T, vocab_size); None without an output layer
    loss: torch.Tensor | None                # mean cross-entropy when targets are given
    attentions: list | None                  # per layer (B, H, T, T_keys) when asked for
    hidden: torch.Tensor | None = None       # (B, T, C) the last hidden states, normalised


class GPT(nn.Module):
    # The block each layer gets, by model.block's name: the plain GPT has GPT-2's pre-norm
    # Block (model/layers.py); GPTWithVariants, below, has every arrangement and the parts
    # a config adds to a block.
    block_types = {"prenorm": Block}

    @classmethod
    def skeleton(cls, config: ModelConfig) -> "GPT":
        """The model's modules, names and shapes on the meta device: no memory, no values
        and no initialiser run (for sizes, and to check a checkpoint against)."""
        with torch.device("meta"), Unfilled():
            return cls(config)

    @classmethod
    def unfilled(cls, config: ModelConfig, device="cpu") -> "GPT":
        """The model with its weights allocated but not initialised (the random draws are
        skipped, so their memory is not touched) and every buffer computed: for weights
        that load_state_dict(..., assign=True) is about to replace."""
        with torch.device(device), Unfilled():
            return cls(config)

    def __new__(cls, config: ModelConfig | None = None, *args, **kwargs):
        # GPT(config) is the plain model the article builds, and its forward has no branch
        # for a part it does not have; a config that asks for one (segment or value
        # embeddings, U-net skips, post-norm, another readout, soft-capped logits) builds
        # GPTWithVariants, below, which adds those parts. A config that model/registry.py
        # has checked and found plain goes straight on; any other is checked here (sizes
        # and names) and its class chosen.
        if config is not None and CHECKED.get(id(config)) != (astuple(config), True):
            check_config(config, building=True)
            if cls is GPT and wants_variants(config):
                cls = GPTWithVariants
        return super().__new__(cls)

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)    # token -> vector
        self.positions = POSITION_ENCODINGS[config.position](config)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(self.block_types[config.block](config, i) for i in range(config.n_layer))
        self.norm_f = NORMS[config.norm](config)
        self.lm_head = self.output_layer(config)
        if config.tie_embeddings:
            # The same matrix reads tokens in and scores them out (arXiv:1608.05859).
            self.lm_head.weight = self.wte.weight
        # Values are drawn once every part exists (a subclass draws when it has built its
        # own); on the meta device (sizes only) no values exist.
        if type(self) is GPT and not self.wte.weight.is_meta:
            self._init_all(config)

    def output_layer(self, config: ModelConfig) -> nn.Module | None:
        """Scores every vocabulary entry from a hidden state: one matrix, n_embd -> vocab."""
        return nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def _init_all(self, config: ModelConfig):
        self.apply(self._init_weights)
        # GPT-2: the layers that write into the residual stream (attention's W_O and the
        # MLP's second matrix, in every block) start scaled by 1/√(2·n_layer), so the
        # stream's variance does not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith(RESIDUAL_WRITERS):
                nn.init.normal_(p, mean=0.0, std=0.02 / (2 * config.n_layer) ** 0.5)

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameters, counting a tied matrix once; non_embedding leaves out the lookup
        tables (tokens, positions: the usual count for scaling laws). An untied output
        layer stays in the count (its matmul does work), once."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= sum(p.numel() for table in self.tables() for p in table.parameters())
        return n

    def tables(self) -> list[nn.Module]:
        """The parts num_params(non_embedding=True) leaves out."""
        return [self.wte, self.positions]

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token (forward + backward): 6 per weight that multiplies
        (the output layer included) plus three times each layer's mechanism's own forward
        FLOPs (for softmax attention 4·d·T, the scores and the weighted sum: PaLM's
        12·L·d·T, arXiv:2204.02311, appendix B)."""
        c = self.config
        T = seq_len or c.block_size
        matmul_weights = self.num_params(non_embedding=True) + self.readout_macs()
        # A mixture of experts multiplies by only the experts a token is routed to (model/moe.py).
        matmul_weights -= sum(getattr(block.mlp, "idle_weights", 0) for block in self.blocks)
        return int(6 * matmul_weights + 3 * sum(MECHANISMS[n].flops(c, T) for n in layer_names(c)))

    def readout_macs(self) -> int:
        """The output layer's multiplies per token that num_params(non_embedding=True)
        does not already count: a tied matrix is counted there as the token table."""
        return self.lm_head.weight.numel() if self.config.tie_embeddings else 0

    def forward(self, idx, targets=None, cache: KVCache | None = None,
                return_attention: bool = False, attention_mask: torch.Tensor | None = None,
                token_types: torch.Tensor | None = None) -> Output:
        """idx (B, T) token ids; targets (B, T) with -1 where no loss is taken;
        attention_mask (B, T), 1 at real tokens and 0 at padding (a batch of unequal
        lengths: padded keys are hidden from every query); token_types (B, T) the
        segment of each token, for a model with model.n_token_types."""
        mask = self.mask_for(idx.shape[1], idx.device, cache, attention_mask)   # what each query sees
        x = self.wte(idx)                                            # (B, T, C)
        if self.positions.absolute:                    # sinusoidal or learned: a vector a position
            x = self.positions.embed(x, mask.q_start)
        x = self.drop(x)
        attentions = []
        for block in self.blocks:
            x, weights = block(x, self.positions, mask, cache, return_attention and block.has_weights)
            attentions.append(weights)
        if cache is not None:
            cache.end(idx.shape[1])
        h = self.norm_f(x)
        logits, loss = self.logits_and_loss(h, targets)
        return Output(logits, loss, attentions if return_attention else None, h)

    def mask_for(self, T: int, device, cache: KVCache | None, attention_mask) -> Mask:
        """The pass's one Mask (model/attention.py): T queries at positions 0..T-1 over
        the same keys, the model's window, and the padding; after a cache, the queries
        follow its tokens and see the keys it holds (KVCache.mask). The positions' score
        bias rides along: ALiBi's, None for every other encoding."""
        padding = None if attention_mask is None else attention_mask == 0
        c = self.config
        if cache is not None:
            return cache.mask(T, device, bias_fn=self.positions.score_bias, causal=c.causal,
                              key_padding=padding)
        return Mask(0, T, torch.arange(T, device=device), bias_fn=self.positions.score_bias,
                    window=c.sliding_window, n_global=c.n_global, causal=c.causal, key_padding=padding)

    def logits_and_loss(self, h, targets=None):
        """Scores for every vocabulary entry from the final hidden states (B, T, C), and
        their mean cross-entropy against `targets` where given."""
        logits = self.lm_head(h)                                     # (B, T, vocab)
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-1)

    def readout(self, h: torch.Tensor) -> torch.Tensor:
        """Scores for every vocabulary entry from final-norm hidden states (B, T, C):
        the output layer alone, for tools that read the residual stream through it."""
        if not READOUTS[self.config.readout].scores_tokens:
            raise ModelError("this encoder has no output layer (model.readout=none): its hidden "
                             "states cannot be read as token scores")
        return self.logits_and_loss(h)[0]

    def new_cache(self, max_len: int) -> KVCache:
        return KVCache(self.config.n_layer, max_len, self.kept_window(), self.config.n_global)

    def kept_window(self) -> int:
        """The window a cache may roll over: the model's, unless a layer sees everything
        (model.full_attention_every), when every key is kept and each windowed layer's
        mask hides the old ones."""
        return 0 if self.config.full_attention_every else self.config.sliding_window

    def check_generates(self) -> None:
        """ModelError, saying why, for a model that cannot write text token by token."""
        if not self.config.causal:
            raise ModelError("this model is an encoder (model.causal=false): every token sees "
                             "the whole text, the future included, so it cannot write one token "
                             "after another; fill in a [MASK] instead (python -m attnlab.fill)")
        if not READOUTS[self.config.readout].scores_tokens:
            raise ModelError("this model has no output layer (model.readout=none), so it scores "
                             "no tokens and cannot generate")

    def generate(self, idx, max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0, generator: torch.Generator | None = None,
                 use_cache: bool = True, on_step=None, decode: str = "cache",
                 sinks: int | None = None, stream_window: int = 0,
                 forced: torch.Tensor | None = None) -> Iterator[torch.Tensor]:
        """Yield (B, 1) new tokens one at a time, so a caller can print them as they come.
        `decode` says how earlier tokens are kept: re-read in `full` every step, in a
        growing `cache`, a preallocated `static` cache, or that step replayed as a CUDA
        `graph`; `sinks` streams past the context (StreamingLLM); `forced` tokens are fed
        instead of sampled. model/decode.py does the work and says the rest."""
        return generate_tokens(self, idx, max_new_tokens, temperature, top_k, top_p, generator,
                               use_cache, on_step, decode, sinks, stream_window, forced)


class GPTWithVariants(GPT):
    """The GPT with the parts a config adds to the article's, each built only when its
    field asks for it: BERT's segment embeddings, its norm after the embeddings and its
    masked-LM head (model/readout.py), value embeddings and U-net skips across the stack
    (model/extras.py), soft-capped logits, the adaptive softmax, or no output layer at
    all (an encoder kept for its hidden states), and blocks with more than GPT-2's
    (BlockWithVariants and the post-norm and sandwich arrangements, model/layers.py).
    GPT(config) builds this class when the config asks for any of them; the names of the
    plain parts are kept, so checkpoints read the same either way."""
    block_types = BLOCKS
    PASS_ORDER = ("wte", "token_types", "positions", "local_positions", "norm_emb", "drop",
                  "blocks", "value_embeds", "skips", "norm_f", "head_transform", "lm_head",
                  "adaptive", "mtp")

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        block = BLOCKS[config.block]
        # BERT's segment embeddings (one learned vector per sentence of a pair), and the
        # post-norm stack's norm of the summed embeddings (it has no final norm).
        self.token_types = TokenTypes(config) if config.n_token_types else None
        self.norm_emb = NORMS[config.norm](config) if block.norms_embeddings else None
        if not block.final_norm:
            self.norm_f = None
        # Value embeddings (a learned vector per token added to its values in every layer)
        # and U-net skips with one weight each, from 1 (a plain sum at the start).
        self.value_embeds = ValueEmbeddings(config) if config.value_embeds else None
        self.skips = UNetSkips(config.n_layer) if config.skip_connections else None
        self.skip_weights = (nn.Parameter(torch.ones(config.n_layer // 2))
                             if config.skip_connections else None)
        # DeepSeek-V3's multi-token prediction: modules after the stack predicting the
        # tokens further ahead through this model's embedding and head (model/mtp.py).
        self.mtp = MultiTokenPrediction(config) if config.mtp_depth else None
        # Gemma 3's queries and keys: a learned norm each over d_k, and its own score scale.
        if config.qk_norm_weight or config.score_scale:
            # (a hybrid's other layers form their queries and keys their own way)
            for block in (b for b in self.blocks if isinstance(b.attn, MultiHeadAttention)):
                block.attn.learn_qk_norms(
                    (lambda: NORMS[config.norm](config, config.head_dim)) if config.qk_norm_weight
                    else None, config.score_scale)
        # Gemma 3 turns its windowed layers' queries and keys by a RoPE of base 10,000 and its
        # full layers' by one of 1,000,000: nearby order matters to a window, while a full
        # layer's slow pairs must not wrap round within its long context (arXiv:2503.19786,
        # section 2). A second table, chosen per layer in forward; model.positions is the full one.
        self.local_positions = (POSITION_ENCODINGS[config.position](
            replace(config, rope_theta=config.rope_local_theta)) if config.rope_local_theta else None)
        # The parts in the order the pass meets them, so the values drawn for each are those
        # a model built in one piece draws from the same seed.
        rank = {name: i for i, name in enumerate(self.PASS_ORDER)}
        self._modules = dict(sorted(self._modules.items(), key=lambda item: rank.get(item[0], len(rank))))
        if not self.wte.weight.is_meta:
            self._init_all(config)

    def _init_all(self, config: ModelConfig):
        super()._init_all(config)
        if config.zero_head:
            # Every logit 0 at the start: the first steps move the readout towards the
            # tokens' frequencies before any gradient reaches the blocks through it.
            nn.init.zeros_(self.lm_head.weight)

    def output_layer(self, config: ModelConfig) -> nn.Module | None:
        # BERT's masked-LM head puts a dense layer, GELU and a LayerNorm first and gives
        # every vocabulary entry a bias; the adaptive softmax (model/readout.py) has
        # matrices of its own; an encoder may have no output layer at all.
        readout = READOUTS[config.readout]
        self.head_transform = MaskedLMTransform(config) if readout.transform else None
        lm_head = (nn.Linear(config.n_embd, config.vocab_size, bias=readout.transform)
                   if readout.scores_tokens and not readout.shortlisted else None)
        self.adaptive = AdaptiveReadout(config) if readout.shortlisted else None
        return lm_head

    def tables(self) -> list[nn.Module]:
        # The adaptive softmax is left out like the tied readout it replaces: it exists to
        # make a large vocabulary cheap, not to add capacity to the model.
        return super().tables() + [m for m in (self.value_embeds, self.adaptive) if m is not None]

    def readout_macs(self) -> int:
        if self.adaptive is not None:
            # the tail counted for the 5% of tokens a 95% shortlist leaves it (the default rule)
            c = self.config
            return head_macs(c.n_embd, c.vocab_size, c.readout_shortlist)
        return super().readout_macs()

    def flops_per_token(self, seq_len: int | None = None) -> int:
        flops = super().flops_per_token(seq_len)
        if self.mtp is None:
            return flops
        # Multi-token prediction's weights are in num_params already; its blocks' attention
        # and the shared output layer, run once more a depth, are not.
        c = self.config
        names = layer_names(replace(c, n_layer=c.n_layer + c.mtp_depth))[c.n_layer:]
        return int(flops + 6 * c.mtp_depth * c.vocab_size * c.n_embd
                   + 3 * sum(MECHANISMS[n].flops(c, seq_len or c.block_size) for n in names))

    def forward(self, idx, targets=None, cache: KVCache | None = None,
                return_attention: bool = False, attention_mask: torch.Tensor | None = None,
                token_types: torch.Tensor | None = None) -> Output:
        T = idx.shape[1]
        mask = self.mask_for(T, idx.device, cache, attention_mask)
        x = self.wte(idx)
        if self.config.embed_scale:          # Gemma: a small shared table, a unit-scale stream
            x = x * self.config.n_embd ** 0.5
        if self.token_types is not None:     # token, then segment, then position: BERT's order
            x = self.token_types(x, token_types)
        x = self.positions.embed(x, mask.q_start)
        if self.norm_emb is not None:
            x = self.norm_emb(x)
        x = self.drop(x)
        # gpt-oss and Gemma 3: a few layers see the whole context, the rest their window.
        whole = replace(mask, window=0, n_global=0) if self.config.full_attention_every else mask
        attentions, saved = [], []
        for i, block in enumerate(self.blocks):
            if self.skips is not None:
                x = self.skips.join(i, x, saved, self.skip_weights)
            value_embed = self.value_embeds[i](idx) if self.value_embeds is not None else None
            full = self.sees_everything(i)
            positions = self.positions if full or self.local_positions is None else self.local_positions
            x, weights = block(x, positions, whole if full else mask,
                               cache, return_attention and block.has_weights, value_embed)
            if self.skips is not None:
                self.skips.keep(i, x, saved)
            attentions.append(weights)
        if cache is not None:
            cache.end(T)
        h = self.norm_f(x) if self.norm_f is not None else x
        logits, loss = self.logits_and_loss(h, targets)
        if self.mtp is not None:     # a training pass leaves the tokens-ahead loss as aux_loss
            self.mtp.learn(self, h, idx, targets)
        return Output(logits, loss, attentions if return_attention else None, h)

    def sees_everything(self, layer: int) -> bool:
        """Layer `layer` of a windowed model with model.full_attention_every=N is one of the
        full ones: layers N-1, 2N-1, ... (transformers' layer_types for gpt-oss, Gemma 3)."""
        every = self.config.full_attention_every
        return bool(every) and (layer + 1) % every == 0

    def mask_for(self, T: int, device, cache: KVCache | None, attention_mask) -> Mask:
        mask = super().mask_for(T, device, cache, attention_mask)
        if self.config.full_attention_every and cache is not None and not cache.window:
            # The cache keeps every key for the full layers; the others still see their window.
            mask = replace(mask, window=self.config.sliding_window, n_global=self.config.n_global)
        return mask

    def logits_and_loss(self, h, targets=None):
        if self.adaptive is not None:        # scores only the targets while training
            return self.adaptive.logits_and_loss(h, targets)
        if self.lm_head is None:             # an encoder kept without a head: hidden states only
            if targets is not None:
                raise ModelError("this encoder has no output layer (model.readout=none), so "
                                 "there is no loss to take; give it a head to train it")
            return None, None
        if self.head_transform is not None:
            h = self.head_transform(h)
        logits = self.lm_head(h)
        if self.config.logit_softcap:
            # Soft-capping (Gemma 2): c·tanh(z/c) is z for small logits and never beyond ±c.
            cap = self.config.logit_softcap
            logits = cap * torch.tanh(logits / cap)
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-1)
