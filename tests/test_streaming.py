"""Streaming past the context (model/cache.py, GPT.generate with `sinks`): a rolling
cache of the first tokens and the newest window, renumbered as it rolls (StreamingLLM,
arXiv:2309.17453). Its memory and its positions stay bounded however long it runs, and
right after it rolls a step gives the logits of a fresh pass over what it kept."""
import pytest
import torch

from model import GPT, ModelConfig
from model.decode import stream_cache
from model.positions import POSITION_ENCODINGS


def tiny(position: str, n_layer: int = 2, block_size: int = 32) -> GPT:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=40, block_size=block_size, n_layer=n_layer, n_head=2,
                      n_embd=16, position=position)
    return GPT(cfg).eval()


@pytest.mark.parametrize("position", POSITION_ENCODINGS)
def test_the_sink_cache_keeps_its_memory_and_positions_bounded_over_a_long_generation(position):
    model = tiny(position, block_size=24)
    window, sinks = 10, 4
    cache = stream_cache(model, window, sinks)
    ids = torch.randint(0, 40, (1, 8 * model.config.block_size))
    sizes, lengths = set(), []
    with torch.no_grad():
        for t in range(ids.shape[1]):
            model(ids[:, t:t + 1], cache=cache)
            sizes.add(cache.nbytes())
            lengths.append(cache.length)
    # One buffer of sinks + 2·window slots, allocated once; positions never pass it.
    assert sizes == {2 * 2 * (sinks + 2 * window) * 2 * 8 * 4}
    assert max(lengths) == sinks + 2 * window <= model.config.block_size
    assert cache.positions[:sinks].tolist() == list(range(sinks))
    if POSITION_ENCODINGS[position].absolute:
        return                       # its keys cannot be renumbered: generate refuses them
    # generate streams the same way: 8x the context.
    out = list(model.generate(ids[:, :3], 8 * model.config.block_size, sinks=sinks,
                              generator=torch.Generator().manual_seed(0)))
    assert len(out) == 8 * model.config.block_size


@pytest.mark.parametrize("position", [n for n, p in POSITION_ENCODINGS.items() if p.absolute])
def test_sinks_are_refused_for_absolute_positions_which_cannot_be_renumbered(position):
    """Learned and sinusoidal positions streamed past the context with no word, though a
    position added to the input is in every layer's keys, where no shift takes it back:
    after a roll the kept keys carry positions past the new query's. One line says so and
    what to do, from generate and from check_sinks alike (sample.py calls it first)."""
    from model.config import ModelError
    from model.decode import check_sinks
    model = tiny(position, block_size=24)
    ids = torch.randint(0, 40, (1, 3))
    for call in (lambda: next(model.generate(ids, 100, sinks=4)),
                 lambda: check_sinks(model.config, "cache", 4)):
        with pytest.raises(ModelError) as err:
            call()
        said = str(err.value)
        assert "\n" not in said and f"model.position={position} adds each token's absolute " \
            "position to its input, where it cannot be renumbered" in said
        assert "sample without sinks (--sinks=0)" in said


def test_the_sample_header_names_the_window_the_stream_keeps(monkeypatch):
    """sample.py's header says what streaming keeps past the context: the window the
    rolling cache is given, not a number of its own."""
    import sample
    from model import decode
    made = []
    real = decode.stream_cache
    monkeypatch.setattr(decode, "stream_cache", lambda m, w, s: made.append((w, s)) or real(m, w, s))
    model = tiny("rope", block_size=24)
    list(model.generate(torch.randint(0, 40, (1, 3)), 30, sinks=4))
    assert made == [(10, 4)]
    assert sample.streaming(model.config, 4) == (", past the context the first 4 tokens (sinks) "
                                                 "and the newest 10, renumbered")
    assert sample.streaming(model.config, 0) == ""


@pytest.mark.parametrize("position", ["rope", "alibi", "none"])
def test_right_after_rolling_a_step_equals_a_fresh_pass_over_the_kept_tokens(position):
    # One layer: its keys depend on each token and its position only, so after the cache
    # renumbers (keys turned back by the shift) they must be the keys of a fresh pass.
    model = tiny(position, n_layer=1)
    window, sinks = 8, 3
    cache = stream_cache(model, window, sinks)
    ids = torch.randint(0, 40, (1, 90))
    rolled = 0
    with torch.no_grad():
        for t in range(ids.shape[1]):
            before = cache.length
            step = model(ids[:, t:t + 1], cache=cache).logits[0, -1]
            if cache.length <= before:                      # it rolled before this token
                kept = torch.cat([ids[:, :sinks], ids[:, t - (window - 1):t + 1]], dim=1)
                fresh = model(kept).logits[0, -1]
                torch.testing.assert_close(step, fresh, atol=1e-5, rtol=1e-5)
                rolled += 1
    assert rolled >= 4


def test_sinks_and_forced_tokens_in_generate():
    model = tiny("rope")
    text = torch.randint(0, 40, (1, 200))
    seen = []
    tokens = list(model.generate(text[:, :1], 0, forced=text[:, 1:], sinks=4,
                                 on_step=lambda logits, token: seen.append(token)))
    assert torch.cat(tokens, 1).tolist() == text[:, 1:].tolist() == torch.cat(seen, 1).tolist()
    with pytest.raises(ValueError, match="sinks"):
        next(model.generate(text[:, :1], 5, sinks=4, use_cache=False))
    with pytest.raises(ValueError, match="sinks"):
        next(model.generate(text[:, :1], 5, sinks=32))


def test_the_streaming_bench_refuses_a_window_past_the_context_in_one_line(tmp_path, capsys):
    # sinks + 2·window positions must fit the trained context, or the rolling cache would
    # ask the model for positions it never saw; the check needs the model, so a tiny
    # transformers folder stands in for a run.
    import importlib.util
    import sys
    from pathlib import Path
    transformers = pytest.importorskip("transformers")
    from data.tokenizer import BPETokenizer
    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root / "bench"))       # as python runs it: bench/capability.py is found
    spec = importlib.util.spec_from_file_location("streaming_bench", root / "bench" / "streaming.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bpe = BPETokenizer.train(["to be or not to be, that is the question " * 20], 300)
    transformers.PreTrainedTokenizerFast(tokenizer_object=bpe.hf, eos_token="<|endoftext|>").save_pretrained(tmp_path)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=bpe.vocab_size, n_positions=32, n_embd=16, n_layer=1, n_head=2)).save_pretrained(tmp_path)
    (tmp_path / "a-file").write_text("")
    for argv, says in [(["--factor", "1"], "--factor must be at least 3"),
                       (["--factor", "2"], "--factor must be at least 3"),   # nothing past 2x
                       (["--window", "0"], "--window at least 1"),
                       (["--sinks", "100"], "give --sinks at most 30"),
                       (["--sinks", "4", "--window", "20"], "give --window at most 14"),
                       (["--out", str(tmp_path / "a-file")], "is a file, not a folder")]:
        with pytest.raises(SystemExit) as exit_:
            bench.main(["--run", str(tmp_path), "--out", str(tmp_path / "out"), *argv])
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_.value.code == 2 and err[-1].startswith("error: ") and says in err[-1], err
        assert sum(e.startswith("error") for e in err) == 1 and not (tmp_path / "out" / "streaming.md").exists()
