"""What runs only where it can: the adapter on a CUDA device (DLPack views,
the current stream), and Hugging Face's transformers.LlamaForCausalLM (the GPU
machine has transformers; Debian 12 has not). Skipped elsewhere, saying why."""
import pytest
import torch

import helpers
import llama
import strata
import strata.torch

try:
    import transformers
except ImportError:
    transformers = None

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible to torch")
hf = pytest.mark.skipif(transformers is None, reason="transformers is not installed (pip install transformers)")


def cuda_config(swap_dir, placement, precision, **kw):
    c = helpers.config(swap_dir, placement, precision, **kw)
    c["strata"]["device"] = "cuda"
    return c


@cuda
@pytest.mark.parametrize("placement", list(helpers.PLACEMENTS))
def test_cuda_fp32_matches_torch_adamw(placement, swap_dir):
    steps, gas, clip, lr = 10, 2, 0.5, 3e-3
    data = [b.cuda() for b in helpers.batches(steps * gas)]
    ref = helpers.tiny_llama().cuda()
    want, _ = helpers.train_torch(ref, data, steps, gas, lr=lr, clip=clip)
    model = helpers.tiny_llama()
    engine = strata.torch.initialize(model, cuda_config(swap_dir, placement, "fp32", gas=gas, clip=clip, lr=lr))
    assert engine.device == "cuda" and model.lm_head.weight.device.type == "cuda"
    got = helpers.train_strata(engine, model, data, steps, gas)
    for a, b in zip(got, want):
        # cuBLAS may pick other kernels for the two models: a looser bound than on the CPU.
        assert a == pytest.approx(b, rel=1e-4)
    engine.close()


@cuda
def test_cuda_bf16_bit_identical_across_placements(tmp_path):
    results = {}
    for placement in helpers.PLACEMENTS:
        swap = tmp_path / placement
        swap.mkdir()
        model = helpers.tiny_llama()
        engine = strata.torch.initialize(model, cuda_config(str(swap), placement, "bf16", gas=2, clip=0.5))
        losses = helpers.train_strata(engine, model, [b.cuda() for b in helpers.batches(16)], 8, 2)
        results[placement] = (losses, engine.state_dict())
        engine.close()
    base = results["optimizer_device"]
    for placement, (losses, w) in results.items():
        assert losses == base[0], placement
        helpers.assert_same_bits(w, base[1], placement)


def hf_twin(seed=0):
    ours = helpers.tiny_llama(seed=seed)
    c = ours.config
    cfg = transformers.LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                                   intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
                                   num_attention_heads=c.num_attention_heads,
                                   num_key_value_heads=c.num_key_value_heads, rms_norm_eps=c.rms_norm_eps,
                                   rope_theta=c.rope_theta, tie_word_embeddings=False, attention_bias=False)
    theirs = transformers.LlamaForCausalLM(cfg)
    missing, unexpected = theirs.load_state_dict(ours.state_dict(), strict=False)
    assert not unexpected and all("rotary" in m for m in missing)
    return ours, theirs


@hf
def test_the_example_llama_is_hugging_faces(tmp_path):
    ours, theirs = hf_twin()
    x = helpers.batches(1)[0]
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(input_ids=x).logits, rtol=1e-4, atol=1e-5)


@hf
def test_hugging_face_llama_trains_through_the_adapter(swap_dir):
    ours, theirs = hf_twin()
    engine = strata.torch.initialize(theirs, helpers.config(swap_dir, lr=3e-3))
    losses = helpers.train_hf(engine, theirs, helpers.batches(8))
    assert losses[-1] < losses[0]
    assert set(engine.state_dict()) >= {n for n, _ in ours.named_parameters()}
    engine.close()
