"""Staged context (train.context_stages, train.context_rows; zerolm.data.context): how a sample is cut, which
context a step trains at and the tokens it counts; a staged run through the real sharded step like one device
for every position scheme, attention and layer loop that runs on CPU; the run's header, tokens and a kill -9
inside a stage resumed bit-identically."""

import json

import jax
import numpy as np
import pytest

import runs
from conftest import requires_devices, small_config, small_step
from helpers import to_accum_layout
from test_zero_stages import assert_same
from zerolm.config.load import load_config
from zerolm.config.section import ConfigError
from zerolm.data.context import ContextPlan

STAGES = [(2, 8), (1, 4)]  # a model.seq_len of 16: two steps at 8 tokens, one at 4, then 16
STEPPED = [(1, 8), (1, 4)]  # the sharded runs: one step at each context


def test_a_step_trains_at_its_stages_context_and_counts_its_tokens():
    plan = ContextPlan(STAGES, "split", 16)
    assert [(c.seq_len, c.rows, c.first, c.last) for c in plan.contexts] == [(8, 2, 1, 2), (4, 4, 3, 3), (16, 1, 4, None)]
    assert [plan.at(s).seq_len for s in range(1, 7)] == [8, 8, 4, 16, 16, 16]
    assert plan.tokens_seen(5, 10) == 5 * 10 * 16  # split: every token of every sample, at any context
    truncated = ContextPlan(STAGES, "truncate", 16)
    assert truncated.tokens_seen(5, 10) == 10 * (8 + 8 + 4 + 16 + 16)
    assert not ContextPlan([], "split", 16).staged and ContextPlan.of(small_config().train, 16).contexts[0].seq_len == 16


def test_split_cuts_every_token_into_rows_that_chain_and_truncate_keeps_the_head():
    rows = np.arange(2 * 3 * 17).reshape(2, 3, 17)  # (accum, micro, T + 1), T = 16
    split = ContextPlan(STAGES, "split", 16)
    eights = split.cut(rows, split.at(1))
    assert eights.shape == (2, 6, 9)
    np.testing.assert_array_equal(eights[0, 0], rows[0, 0, :9])
    np.testing.assert_array_equal(eights[0, 1], rows[0, 0, 8:17])  # its first input is the row before's last target
    np.testing.assert_array_equal(eights[1, 5], rows[1, 2, 8:17])
    # Every (input, target) pair of a sample is trained exactly once: the rows' pairs are the sample's.
    pairs = {(int(a), int(b)) for row in eights[0, :2] for a, b in zip(row[:-1], row[1:], strict=True)}
    assert pairs == {(int(a), int(b)) for a, b in zip(rows[0, 0, :-1], rows[0, 0, 1:], strict=True)}
    truncate = ContextPlan(STAGES, "truncate", 16)
    np.testing.assert_array_equal(truncate.cut(rows, truncate.at(3)), rows[..., :5])
    assert split.cut(rows, split.at(4)) is rows


