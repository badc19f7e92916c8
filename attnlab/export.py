"""Export a run to a folder that plain `transformers` loads.

    python -m attnlab.export --run runs/NAME --out exported/NAME
    python -c "from transformers import AutoModelForCausalLM, AutoTokenizer;
               m = AutoModelForCausalLM.from_pretrained('exported/NAME')"

The architecture is the one that computes exactly what the run's model does
(engine/interop.py): learned positions + LayerNorm + GELU -> GPT-2; RoPE + RMSNorm +
SwiGLU -> Llama (Mistral with a sliding window); RoPE + LayerNorm + GELU (the
default) -> GPT-NeoX with a sequential residual. A model none of them expresses (ALiBi,
global tokens, ...) is refused before any file is written, naming the fields that
stop it. The folder holds config.json, model.safetensors, the tokenizer (character
tokenizers too) and generation_config.json with the run's sampling settings.
"""
from __future__ import annotations

import sys

from attnlab.options import add_run_options, load, out_option
from engine.cli import Parser, errors_as_lines


def main(argv=None) -> int:
    parser = Parser("python -m attnlab.export", __doc__)
    add_run_options(parser)
    parser.add_argument("--out", type=out_option, required=True, help="the folder to write (new or empty)")
    args = parser.parse_args(argv)
    from engine.interop import export
    model, cfg, tokenizer, ckpt = load(args, log=print)
    s = cfg.sample
    generation = {"do_sample": s.temperature > 0, "max_new_tokens": s.max_new_tokens}
    if s.temperature > 0:
        generation.update(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p)
    arch = export(model, cfg.model, tokenizer, args.out, generation)
    print(f"wrote {args.out}: {arch.hf_class} ({arch.model_type}) from {ckpt}, "
          f"{model.num_params() / 1e6:.2f}M parameters")
    print(f"load it with: transformers.{arch.hf_class}.from_pretrained({args.out!r})")
    if cfg.model.tie_embeddings and not written_tied(args.out):
        # The class has its own lm_head (KimiLinearForCausalLM never ties): the shared
        # matrix is written in both places, so transformers counts it twice.
        print(f"the tied matrix is written twice, as the embedding and as {arch.hf_class}'s own "
              f"head: transformers counts {model.wte.weight.numel():,} parameters more, the logits "
              "are the same")
    if getattr(cfg.model, "mtp_depth", 0):
        # transformers' DeepSeek classes have no multi-token prediction module to load it into.
        print(f"not written: the multi-token prediction module (model.mtp_depth="
              f"{cfg.model.mtp_depth}); {arch.hf_class} has none, so the folder samples "
              "without --decode mtp")
    return 0


def written_tied(out) -> bool:
    """Does the written config.json tie the head to the embedding (transformers' default)?"""
    import json
    from pathlib import Path
    return json.loads((Path(out) / "config.json").read_text()).get("tie_word_embeddings", True)


if __name__ == "__main__":
    with errors_as_lines():
        sys.exit(main())
