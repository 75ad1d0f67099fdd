"""Tiny random models, built from configs (no downloads), in pairs: stock sdpa and cascade, same weights;
the `gpu` and `multi_gpu` markers' skip; the cache keyword of this transformers version."""
from __future__ import annotations

import inspect
import pathlib
import sys

import pytest

import torch
from transformers import (AutoModelForCausalLM, LlamaConfig, LogitsProcessor, LogitsProcessorList, MistralConfig,
                          Qwen2Config)

import hf_cascade  # noqa: F401  registers "cascade"
from hf_cascade import generation

# tests live in folders that mirror the package (kv/, decode/, seq2seq/, kernels/); each folder is on the path, so
# that a test module imports another's helpers by name (from test_static_decode import ...) wherever it lives
for _folder in sorted(pathlib.Path(__file__).resolve().parent.iterdir()):
    if _folder.is_dir() and not _folder.name.startswith((".", "_")) and str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

VOCAB = 96


def pytest_configure(config):
    """One torch thread unless OMP_NUM_THREADS says otherwise: the tiny models of these tests run several times
    slower with a thread per core on a small, shared machine (the suite took 40 minutes on 2 cores that way)."""
    import os
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.gpu`` (or ``gpu(n)`` for n GPUs) skips a test where torch sees fewer CUDA devices; so does
    ``@pytest.mark.multi_gpu`` (``multi_gpu(n)``, default 2: the tests spread over the GPUs of one host)."""
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        needs = [int(marker.args[0]) if marker.args else default
                 for name, default in (("gpu", 1), ("multi_gpu", 2))
                 for marker in [item.get_closest_marker(name)] if marker is not None]
        if needs and have < max(needs):
            item.add_marker(pytest.mark.skip(reason=f"needs {max(needs)} CUDA GPU(s), torch sees {have}"))


def cache_kw(model, cache) -> dict:
    """``{"cache": cache}`` on transformers >= 5.24, ``{"past_key_values": cache}`` before (5.24 renamed it
    and warns about the old name), for ``generate`` and for a forward call."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: cache}


def returned_cache(out):
    """The cache ``generate(return_dict_in_generate=True)`` returned (``out.cache`` from 5.24, whose
    ``out.past_key_values`` warns; ``out.past_key_values`` before)."""
    return out.cache if "cache" in type(out).__dataclass_fields__ else out.past_key_values


def tiny_config(family: str, **overrides):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  pad_token_id=0, bos_token_id=1, eos_token_id=None)
    common.update(overrides)
    if family == "llama":
        return LlamaConfig(**common)
    if family == "mistral":
        return MistralConfig(**{"sliding_window": 4096, **common})
    if family == "qwen2":
        return Qwen2Config(**common)
    raise ValueError(family)


def model_pair(family: str, dtype=torch.float64, seed: int = 0, **overrides):
    """(stock sdpa model, cascade model) with identical random weights, in eval mode."""
    torch.manual_seed(seed)
    # each model gets its own config object: from_config writes the attention choice into it
    stock = AutoModelForCausalLM.from_config(tiny_config(family, **overrides), attn_implementation="sdpa",
                                             dtype=dtype).eval()
    cascade = AutoModelForCausalLM.from_config(tiny_config(family, **overrides), attn_implementation="cascade",
                                               dtype=dtype).eval()
    cascade.load_state_dict(stock.state_dict())
    assert stock.config._attn_implementation == "sdpa" and cascade.config._attn_implementation == "cascade"
    return stock, cascade


EOS = 3           # eos_llama's end-of-sequence token


@pytest.fixture(scope="module")
def eos_llama():
    """A tiny Llama whose eos logit is raised, so that rows and hypotheses end at different steps."""
    stock, cascade = model_pair("llama")
    with torch.no_grad():
        for model in (stock, cascade):
            model.lm_head.weight[EOS] += 0.35 * model.lm_head.weight.norm(dim=1).mean()
    return stock, cascade