@pytest.mark.parametrize("stages, rows, message", [
    ("[{steps: 2, seq_len: 16}]", "split",
     "train.context_stages.0.seq_len: 16 is not shorter than model.seq_len=16: a stage trains at a shorter context"),
    ("[{steps: 2, seq_len: 8}, {steps: 1, seq_len: 6}]", "split",
     "train.context_stages.1.seq_len: 6 does not divide model.seq_len=16: train.context_rows split cuts each sample"),
    ("[{steps: 0, seq_len: 8}]", "split", "train.context_stages.0.steps: Input should be greater than 0"),
])
def test_a_stage_that_cannot_be_trained_is_refused_naming_its_key(stages, rows, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")):
        small_config(f"train.context_stages={stages}", f"train.context_rows={rows}")
    assert load_config  # (the same check at load_config's every caller: it is the config's own)


def staged_run(*sets: str, dp: int = 8, tp: int = 1, mode: str = "split"):
    """Three AdamW steps, one at each of STEPPED's contexts (8, 4, then 16 tokens), from the same init and data:
    (losses, parameters as numpy, the last state), each step's rows cut as the loader cuts them."""
    cfg, _, zero, init_fn = small_step("train.global_batch_size=16", "train.micro_batch_size=1", *sets, dp=dp, tp=tp)
    plan = ContextPlan(STEPPED, mode, cfg.model.seq_len)
    state = zero.init(init_fn, jax.random.key(0))
    rng = np.random.default_rng(0)
    A, M, T1 = cfg.accum_steps, cfg.train.micro_batch_size, cfg.model.seq_len + 1
    losses = []
    for step in range(1, 4):
        rows = rng.integers(0, cfg.model.vocab_size, (dp * A * M, T1)).astype(np.int32)
        batch = plan.cut(to_accum_layout(rows, dp, A, M), plan.at(step))
        state, metrics = zero.step(state, jax.device_put(batch, zero.table.batch_sharding))
        losses.append(float(metrics["loss"]))
    return losses, [np.asarray(x, np.float32) for x in jax.tree.leaves(jax.device_get(state.params))], state


@pytest.mark.slow  # a sweep of the sharded step (or training runs) over layouts: the whole suite's, not the unit tier's
@requires_devices(8)
@pytest.mark.parametrize("sets, layouts, mode", [
    # learned positions below their table's length: ZeRO-3 on dp 8 and ZeRO-1 on dp 4 × tp 2
    (("model.attention=xla", "model.scan_layers=true"), (("zero.stage=3",), ("mesh.tp=2",)), "split"),
    (("model.position=alibi", "model.attention=blockwise", "model.attention_block=4", "model.scan_layers=false",
      "model.remat=full"), (("zero.stage=3",),), "truncate"),
    (("model.position=rope", "model.attention=xla", "model.scan_layers=false", "model.document_mask=true",
      "model.eot_id=3", "model.document_positions=restart"), (("mesh.tp=2",),), "split"),
], ids=["learned-xla-scan", "alibi-blockwise-unrolled-remat-truncate", "rope-xla-unrolled-documents"])
def test_a_staged_run_steps_like_one_device_on_every_layout(sets, layouts, mode):
    """Each context's shapes (each its own program) through the sharded step against one device: every position
    scheme, both attentions that run on CPU, both layer loops, ZeRO stages 1 and 3, tp, both ways to cut."""
    one = staged_run(*sets, dp=1, mode=mode)
    for layout in layouts:
        tp = 2 if "mesh.tp=2" in layout else 1
        assert_same(staged_run(*sets, *(s for s in layout if not s.startswith("mesh")), dp=8 // tp, tp=tp, mode=mode),
                    one, rtol=2e-5)


STAGED = ["train.context_stages=[{steps: 6, seq_len: 8}]", "train.warmup_steps=2"]


@pytest.mark.slow
def test_a_staged_run_says_its_stages_counts_its_tokens_and_resumes_exactly_inside_a_stage(tmp_path):
    """SMALL (seq_len 32, 16 sequences a step) with its first 6 steps at 8 tokens split into rows: the header's
    line per stage, every step's tokens (split: the same per step), and a kill -9 at step 5, inside the stage,
    resumed to the uninterrupted run's losses exactly (checkpoint 4 is inside the stage too)."""
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    proc = runs.train(straight, *STAGED)
    assert ("context stage 1: steps 1-6 at 8 tokens (train.context_rows split: 4 rows of each sample; 512 tokens per "
            "step)") in proc.stdout and "context: model.seq_len 32 from step 7" in proc.stdout
    records = [json.loads(line) for line in (straight / "log" / "metrics.jsonl").read_text().splitlines()]
    assert [r["tokens_seen"] for r in records if "loss" in r] == [512 * s for s in range(1, 17)]
    runs.kill_9_after(killed, *STAGED, before_step=5)
    runs.train(killed, *STAGED)
    assert runs.losses(killed) == runs.losses(straight)


@pytest.mark.slow
def test_a_truncated_stage_counts_the_tokens_it_trains(tmp_path):
    runs.train(tmp_path, *STAGED, "train.context_rows=truncate", steps=8)
    records = [json.loads(line) for line in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    assert [r["tokens_seen"] for r in records if "loss" in r] == [16 * 8 * s for s in range(1, 7)] + [768 + 512, 768 + 1024]
