"""model.document_mask: attention stays inside each document of a packed sample, in every attention (XLA's,
the blockwise one, Pallas's under its TPU interpreter), so a packed sample's per-token losses and their
gradients are each document's computed alone."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from conftest import small_config, small_model
from zerolm.model import decoder as gpt_model
from zerolm.model.attention import Bias, causal_attention
from zerolm.model.losses import token_losses
from zerolm.plan.activations import step_activation_bytes

EOT = 3
LENGTHS = (21, 30, 13)  # three documents (each ending with EOT) and the start of a fourth: 64 + 1 tokens


def _packed(seed=0, vocab=128):
    """One packed sample of 65 tokens, and where each of its documents starts."""
    rng = np.random.default_rng(seed)
    docs = [np.append(rng.integers(4, vocab, n - 1), EOT) for n in LENGTHS]
    rest = rng.integers(4, vocab, 65 - sum(LENGTHS))
    return np.concatenate([*docs, rest]).astype(np.int32), np.cumsum((0, *LENGTHS))


def test_segments_and_restarted_positions():
    tokens = jnp.array([[5, 6, EOT, 7, EOT, EOT, 8, 9]])
    seg, pos = gpt_model.documents(tokens, EOT, restart=True)
    assert seg.tolist() == [[0, 0, 0, 1, 1, 2, 3, 3]]  # an end-of-text belongs to the document it ends
    assert pos.tolist() == [[0, 1, 2, 0, 1, 0, 0, 1]]
    assert gpt_model.documents(tokens, EOT, restart=False)[1].tolist() == [list(range(8))]


@pytest.mark.parametrize("attention", ["xla", "blockwise"])
def test_a_packed_samples_losses_and_gradients_are_each_documents_alone(attention):
    cfg = small_config("model.seq_len=64", "model.vocab_size=128", "model.n_layer=2", "model.d_model=64",
                       "model.n_head=4", f"model.attention={attention}", "model.attention_block=16",
                       "model.loss_chunk=0", "model.document_mask=true", "model.document_positions=restart",
                       f"model.eot_id={EOT}")
    model, init_fn, _, _ = small_model(cfg.model)
    params = init_fn(jax.random.key(0))
    sample, starts = _packed()
    losses = lambda p, rows: token_losses(model, p, rows)  # noqa: E731
    packed = losses(params, jnp.array(sample[None]))[0]
    total = jax.grad(lambda p: jnp.sum(losses(p, jnp.array(sample[None]))[0][:starts[-1]]))(params)
    alone_grads = []
    for a, b in zip(starts[:-1], starts[1:], strict=True):
        # The document alone at the start of a sample (with the next token as its last target), the rest
        # of the sample anything: the causal mask keeps the document from seeing it.
        alone = np.full(65, 9, np.int32)
        alone[: b - a + 1] = sample[a: b + 1]
        got = losses(params, jnp.array(alone[None]))[0][: b - a]
        np.testing.assert_allclose(packed[a:b], got, rtol=2e-5, atol=2e-5)
        rows = jnp.array(alone[None])
        alone_grads.append(jax.grad(lambda p, rows=rows, n=b - a: jnp.sum(losses(p, rows)[0][:n]))(params))
    summed = jax.tree.map(lambda *g: sum(g), *alone_grads)
    for x, y in zip(jax.tree.leaves(total), jax.tree.leaves(summed), strict=True):
        np.testing.assert_allclose(x, y, rtol=2e-4, atol=2e-6)
    # The control: without the mask the later documents see the earlier ones.
    plain = gpt_model.GPT(model.cfg.model_copy(update={"document_mask": False}))
    unmasked = token_losses(plain, params, jnp.array(sample[None]))[0]
    assert not np.allclose(unmasked[starts[1]:starts[3]], packed[starts[1]:starts[3]], atol=1e-3)


def _qkv_segments(T=256):
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v = (jax.random.normal(kk, (2, T, 2, 64), jnp.float32) for kk in keys[:3])
    cuts = np.sort(np.random.default_rng(1).choice(np.arange(1, T), 6, replace=False))
    seg = np.zeros((2, T), np.int32)
    for c in cuts:
        seg[0, c:] += 1
    seg[1, T // 3:] = 1  # a document crossing whole blocks
    return q, k, v, jnp.array(seg), jax.random.normal(keys[3], q.shape)


def _masked_xla(q, k, v, seg):
    same = seg[:, None, :, None] == seg[:, None, None, :]
    return jax.nn.dot_product_attention(q, k, v, mask=same, is_causal=True, implementation="xla")


@pytest.mark.parametrize("impl", ["blockwise", "pallas"])
def test_every_attention_takes_the_segment_ids(impl):
    """Outputs and gradients as XLA's with the segment mask; Pallas's kernel by its TPU interpreter, inside a
    dp shard_map as the step runs it."""
    from jax.experimental.pallas import tpu as pltpu

    q, k, v, seg, w = _qkv_segments()
    mesh = jax.make_mesh((2,), ("dp",), axis_types=(jax.sharding.AxisType.Explicit,), devices=jax.devices()[:2])

    def step(fn):
        def body(q, k, v, seg, w):
            def f(q, k, v):
                y = fn(q, k, v, seg)
                return jnp.sum(y * w), y
            (_, y), g = jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(q, k, v)
            return y, g
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("dp"),) * 5, out_specs=(P("dp"), (P("dp"),) * 3)))
        return f(*(jax.device_put(x, NamedSharding(mesh, P("dp"))) for x in (q, k, v, seg, w)))

    with pltpu.force_tpu_interpret_mode():
        y, g = step(lambda q, k, v, seg: causal_attention(q, k, v, impl, 128, Bias(seg)))
    y_x, g_x = step(_masked_xla)
    np.testing.assert_allclose(y, y_x, rtol=1e-5, atol=1e-5)
    for a, b in zip(g, g_x, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("impl", ["xla", "blockwise", "cudnn"])
def test_each_attention_masks_documents_in_bfloat16_within_its_precision(impl):
    """On bfloat16 inputs, as a run feeds them, each attention's masked output and gradients stay within 2% (of the
    largest value) of XLA's masked attention in float32 on the same inputs. On an H100 cuDNN's kept within 0.4%
    (BENCHMARKS.md, "Document-masked packing", by benchmarks/experiments/attention_mask.py, which also times them)."""
    if impl == "cudnn" and jax.devices()[0].platform not in ("gpu", "cuda"):
        pytest.skip("cuDNN's attention runs on an NVIDIA GPU only")
    q, k, v, seg, w = _qkv_segments()

    def grads(fn, q, k, v):
        def f(q, k, v):
            y = fn(q, k, v)
            return jnp.sum(y.astype(jnp.float32) * w), y
        (_, y), g = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(q, k, v)
        return [np.asarray(x, np.float32) for x in (y, *g)]

    reference = grads(lambda q, k, v: _masked_xla(q, k, v, seg), q, k, v)
    half = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    got = grads(lambda q, k, v: causal_attention(q, k, v, impl, 128, Bias(seg)), *half)
    unmasked = grads(lambda q, k, v: causal_attention(q, k, v, impl, 128, Bias(None)), *half)
    errors = [float(np.max(np.abs(a - b)) / np.max(np.abs(b))) for a, b in zip(got, reference, strict=True)]
    assert max(errors) < 0.02, errors  # out, dq, dk, dv
    assert max(float(np.max(np.abs(a - b)) / np.max(np.abs(b))) for a, b in zip(unmasked, reference, strict=True)) > 0.1


def test_the_planner_counts_the_segment_ids():
    cfg = small_config("model.document_mask=true", f"model.eot_id={EOT}")
    from zerolm.parallel.auto import Where
    from zerolm.plan.build import from_config

    model, _ = from_config(cfg, 8, 1)
    plain = model.__class__(**{**model.__dict__, "document_mask": False})
    s, b, L = model.seq_len, 2, model.n_layer if model.remat == "none" else 1  # full remat: one layer's
    e = model.act_bytes
    for attention, extra in (("blockwise", L * s * b * 4), ("xla", L * (s * b * 4 + s * s * b)),
                             ("cudnn", L * s * b * 4 + s * s * b * e)):
        masked = step_activation_bytes(model, b, attention, 2, Where("tpu"))
        assert masked - step_activation_bytes(plain, b, attention, 2, Where("tpu")) == extra


@pytest.mark.slow
def test_document_masked_training_resumes_exactly_after_kill_9(tmp_path):
    """The masked model trains (its header says so) and resumes bit for bit, as the plain one does."""
    import runs

    sets = ["model.document_mask=true", "model.document_positions=restart"]
    straight = runs.train(tmp_path / "straight", *sets)
    assert "documents: attention stays inside each document of a sample (end-of-text 0), positions restart " \
           "per document" in straight.stdout
    reference = runs.losses(tmp_path / "straight")
    killed = tmp_path / "killed"
    runs.kill_9_after(killed, *sets)
    runs.train(killed, *sets)
    assert runs.losses(killed) == reference
    runs.train(tmp_path / "plain")
    assert runs.losses(tmp_path / "plain") != reference  # the mask changes what the model computes


@pytest.mark.slow
@pytest.mark.parametrize("attention, dp", [("xla", 8), ("blockwise", 1), ("blockwise", 8)])
def test_document_masking_through_the_zero1_step_equals_xlas_masked_attention(attention, dp):
    """The mask where it runs: inside the real ZeRO-1 step (its shard_map over dp, the layers in a scan and
    unrolled), the loss and the gradient norm on `dp` devices are XLA's masked attention's on one device."""
    from conftest import small_step
    from helpers import to_accum_layout

    sets = ["model.seq_len=64", "model.vocab_size=128", f"model.attention={attention}", "model.attention_block=16",
            "model.document_mask=true", "model.document_positions=restart", f"model.eot_id={EOT}",
            "train.global_batch_size=16", "train.micro_batch_size=1"]
    rows = np.stack([_packed(seed)[0] for seed in range(16)])
    reference = small_config(*[s for s in sets if not s.startswith("model.attention=")], "model.attention=xla")
    model, init_fn, loss_fn, _ = small_model(reference.model)
    params = init_fn(jax.random.key(0))
    grads = jax.grad(loss_fn)(params, jnp.asarray(rows))
    for scan in ("true", "false"):
        cfg, _, zero, _ = small_step(*sets, f"model.scan_layers={scan}", dp=dp)
        state = zero.init_from_params(params)
        batch = jax.device_put(to_accum_layout(rows, dp, 16 // dp, 1), zero.table.batch_sharding)
        state, metrics = zero(state, batch)
        assert float(metrics["loss"]) == pytest.approx(float(loss_fn(params, jnp.asarray(rows))), rel=1e-5)
        np.testing.assert_allclose(np.asarray(metrics["grad_norm"]),
                                   float(jnp.sqrt(sum(jnp.sum(g ** 2) for g in jax.tree.leaves(grads)))), rtol=1e-4)
