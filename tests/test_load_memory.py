"""Loading a transformers folder costs the weights once: the model is built without
random init (no draws to overwrite, on the meta device no torch._dynamo import), and the
tensors read from the mapped safetensors become the model's own instead of being copied
into a second set."""
import pytest
import torch
from torch.overrides import TorchFunctionMode

from engine.interop import load_hf_folder

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

VOCAB = 16384        # the embedding dominates, as in MiniLM: what a second copy would double


def _folder(kind, folder):
    from test_interop import gpt2_style_tokenizer
    from test_interop_bert import _tiny
    if kind == "bert":
        _tiny("bert", folder)                   # its tokenizer, then a larger model over it
        model = transformers.BertModel(transformers.BertConfig(
            vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=512, max_position_embeddings=64, pad_token_id=0))
        (folder / "model.safetensors").unlink()
    else:
        gpt2_style_tokenizer(folder)
        model = {"gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
                     vocab_size=VOCAB, n_positions=64, n_embd=128, n_layer=2, n_head=4)),
                 "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
                     vocab_size=VOCAB, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                     num_attention_heads=4, max_position_embeddings=64, tie_word_embeddings=True))}[kind]()
    model.save_pretrained(folder)
    return folder


class Draws(TorchFunctionMode):
    """Counts the random draws of an initialiser that reach it."""
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("normal_", "uniform_", "kaiming_uniform_", "trunc_normal_"):
            self.n += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module", params=["bert", "gpt2", "llama"])
def folder(request, tmp_path_factory):
    return _folder(request.param, tmp_path_factory.mktemp(request.param))


def test_a_loaded_folder_draws_no_random_init(folder):
    with Draws() as draws:
        model, _, _ = load_hf_folder(folder)
    assert draws.n == 0
    with Draws() as draws:              # the counter sees what a plain build draws
        torch.nn.Linear(2, 2)
    assert draws.n > 0


def _status(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def test_a_loaded_folder_holds_its_weights_about_once(folder):
    """The peak resident memory of the load, every weight read, stays near the file's
    size: the random-init model and a copy of every tensor would double it."""
    size = (folder / "model.safetensors").stat().st_size
    try:
        with open("/proc/self/clear_refs", "w") as f:     # resets the peak (VmHWM) to now
            f.write("5")
        before = _status("VmRSS")
    except (OSError, KeyError):
        pytest.skip("needs Linux's /proc/self/clear_refs to measure a peak")
    model, _, _ = load_hf_folder(folder)
    with torch.no_grad():
        for t in model.state_dict().values():
            t.sum()
    extra = _status("VmHWM") - before
    # GPT-2 stores its matrices transposed and Llama its q, k, v and gate, up apart: those
    # are rebuilt (a sixth of these files), everything else is used as mapped.
    print(f"{folder.name}: {extra / size:.2f}x")
    assert extra <= 1.3 * size + (4 << 20), f"{extra / 2**20:.1f} MiB for {size / 2**20:.1f} MiB of weights"


def test_training_a_loaded_folder_never_writes_into_its_file(folder):
    """The weights are the file's mapped pages, privately: a step that changes them in
    place (an optimizer's, a fine-tune's) must copy the pages, not change the download."""
    path = folder / "model.safetensors"
    before = path.read_bytes()
    model, _, _ = load_hf_folder(folder)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5).add_(1.0)
    del model
    assert path.read_bytes() == before
