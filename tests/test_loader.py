"""Model directories: sharded loading, the embedded model, and clear errors for bad input."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from fluidserve.model.arch import ModelLoadError
from fluidserve.model.builder import build_model_dir, cached_model_dir, race_model_dir
from fluidserve.model.loader import load_model


def test_sharded_and_single_file_load_identically(tmp_path):
    single = build_model_dir(tmp_path / "a", "tiny", seed=3)
    sharded = build_model_dir(tmp_path / "b", "tiny", seed=3, max_shard_bytes=1 << 20)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    _, m1 = load_model(single)
    _, m2 = load_model(sharded)
    for (n1, p1), (_, p2) in zip(m1.state_dict().items(), m2.state_dict().items(), strict=True):
        assert torch.equal(p1, p2), n1


def test_the_files_read_are_the_checkpoints_as_transformers_finds_them(tmp_path):
    from safetensors.torch import load_file, save_file

    def state(d):
        return load_model(d)[1].state_dict()

    fresh = state(build_model_dir(tmp_path / "fresh", "tiny", seed=4))
    # Rebuilt unsharded where a sharded build was: the old shards and index go.
    d = build_model_dir(tmp_path / "d", "tiny", seed=3, max_shard_bytes=1 << 20)
    index = (d / "model.safetensors.index.json").read_text()
    build_model_dir(d, "tiny", seed=4)
    assert list(d.glob("*.safetensors")) == [d / "model.safetensors"]
    assert all(torch.equal(t, fresh[k]) for k, t in state(d).items())
    # A stale index left beside a newer model.safetensors (save_pretrained leaves it): the
    # single file is the checkpoint, as transformers reads it.
    (d / "model.safetensors.index.json").write_text(index)
    assert all(torch.equal(t, fresh[k]) for k, t in state(d).items())
    (d / "model.safetensors.index.json").unlink()
    # One file of another name is the checkpoint; two files are ambiguous, not merged.
    (d / "model.safetensors").rename(d / "weights.safetensors")
    assert all(torch.equal(t, fresh[k]) for k, t in state(d).items())
    save_file(load_file(d / "weights.safetensors"), str(d / "weights_v0.safetensors"))
    with pytest.raises(ModelLoadError, match="several weight files.*index"):
        load_model(d)


def test_a_tied_checkpoint_may_hold_its_matrix_under_either_name(model_copy, caplog):
    from safetensors.torch import load_file, save_file

    _, ref = load_model(model_copy)
    weights = load_file(model_copy / "model.safetensors")
    embed = weights.pop("model.embed_tokens.weight")
    save_file(weights | {"lm_head.weight": embed}, str(model_copy / "model.safetensors"))
    _, m = load_model(model_copy)  # only the head: it is the embedding too
    assert all(torch.equal(t, ref.state_dict()[k]) for k, t in m.state_dict().items())
    save_file(weights | {"model.embed_tokens.weight": embed, "lm_head.weight": embed + 1},
              str(model_copy / "model.safetensors"))
    with caplog.at_level("WARNING"):
        _, m = load_model(model_copy)  # a head that differs: reported, the embedding used
    assert "lm_head.weight differs" in caplog.text
    assert all(torch.equal(t, ref.state_dict()[k]) for k, t in m.state_dict().items())


def test_a_missing_projection_is_named_with_its_checkpoint(model_copy):
    from safetensors.torch import load_file, save_file

    weights = load_file(model_copy / "model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, str(model_copy / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=rf"{model_copy}: incomplete fused weight"
                                             r" layers\.1\.self_attn\.qkv_proj\.weight: the"
                                             r" checkpoint has no \['k_proj'\]"):
        load_model(model_copy)


def test_a_config_without_architectures_goes_by_model_type(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    del cfg["architectures"]
    (model_copy / "config.json").write_text(json.dumps(cfg))
    assert load_model(model_copy)[0].architecture == "LlamaForCausalLM"


def test_embedded_model_is_deterministic(tmp_path, monkeypatch):
    monkeypatch.setenv("FLUIDSERVE_CACHE", str(tmp_path))
    d = cached_model_dir()
    assert d.parent.parent == tmp_path and cached_model_dir() == d
    again = build_model_dir(tmp_path / "again")
    assert (d / "model.safetensors").read_bytes() == (again / "model.safetensors").read_bytes()
    assert (d / "tokenizer.json").read_text() == (again / "tokenizer.json").read_text()


def test_the_race_model_is_built_once_in_bf16(tmp_path, monkeypatch):
    """The benchmarks' and the race's model: built where the cache is, in bf16, then found
    there (a leftover half-built directory from an interrupted build is replaced)."""
    monkeypatch.setenv("FLUIDSERVE_CACHE", str(tmp_path))
    (tmp_path / "models" / "race-tiny-bf16.tmp").mkdir(parents=True)
    d = race_model_dir("tiny")
    assert d == tmp_path / "models" / "race-tiny-bf16"
    assert json.loads((d / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert not d.with_suffix(".tmp").exists()
    stamp = (d / "config.json").stat().st_mtime_ns
    assert race_model_dir("tiny") == d and (d / "config.json").stat().st_mtime_ns == stamp


@pytest.fixture
def model_copy(tmp_path, tiny_model_dir):
    d = tmp_path / "m"
    shutil.copytree(tiny_model_dir, d)
    return d


def edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def test_missing_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_unsupported_architecture(model_copy):
    edit_config(model_copy, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel.*not supported"):
        load_model(model_copy)


def test_missing_config_field(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    del cfg["hidden_size"]
    (model_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="hidden_size"):
        load_model(model_copy)


def test_shape_mismatch_names_the_weight(model_copy):
    edit_config(model_copy, intermediate_size=123)
    with pytest.raises(ModelLoadError, match=r"mlp\.\w+\.weight has shape"):
        load_model(model_copy)


def test_no_safetensors(model_copy):
    (model_copy / "model.safetensors").rename(model_copy / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="only safetensors"):
        load_model(model_copy)


def test_corrupt_weights_and_config(model_copy):
    (model_copy / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelLoadError, match="cannot read"):
        load_model(model_copy)
    (model_copy / "config.json").write_text("{broken")
    with pytest.raises(ModelLoadError, match="invalid JSON"):
        load_model(model_copy)


def test_a_config_that_is_not_an_object_and_a_malformed_index_are_one_line(model_copy):
    (model_copy / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelLoadError, match="config.json: not a JSON object"):
        load_model(model_copy)


def test_integer_weights_are_refused_not_cast(model_copy):
    from safetensors.torch import load_file, save_file

    path = model_copy / "model.safetensors"
    weights = load_file(path)
    name = next(k for k in weights if k.endswith("embed_tokens.weight"))
    weights[name] = weights[name].to(torch.int8)
    save_file(weights, path)
    with pytest.raises(ModelLoadError, match="embed_tokens.weight is int8: quantized or integer"):
        load_model(model_copy)


def test_unsupported_rope_type(model_copy):
    edit_config(model_copy, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ModelLoadError, match="yarn"):
        load_model(model_copy)


@pytest.mark.parametrize("arch, changes, window, positions, biases", [
    # Mistral: a window of 4096 unless set (null: none), 131072 positions by default.
    ("MistralForCausalLM", {}, 4096, 131072, (False, False, False)),
    ("MistralForCausalLM", {"sliding_window": None}, None, 131072, (False, False, False)),
    # Keys the class does not read change nothing: no window for Llama, no optional biases
    # for Mistral or Qwen2.
    ("LlamaForCausalLM", {"sliding_window": 4096}, None, 2048, (False, False, False)),
    ("MistralForCausalLM", {"attention_bias": True, "mlp_bias": True}, 4096, 131072,
     (False, False, False)),
    ("LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True}, None, 2048,
     (True, True, True)),
    # Qwen2: q/k/v biases always; its window only on layers from max_window_layers on.
    ("Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 64}, None, 32768,
     (True, False, False)),
    ("Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 64,
                          "max_window_layers": 1}, 64, 32768, (True, False, False)),
    # ...or on the layers its layer_types says, where it has them (transformers 5).
    ("Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 64,
                          "layer_types": ["sliding_attention", "full_attention"]}, 64, 32768,
     (True, False, False)),
    ("Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1,
                          "layer_types": ["full_attention"] * 2}, None, 32768,
     (True, False, False)),
])
def test_config_fields_are_read_as_the_architectures_class_reads_them(arch, changes, window,
                                                                        positions, biases):
    from fluidserve.model.arch import parse_arch

    cfg = parse_arch({"architectures": [arch], "vocab_size": 10, "hidden_size": 8,
                      "intermediate_size": 16, "num_hidden_layers": 2,
                      "num_attention_heads": 2} | changes)
    assert cfg.sliding_window == window and cfg.max_position_embeddings == positions
    assert (cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias) == biases


@pytest.mark.parametrize("changes, theta, scaling", [
    # Where a config says it twice, the value transformers reads: a legacy rope_scaling over
    # rope_parameters, rope_parameters' theta over a top-level one, and for llama3 a
    # top-level original_max_position_embeddings over the one in the scaling.
    ({"rope_theta": 1e4, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},
     5e5, {"rope_type": "default"}),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
      "rope_scaling": {"type": "linear", "factor": 4.0}}, 1e4,
     {"rope_type": "linear", "factor": 4.0}),
    ({"original_max_position_embeddings": 512,
      "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                       "original_max_position_embeddings": 64}}, 1e4,
     {"rope_type": "llama3", "original_max_position_embeddings": 512}),
])
def test_rope_fields_given_twice_are_read_as_transformers_reads_them(changes, theta, scaling):
    from fluidserve.model.arch import parse_arch

    cfg = parse_arch({"architectures": ["LlamaForCausalLM"], "vocab_size": 10,
                      "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2,
                      "num_attention_heads": 2} | changes)
    assert cfg.rope_theta == theta
    assert cfg.rope_scaling.items() >= scaling.items(), cfg.rope_scaling


@pytest.mark.parametrize("changes, why", [
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
     "'llama3' needs original_max_position_embeddings"),
    ({"rope_scaling": {"rope_type": "linear"}}, "'linear' needs factor"),
    ({"max_position_embeddings": 0}, "max_position_embeddings must be >= 1"),
    ({"num_attention_heads": 0}, "num_attention_heads must be >= 1"),
    ({"num_key_value_heads": 3}, "heads do not share 3 key-value heads evenly"),
    ({"eos_token_id": "</s>"}, "eos_token_id '</s>' is not a token id"),
    ({"eos_token_id": [2, True]}, r"eos_token_id \[2, True\] is not a token id"),
    # Values of the wrong kind: one line naming the field, not a TypeError's traceback.
    ({"hidden_size": None}, "hidden_size must be an integer, got None"),
    ({"num_attention_heads": "abc"}, "num_attention_heads must be an integer, got 'abc'"),
    ({"max_position_embeddings": 1024.7}, "max_position_embeddings must be an integer"),
    ({"rms_norm_eps": "small"}, "rms_norm_eps must be a number"),
    ({"rope_scaling": "linear"}, "rope_scaling must be an object"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 0,
                       "original_max_position_embeddings": 8192}},
     "needs 0 < low_freq_factor < high_freq_factor"),
    # What it cannot run must not run as something else.
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5 is not supported"),
    ({"model_type": "mistral"}, "architectures names LlamaForCausalLM but model_type"
     " 'mistral' is MistralForCausalLM"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default"},
                          "sliding_attention": {"rope_type": "default"}}},
     "RoPE parameters per layer type"),
    ({"quantization_config": {"quant_method": "awq"}}, "quantized checkpoints are not"
     r" supported \(quantization_config: awq\)"),
])
def test_a_config_the_model_cannot_run_with_is_refused_before_loading(model_copy, changes,
                                                                       why):
    edit_config(model_copy, **changes)
    with pytest.raises(ModelLoadError, match=why):
        load_model(model_copy)


def test_dtype_auto_runs_the_checkpoint_in_its_own_dtype(tmp_path):
    """``--dtype auto`` (the default, as in vllm serve): the dtype config.json names; float16
    checkpoints run in bfloat16 on the CPU; float32 when the config names none."""
    import json

    import torch

    from fluidserve.config import EngineConfig
    from fluidserve.model.arch import read_arch
    from fluidserve.model.builder import build_model_dir
    from fluidserve.model.loader import resolve_dtype
    from fluidserve.model.runner import ModelExecutor

    assert EngineConfig.create(model="x").model.dtype == "auto"
    bf16 = build_model_dir(tmp_path / "bf16", "tiny", dtype="bfloat16")
    ex = ModelExecutor(str(bf16), num_blocks=8)
    assert next(ex.model.parameters()).dtype == torch.bfloat16
    assert ex.kv_caches[0][0].dtype == torch.bfloat16
    arch = read_arch(bf16)
    assert resolve_dtype("float32", arch) == "float32"  # an explicit choice wins
    cfg = json.loads((bf16 / "config.json").read_text())
    for named, want in (("float16", "bfloat16"), ("float32", "float32"), (None, "float32")):
        cfg["torch_dtype"] = named
        (bf16 / "config.json").write_text(json.dumps(cfg))
        assert resolve_dtype("auto", read_arch(bf16)) == want
    assert resolve_dtype("auto", read_arch(bf16), "cuda") == "float32"
    cfg["torch_dtype"] = "float16"
    (bf16 / "config.json").write_text(json.dumps(cfg))
    assert resolve_dtype("auto", read_arch(bf16), "cuda") == "float16"


def test_generic_tokenizers_load_as_autotokenizer_would_without_torch(hf_models,
                                                                      tiny_model_dir):
    """Generic fast tokenizers of llama models are loaded directly (no AutoTokenizer, whose
    config loading imports torch into the front end): the same class, ids, text, special
    tokens and chat template as AutoTokenizer gives. Others go through AutoTokenizer (for a
    qwen2 model it substitutes Qwen2Tokenizer, which adds a token)."""
    import subprocess
    import sys

    from transformers import AutoTokenizer

    from fluidserve.model.builder import default_model_dir
    from fluidserve.model.tokenizer import Tokenizer, loads_directly

    dirs = {"tiny": tiny_model_dir, "default": default_model_dir(), **hf_models}
    assert {n for n, d in dirs.items() if loads_directly(d)} == {"tiny", "default", "llama"}
    texts = ["Hello world", "  leading spaces,\ttabs\nand lines  ", "ünïcödé → 日本語 🚀",
             "</s><s> special <unk>", ""]
    for name, d in dirs.items():
        ours, ref = Tokenizer(d), AutoTokenizer.from_pretrained(str(d), local_files_only=True)
        assert type(ours.hf) is type(ref), name
        for text in texts:
            ids = ref.encode(text)
            assert ours.encode(text) == ids, (name, text)
            assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), (name, text)
        assert (ours.hf.bos_token_id, ours.eos_token_id, ours.hf.chat_template, len(ours)) \
            == (ref.bos_token_id, ref.eos_token_id, ref.chat_template, len(ref)), name
    code = ("import sys; from fluidserve.model.tokenizer import Tokenizer;"
            " Tokenizer(sys.argv[1]); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(tiny_model_dir)], check=True,
                         capture_output=True, text=True)
    assert out.stdout.strip() == "False", "loading the tokenizer imported torch"


def test_loading_a_model_does_not_import_dynamo(tiny_model_dir):
    """Building the model skeleton on the meta device once imported torch._dynamo (~3 s of
    every engine start) through two of PyTorch's Python decompositions; nothing in the
    engine uses it."""
    import subprocess
    import sys

    code = ("import sys; from fluidserve.model.loader import load_model;"
            " load_model(sys.argv[1]); print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(tiny_model_dir)], check=True,
                         capture_output=True, text=True)
    assert out.stdout.strip() == "False", "loading the model imported torch._dynamo"


def test_parameter_counts_match_the_checkpoint(tiny_model_dir):
    """num_params is every weight of the checkpoint; prefill_matmul_params the decoder
    layers' linears (the profile's prefill FLOP/s counts those)."""
    from safetensors import safe_open

    from fluidserve.model.arch import read_arch

    arch = read_arch(tiny_model_dir)
    sizes = {}
    for f in tiny_model_dir.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            sizes |= {k: st.get_slice(k).get_shape() for k in st.keys()}
    numel = {k: int(torch.Size(s).numel()) for k, s in sizes.items()}
    assert sum(numel.values()) == arch.num_params
    linears = sum(n for k, n in numel.items() if k.endswith("proj.weight"))
    assert linears == arch.prefill_matmul_params
