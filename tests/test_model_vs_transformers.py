"""Engine logits against Hugging Face transformers on random-weight Llama/Mistral/Qwen2 models."""

from __future__ import annotations

import pytest
import torch

from fluidserve.core.scheduler.output import ScheduledChunk, SchedulerOutput
from fluidserve.kernels import cpu_ops
from fluidserve.model.runner import ModelExecutor
from fluidserve.sampling_params import SamplingParams

from .conftest import ARCHS

BS = 16
GREEDY = SamplingParams(temperature=0.0)
CUDA = torch.cuda.is_available()
# (device, attention, linear): the compiled/prepacked CPU fast path, the Triton kernels (the
# CUDA fast path: compiled on a GPU, else through Triton's interpreter on the CPU) and the eager
# reference, on every device there is.
BACKENDS = [("cpu", "native", "packed"), ("cpu", "eager", "eager"),
            ("cuda" if CUDA else "cpu", "triton", "eager")] + ([("cuda", "eager", "eager")] if CUDA
                                                              else [])


def tiles_available() -> bool:
    ops = cpu_ops()
    return ops is not None and ops.tile_max_rows() > 0


def dot_panels_available() -> bool:
    ops = cpu_ops()
    return ops is not None and ops.dot_panels_built()


def hf_logits(model_dir, ids: list[int]) -> torch.Tensor:
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def chunk(rid: str, ids: list[int], start: int, n: int, table: list[int]) -> ScheduledChunk:
    return ScheduledChunk(
        rid,
        start,
        tuple(ids[start : start + n]),
        tuple(table),
        True,
        GREEDY,
        0,
        0,
        is_decode=n == 1 and start > 0,
    )


@pytest.mark.parametrize("backends", BACKENDS, ids=lambda b: "-".join(b))
@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_and_decode_logits_match_transformers(hf_models, arch, backends):
    device, attention, linear = backends
    ex = ModelExecutor(hf_models[arch], dtype="float32", device=device, num_blocks=64,
                       block_size=BS, attention_backend=attention, linear_backend=linear)
    assert ex.attention == attention
    g = torch.Generator().manual_seed(1)
    a = torch.randint(3, ex.arch.vocab_size, (45,), generator=g).tolist()
    b = torch.randint(3, ex.arch.vocab_size, (23,), generator=g).tolist()
    ref_a, ref_b = hf_logits(hf_models[arch], a), hf_logits(hf_models[arch], b)
    table_a, table_b = [7, 2, 30], [11, 5]  # scattered, as after frees
    # Request a: chunks of 13, 7, 1 (a single-token chunk), then more; b is prefilled whole and
    # then decodes alongside a's later chunks in the same flattened batch.
    plans = [
        [chunk("a", a, 0, 13, table_a)],
        [chunk("a", a, 13, 7, table_a), chunk("b", b, 0, 20, table_b)],
        [chunk("b", b, 20, 1, table_b), chunk("a", a, 20, 1, table_a)],
        [chunk("b", b, 21, 1, table_b), chunk("a", a, 21, 17, table_a)],
        [chunk("a", a, 38, 7, table_a), chunk("b", b, 22, 1, table_b)],
    ]
    with torch.inference_mode():
        for i, chunks in enumerate(plans):
            got = ex.logits(SchedulerOutput(i, chunks)).cpu()
            for row, c in enumerate(chunks):
                ref = (ref_a if c.request_id == "a" else ref_b)[c.context_len - 1]
                torch.testing.assert_close(
                    got[row],
                    ref,
                    atol=2e-4,
                    rtol=2e-4,
                    msg=f"{arch} iteration {i} request {c.request_id}",
                )


# Triton's interpreter cannot load bfloat16: without a GPU the Triton path is checked in
# float32 (above) and float16 (in test_triton_kernels.py). bf16 adds the linears on tile
# copies, where the CPU has a tile kernel: AMX tiles (the 35-token prompt is within their 64
# rows, so every linear runs on them) or the AVX2 or AVX-512 panels (every batch); the prompt
# is a long run, so attention takes the prefill kernel there. On a CPU whose oneDNN has no
# bf16 kernels, "packed" is oneDNN on weights widened to float32. On an AVX-512 CPU the
# panels multiply with float32 FMAs (tiles-fma) or, with AVX-512 BF16, the bf16 dot product
# (tiles-dot).
BF16_BACKENDS = [b for b in BACKENDS if b[1] != "triton" or b[0] == "cuda"] + [
    ("cpu", "native", "tiles-fma"), ("cpu", "native", "tiles-dot")]


