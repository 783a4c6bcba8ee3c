"""The model's settings (`model.position: alibi`, `model.bias: false`) through the real sharded step
(zerolm.step.build_step): on dp 8 at ZeRO stages 1 and 3 and on dp 4 × tp 2, each steps like one device, for
each attention and layer loop that runs on CPU, with and without document masks; and each changes the
parameters it should (no position table; no biases)."""

import jax
import numpy as np
import pytest

from conftest import requires_devices, small_config
from test_zero_stages import assert_same, run
from zerolm import model as gpt_model
from zerolm.device_policy import for_device

pytestmark = requires_devices(8)


@pytest.mark.parametrize("sets", [
    ("model.position=alibi", "model.attention=xla", "model.scan_layers=true"),
    ("model.position=alibi", "model.bias=false", "model.attention=blockwise", "model.attention_block=8",
     "model.scan_layers=false", "model.document_mask=true", "model.eot_id=3"),
], ids=["alibi-xla-scan", "alibi-nobias-blockwise-unrolled-documents"])
def test_model_options_step_like_one_device_at_every_layout(sets):
    one = run(1, *sets, dp=1)
    assert_same(run(1, *sets), one, rtol=2e-5)
    assert_same(run(3, *sets), one, rtol=2e-5)
    assert_same(run(1, *sets, dp=4, tp=2), one, rtol=2e-5)


def test_alibi_has_no_position_table_and_no_bias_has_no_biases():
    def leaves(*sets):
        model = gpt_model.GPT(for_device(small_config(*sets).model))
        params = jax.eval_shape(lambda: gpt_model.init_params(model, jax.random.key(0)))
        return {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)}

    learned, alibi, no_bias = leaves(), leaves("model.position=alibi"), leaves("model.bias=false")
    assert "['wpe']" in learned and learned - alibi == {"['wpe']"}
    assert {k for k in learned - no_bias} == {k for k in learned if k.endswith("['bias']")} and len(learned - no_bias) == 7


def test_alibi_changes_the_function_and_learned_positions_do_not_matter_to_it():
    """The same weights: ALiBi's logits differ from learned positions', and do not read `wpe`."""
    cfg = small_config("model.position=alibi").model
    alibi = gpt_model.GPT(for_device(cfg))
    learned = gpt_model.GPT(for_device(small_config().model))
    params = gpt_model.init_params(learned, jax.random.key(0))
    tokens = np.random.default_rng(0).integers(0, 100, (2, 16))
    no_table = {k: v for k, v in params.items() if k != "wpe"}
    a = jax.jit(alibi.apply)({"params": no_table}, tokens)
    assert not np.allclose(a, jax.jit(learned.apply)({"params": params}, tokens), atol=1e-3)
    # causal: a prefix's logits do not depend on what follows it
    np.testing.assert_allclose(jax.jit(alibi.apply)({"params": no_table}, tokens[:, :8]), a[:, :8], rtol=1e-5,
                               atol=1e-5)