def padded_batch(seed: int = 0, lengths=(23, 17)):
    """Two left-padded prompts of different lengths: (input_ids [2, L], attention_mask [2, L])."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(3, VOCAB, (len(lengths), width), generator=g)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        mask[row, width - n:] = 1
        ids[row, : width - n] = 0
    return ids, mask


class FirstForwardRows:
    """Counts the batch rows of forwards (a pre-hook, and generate's own prefill forwards, which run without the
    model's hooks) and keeps the cache each forward saw."""

    def __init__(self, model):
        self.rows, self.caches = [], []
        self.handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)
        self.prefill_handle = generation.register_prefill_hook(pre=lambda model, kwargs: self._hook(model, (), kwargs))

    def _hook(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.rows.append(ids.shape[0])
        self.caches.append(kwargs.get("cache", kwargs.get("past_key_values")))   # 5.24 renamed it

    def remove(self):
        self.handle.remove()
        self.prefill_handle.remove()


@pytest.fixture(autouse=True)
def cascade_on_tiny_prompts(monkeypatch):
    """The tests' prompts are far below the CPU threshold where sharing pays (generation.MIN_SHARED_TOKENS), so
    generate would run them on stock's path; keep them on the cascade (tests/test_parity.py tests the threshold)."""
    monkeypatch.setattr(generation, "MIN_SHARED_TOKENS", {})


@pytest.fixture(scope="module")
def llama_pair():
    return model_pair("llama")


class RunnerSpy:
    """Records the graph runners (hf_cascade.graphs.DecodeGraphRunner, or None) generate calls create."""

    def __init__(self, monkeypatch):
        from hf_cascade.session import DecodeSession
        self.runners = []
        real = DecodeSession.decode_runner

        def spy(*args, **kwargs):
            runner = real(*args, **kwargs)
            self.runners.append(runner)
            return runner

        monkeypatch.setattr(DecodeSession, "decode_runner", spy)


@pytest.fixture
def runner_spy(monkeypatch):
    return RunnerSpy(monkeypatch)


class KeepScores(LogitsProcessor):
    """A processor of the user's own that changes nothing: a call with one runs hf_cascade's decode loop with the
    token choice on the host (hf_cascade.host_select), the step's forward replayed as with the device chooser."""

    def __call__(self, input_ids, scores):
        return scores


def host_loop() -> dict:
    """generate's keyword arguments that put the token choice on the host (see KeepScores)."""
    return dict(logits_processor=LogitsProcessorList([KeepScores()]))


def plans_every_step(monkeypatch) -> None:
    """generate's decode steps planned anew each step, as a caller's own loop over a CascadeCache has them (no static
    decode layout: hf_cascade.cache.CascadeCache.begin_decode does nothing)."""
    from hf_cascade import CascadeCache
    monkeypatch.setattr(CascadeCache, "begin_decode", lambda self, max_length: None)


@pytest.fixture
def no_tf32():
    """float32 matmuls in full float32 (TF32 off) for the test, as they were after it."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def assert_replay_equals_eager(cascade, ids, mask, monkeypatch, **generate_kwargs) -> None:
    """Generate 32 tokens on the cuda kernels with the runner's eager static step, then with it captured and replayed
    (inside transformers' loop: :func:`host_loop`): both runners serve every decode step, and tokens and scores are
    bitwise the same."""
    spy = RunnerSpy(monkeypatch)
    outs = []
    for graphs in ("eager", True):
        outs.append(cascade.generate(input_ids=ids, attention_mask=mask, max_new_tokens=32,
                                     return_dict_in_generate=True, output_scores=True,
                                     hf_cascade_config=hf_cascade.CascadeConfig(backend="cuda", cuda_graphs=graphs),
                                     **host_loop(), **generate_kwargs))
    eager_run, graph_run = spy.runners
    assert eager_run.disabled is None and eager_run.replays >= 18, eager_run.disabled
    assert graph_run.disabled is None and graph_run.captures >= 1 and graph_run.replays >= 18, graph_run.disabled
    a, b = outs
    assert torch.equal(a.sequences, b.sequences)
    for sa, sb in zip(a.scores, b.scores):
        assert torch.equal(sa, sb)


def assert_captured_matches_stock(stock, cascade, ids, mask, monkeypatch, **generate_kwargs) -> None:
    """Generate 32 tokens with stock and with the cascade's captured decode steps inside transformers' loop
    (:func:`host_loop`; float32 with TF32 off: the ``no_tf32`` fixture): the same tokens, and the runner captured and
    replayed without refusing."""
    kw = dict(max_new_tokens=32, return_dict_in_generate=True, output_scores=True, **host_loop(), **generate_kwargs)
    want = stock.generate(input_ids=ids, attention_mask=mask, **kw)
    spy = RunnerSpy(monkeypatch)
    got = cascade.generate(input_ids=ids, attention_mask=mask, **kw)
    assert torch.equal(want.sequences, got.sequences)
    runner, = spy.runners
    assert runner.disabled is None and runner.captures >= 1 and runner.replays >= 18, \
        (runner.disabled, runner.captures, runner.replays)


# An emulation shim's CUDA runtime: the error codes and functions the launchers use, dim3 and the vector types (the
# test's shim declares its own blockIdx / threadIdx: thread_local where threads run at once)
RUNTIME_SHIM = r"""
typedef int cudaError_t;
typedef void* cudaStream_t;
enum { cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorInvalidConfiguration = 9 };
struct dim3 {
  unsigned x, y, z;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct uint4 { unsigned x, y, z, w; };
static cudaError_t cudaGetLastError() { return cudaSuccess; }
static const char* cudaGetErrorString(cudaError_t) { return "emulated error"; }
"""


# An emulation shim's CTA: the qualifiers, and __syncthreads / __syncthreads_count / __syncthreads_or over a
# std::barrier* emu_cta, a std::atomic<int> emu_count and a thread_local threadIdx that the test's shim declares first
CTA_SHIM = r"""
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

inline void __syncthreads() { emu_cta->arrive_and_wait(); }
inline int __syncthreads_count(int p) {
  __syncthreads();
  if (threadIdx.x == 0) emu_count = 0;
  __syncthreads();
  if (p) emu_count.fetch_add(1);
  __syncthreads();
  const int n = emu_count.load();
  __syncthreads();
  return n;
}
inline int __syncthreads_or(int p) { return __syncthreads_count(p) > 0; }
"""


def emulated_api(names) -> str:
    """csrc/api.cu's error functions (its first ``namespace hfc`` block) and its entries ``names`` (``HFC_API int
    name(...) {...}`` each, without the HFC_API), with hfc_error_string and hfc_last_error, for an emulation test's
    source: the C ABI as the library has it, over the test's shim (which defines cudaGetErrorString)."""
    api = (pathlib.Path(__file__).resolve().parents[1] / "csrc" / "api.cu").read_text(encoding="utf-8")
    errors_start = api.index("namespace hfc {")
    error_functions = api[errors_start:api.index("}  // namespace hfc\n", errors_start) + len("}  // namespace hfc\n")]
    entries = []
    for name in names:
        start = api.index(f"HFC_API int {name}(")
        entries.append(api[start:api.index("\n}\n", start) + 3][len("HFC_API "):])
    errors = """
const char* hfc_error_string(int err) { return cudaGetErrorString(err); }
const char* hfc_last_error(void) { return hfc::last_error(); }
"""
    return error_functions, 'extern "C" {\n' + "\n".join(entries) + errors + "\n}\n"


def emulated_binding(lib):
    """A cuda_binding._Lib on an emulated library ``lib`` (its methods and error check; the entry points' argtypes are
    the test's to declare)."""
    import ctypes
    from hf_cascade.kernels import cuda_binding
    lib.hfc_error_string.restype = lib.hfc_last_error.restype = ctypes.c_char_p
    lib.hfc_error_string.argtypes, lib.hfc_last_error.argtypes = [ctypes.c_int], []
    binding = object.__new__(cuda_binding._Lib)
    binding.lib = lib
    return binding


def host_library(out_dir, name: str, source: str, flags: list[str]):
    """``source`` (a kernel's own code over a shim of the CUDA built-ins, for the emulation tests) compiled with g++
    into ``out_dir/lib<name>.so`` and loaded with ctypes."""
    import ctypes
    import subprocess
    src = pathlib.Path(out_dir) / f"{name}_emulated.cpp"
    src.write_text(source, encoding="utf-8")
    lib = pathlib.Path(out_dir) / f"lib{name}.so"
    subprocess.run(["g++", *flags, "-O1", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    return ctypes.CDLL(str(lib))