@pytest.mark.parametrize("backends", BF16_BACKENDS, ids=lambda b: "-".join(b))
@pytest.mark.parametrize("arch", ARCHS)
def test_bfloat16_logits_close_to_transformers(hf_models, arch, backends):
    device, attention, linear = backends
    linear, _, product = linear.partition("-")
    if linear == "tiles" and not tiles_available():
        pytest.skip("no tile kernel here (needs AMX, AVX-512 or AVX2)")
    if product == "dot" and not dot_panels_available():
        pytest.skip("no dot-product panels here (needs AVX-512 BF16 without AMX)")
    ex = ModelExecutor(hf_models[arch], dtype="bfloat16", device=device, num_blocks=16,
                       block_size=BS, attention_backend=attention, linear_backend=linear,
                       panel_product=product or "auto")
    assert ex.worker.dot_panels == (product == "dot")
    if product:  # the prefill attention kernel (the 35-token prompt is a long run) too
        assert ex.worker.prefill_dot == (product == "dot")
    ids = list(range(5, 40))
    ref = hf_logits(hf_models[arch], ids)[-1]
    with torch.inference_mode():
        got = ex.logits(SchedulerOutput(0, [chunk("a", ids, 0, len(ids), [3, 0, 1])]))[0].cpu()
    assert ex.kv_caches[0][0].dtype == torch.bfloat16
    assert ex.worker.tile_linear == (linear == "tiles")
    # bf16 keeps ~3 significant digits; compare against the logit scale.
    assert (got - ref).abs().max() <= 0.05 * ref.abs().max()
    assert torch.corrcoef(torch.stack([got, ref]))[0, 1] > 0.999


def test_tied_embeddings_load(tmp_path, tokenizer_dir):
    from .conftest import make_hf_model

    d = make_hf_model("llama", tmp_path, 300, tied=True)
    eager = ModelExecutor(d, num_blocks=8, block_size=BS, linear_backend="eager")
    assert eager.model.lm_head.weight is eager.model.embed_tokens.weight
    ids = list(range(3, 20))
    for ex in (eager, ModelExecutor(d, num_blocks=8, block_size=BS, linear_backend="packed")):
        with torch.inference_mode():
            got = ex.logits(SchedulerOutput(0, [chunk("a", ids, 0, len(ids), [0, 1])]))[0]
        torch.testing.assert_close(got, hf_logits(d, ids)[-1], atol=2e-4, rtol=2e-4)


# head_dim 16, theta 1e4: RoPE wavelengths 6.3, 19.9, 62.8, 199, ... tokens. With an original
# context of 64 and low/high frequency factors 1/4, llama3 scaling keeps the first frequency,
# interpolates the next two and divides the rest by the factor: every branch is exercised.
ROPE_SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
}


@pytest.mark.parametrize("kind", sorted(ROPE_SCALINGS))
def test_rope_scaling_logits_match_transformers(tmp_path, kind):
    from .conftest import make_hf_model

    # (a copy: transformers writes its rope_theta into the dict it is given)
    d = make_hf_model("llama", tmp_path, 300, rope_scaling=dict(ROPE_SCALINGS[kind]))
    ex = ModelExecutor(d, num_blocks=64, block_size=BS)
    assert ex.arch.rope_scaling["rope_type"] == kind
    ids = torch.randint(3, 300, (200,), generator=torch.Generator().manual_seed(2)).tolist()
    ref = hf_logits(d, ids)
    table = list(range(50))
    # Positions well past the original context: a prefill in chunks, decodes, a last chunk.
    spans = [(0, 70), (70, 1), (71, 1), (72, 100), (172, 1), (173, 27)]
    with torch.inference_mode():
        for i, (start, n) in enumerate(spans):
            got = ex.logits(SchedulerOutput(i, [chunk("a", ids, start, n, table)]))[0]
            torch.testing.assert_close(got, ref[start + n - 1], atol=2e-4, rtol=2e-4,
                                       msg=f"{kind} scaling, chunk at {start}")


def test_rope_scaling_in_older_config_files_means_the_same():
    """Configs written before transformers 5 say rope_scaling / "type"; newer ones
    rope_parameters / "rope_type" with rope_theta inside."""
    import json

    from fluidserve.model.arch import parse_arch
    from fluidserve.model.llama import rope_inv_freq

    d = make_llama_config()
    for kind, scaling in ROPE_SCALINGS.items():
        old = d | {"rope_theta": 5e5, "rope_scaling": {"type" if k == "rope_type" else k: v
                                                       for k, v in scaling.items()}}
        new = d | {"rope_parameters": scaling | {"rope_theta": 5e5}}
        a, b = parse_arch(json.loads(json.dumps(old))), parse_arch(new)
        assert a.rope_scaling["rope_type"] == b.rope_scaling["rope_type"] == kind
        assert torch.equal(rope_inv_freq(a), rope_inv_freq(b))
        assert not torch.equal(rope_inv_freq(a), rope_inv_freq(parse_arch(d | {"rope_theta": 5e5})))


def make_llama_config() -> dict:
    return {"architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 64,
            "intermediate_size": 160, "num_hidden_layers": 2, "num_attention_heads": 4}
