"""Checks every card's bridge makes the same way (tests/test_qwen3_next.py,
tests/test_kimi_linear.py): transformers untouched against ours in float32, both ways, and
an imported model's cached decoding against its full pass."""
import torch
import transformers

from engine.interop import export, load_hf_folder


def agrees_untouched_in_float32(hf_folder, out, batch, hf_class: str) -> None:
    """No copy, no patch: transformers' class as it runs, and ours, in float32; then ours
    exported and loaded back by transformers."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_folder).eval()
    ours, cfg, tokenizer = load_hf_folder(hf_folder)
    with torch.no_grad():
        torch.testing.assert_close(ours(batch).logits, hf(batch).logits, atol=5e-5, rtol=0)
    export(ours, cfg, tokenizer, out)
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back).__name__ == hf_class
    with torch.no_grad():
        torch.testing.assert_close(back(batch).logits, ours(batch).logits, atol=5e-5, rtol=0)


def decodes_as_its_full_pass(hf_folder, batch) -> None:
    """The imported model's logits from its cache (a chunk of 5, then a token at a time)
    equal its full pass's, in float64."""
    ours, _, _ = load_hf_folder(hf_folder, dtype=torch.float64)
    with torch.no_grad():
        full = ours(batch).logits
        cache = ours.new_cache(batch.shape[1])
        steps = [ours(batch[:, :5], cache=cache).logits]
        steps += [ours(batch[:, t:t + 1], cache=cache).logits for t in range(5, batch.shape[1])]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-10, rtol=0)
