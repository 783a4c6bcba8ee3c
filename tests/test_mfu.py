"""MFU: the formula against a hand computation, per-device peaks, and the >100% warning."""

import warnings

import pytest

from zerolm.model.flops import flops_per_token
from zerolm.observe import mfu


def test_mfu_of_gpt3_small_on_an_h100_by_hand():
    # 125m without positions: wte 50304·768, then per layer c_attn 768·2304+2304, attn c_proj 768·768+768,
    # c_fc 768·3072+3072, mlp c_proj 3072·768+768, two LayerNorms 4·768; ln_f 2·768. L 12, d 768, T 2048.
    per_layer = (768 * 2304 + 2304) + (768 * 768 + 768) + (768 * 3072 + 3072) + (3072 * 768 + 768) + 4 * 768
    n = 50304 * 768 + 12 * per_layer + 2 * 768
    fpt = flops_per_token(n, 12, 768, 2048)
    assert n == 123_689_472 and fpt == 6 * 123_689_472 + 12 * 12 * 768 * 2048 == 968_629_248
    # 400,000 tokens/s on one H100 SXM: 400e3 × fpt / 989e12.
    assert mfu.mfu(400_000, fpt, "NVIDIA H100 80GB HBM3") == pytest.approx(400_000 * fpt / 989e12)
    assert mfu.peak_for("NVIDIA H100 PCIe").flops == 756e12
    # ... and that N is the 125m config's real count.
    import jax

    from conftest import REPO
    from zerolm.config.load import load_config
    from zerolm.model import decoder as gpt_model
    from zerolm.parallel.auto import for_device

    cfg = load_config(REPO / "configs" / "125m.yaml", ["model.vocab_size=50257"])
    model = gpt_model.GPT(for_device(cfg.model))
    abstract = jax.eval_shape(lambda k: gpt_model.init_params(model, k), jax.random.key(0))
    assert gpt_model.count_params(abstract, matmul_only=True) == n


def test_tpu_v3_peak_is_per_core_and_the_seed_notes_67_percent_warns():
    # The notes zerolm grew from claimed "67% MFU" on a v3-32, dividing by cores as if they were chips. Per core (a JAX
    # device on v3) the peak is 61.5 TFLOP/s; 82.4 TFLOP/s of model work per core is over 100%.
    assert mfu.peak_for("TPU v3").flops == 61.5e12
    with pytest.warns(UserWarning, match=r"MFU 134% exceeds 100% on TPU v3"):
        assert mfu.mfu(1.0, 82.4e12, "TPU v3") == pytest.approx(82.4 / 61.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert mfu.mfu(1.0, 41.2e12, "TPU v3") == pytest.approx(41.2 / 61.5)


def test_unknown_device_has_no_mfu():
    assert mfu.peak_for("cpu") is None and mfu.mfu(1e6, 1e9, "cpu") is None
    assert mfu.peak_for("TPU v5 lite").flops == 197e12 and mfu.peak_for("TPU v5p chip").flops == 459e12
