"""Bad configs fail at load with one line naming the file and the key."""

import subprocess
import sys
from pathlib import Path

import pydantic
import pytest

from conftest import REPO, TINY
from zerolm.config.load import load_config
from zerolm.config.section import ConfigError
from zerolm.config.tree import Config


def _error(path, overrides=(), device_count=8) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(path, list(overrides), device_count=device_count)
    message = str(e.value)
    assert "\n" not in message
    return message


def test_every_shipped_config_loads():
    for path in sorted((REPO / "configs").glob("*.yaml")):
        cfg = load_config(path, ["train.micro_batch_size=1"], device_count=8)
        assert cfg.dp == 8 and cfg.accum_steps >= 1


def test_the_package_ships_configs_defaults_yaml_itself():
    """zerolm.config.tree.DEFAULTS (what import-hf loads wherever it runs) is configs/defaults.yaml, not a copy that
    could drift from it."""
    from zerolm.config.load import DEFAULTS

    assert DEFAULTS.read_bytes() == (REPO / "configs" / "defaults.yaml").read_bytes()
    assert load_config(DEFAULTS) == load_config(REPO / "configs" / "defaults.yaml")


def test_gpt3_shapes():
    shapes = {"125m": (12, 768, 12), "350m": (24, 1024, 16), "760m": (24, 1536, 16), "1_3b": (24, 2048, 16),
              "2_7b": (32, 2560, 32), "6_7b": (32, 4096, 32)}
    for name, shape in shapes.items():
        m = load_config(REPO / "configs" / f"{name}.yaml").model
        assert (m.n_layer, m.d_model, m.n_head, m.seq_len) == (*shape, 2048)
        assert m.padded_vocab_size == 50304


def test_config_is_frozen():
    cfg = load_config(TINY)
    with pytest.raises(pydantic.ValidationError):
        cfg.train.steps = 3


def test_unknown_key_in_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"extends: {TINY}\ntrain:\n  stepz: 3\n")
    assert _error(bad) == f"{bad}: train.stepz: unknown key"


def test_unknown_key_on_command_line():
    assert _error(TINY, ["optimizer.lr=1"]) == f"{TINY} (--set optimizer.lr): optimizer: unknown key"


def test_wrong_type():
    message = _error(TINY, ["train.steps=many"])
    assert message.startswith(f"{TINY} (--set train.steps): train.steps: ") and "'many'" in message


def test_bad_choice():
    message = _error(TINY, ["zero.grad_reduce=allreduce"])
    assert "zero.grad_reduce" in message and "'all_reduce'" in message and "'allreduce'" in message


def test_batch_not_divisible():
    assert _error(TINY, ["train.global_batch_size=30"]) == (
        f"{TINY} (--set train.global_batch_size): train.global_batch_size: 30 is not divisible by micro_batch_size × dp = 4 × 8 = 32")


def test_mesh_does_not_match_devices():
    assert _error(TINY, ["mesh.dp=4"]) == f"{TINY} (--set mesh.dp): mesh.dp: dp × tp = 4 × 1 = 4, but there are 8 devices"


def test_heads_must_divide_width():
    assert _error(TINY, ["model.n_head=3"]) == f"{TINY} (--set model.n_head): model: d_model=128 is not divisible by n_head=3"


def test_missing_key(tmp_path):
    bad = tmp_path / "partial.yaml"
    bad.write_text("name: x\n")
    assert _error(bad).startswith(f"{bad}: model: missing key")


def test_invalid_yaml_and_missing_file(tmp_path):
    bad = tmp_path / "broken.yaml"
    bad.write_text("train:\n  steps: [1,\n")
    assert _error(bad).startswith(f"{bad}: line ")
    assert _error(tmp_path / "nope.yaml") == f"{tmp_path / 'nope.yaml'}: cannot read config file (No such file or directory)"


def test_set_needs_key_and_value():
    assert _error(TINY, ["train.steps"]) == "--set train.steps: expected section.key=value"


def test_cli_prints_one_line_and_exits_2():
    proc = subprocess.run([sys.executable, str(REPO / "main_zero.py"), "--config", str(TINY),
                           "--set", "train.global_batch_size=30"], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: {TINY} (--set train.global_batch_size): train.global_batch_size: 30 is not divisible by micro_batch_size × dp = 4 × 8 = 32"]


def _said(overrides) -> tuple[int, list[str]]:
    """The warmup `overrides` on the tiny config (20 steps) resolve to, and the lines load_config says."""
    lines: list[str] = []
    return load_config(TINY, overrides, device_count=8, say=lines.append).train.warmup_steps, lines


def test_a_warmup_not_shorter_than_the_schedule_ends_on_its_last_step_said_in_one_line():
    assert _said(["train.steps=2"]) == (1, [
        "warning: train.warmup_steps 20 is not shorter than the lr schedule (train.steps 2): this run warms up over "
        "1 step(s) (train.warmup_steps 1); train.schedule_steps keeps the full schedule in a short run"])
    assert _said(["train.steps=20"])[0] == 19 and _said(["train.steps=1"])[0] == 0
    assert _said(["train.steps=5", "train.schedule_steps=10", "train.warmup_steps=30"]) == (9, [
        "warning: train.warmup_steps 30 is not shorter than the lr schedule (train.schedule_steps 10): this run "
        "warms up over 9 step(s) (train.warmup_steps 9)"])
    # a warmup within the schedule, a smoke run of a long schedule: as written, nothing said
    assert _said(["train.steps=21"]) == (20, []) and _said(["train.steps=5", "train.schedule_steps=300"]) == (20, [])
    # the config a run records reads back as it is
    cfg = load_config(TINY, ["train.steps=2"], device_count=8, say=lambda line: None)
    assert Config.model_validate(cfg.model_dump()) == cfg
    assert _error(TINY, ["train.steps=2", "train.warmup_steps=-1"]) == (
        f"{TINY} (--set train.warmup_steps): train.warmup_steps: Input should be greater than or equal to 0 (got -1)")


@pytest.mark.parametrize("override, key", [
    ("train.steps=true", "train.steps"), ("train.lr=yes", "train.lr"), ("mesh.dp=true", "mesh.dp"),
    ("checkpoint.keep_every=true", "checkpoint.keep_every"), ("train.steps=2.5", "train.steps"),
    ("train.seed=-1", "train.seed"), ("train.lr=.inf", "train.lr"), ("train.grad_clip=.nan", "train.grad_clip"),
    ("train.eval_sequences=-1", "train.eval_sequences"), ("train.max_consecutive_skips=0", "train.max_consecutive_skips"),
    ("data.default_vocab_size=256", "data.default_vocab_size"),
])
def test_bad_numbers_are_refused_naming_the_key(override, key):
    assert _error(TINY, [override]).startswith(f"{TINY} (--set {key}): {key}: ")


def test_renamed_key_says_its_new_name(tmp_path):
    old = tmp_path / "old.yaml"
    old.write_text(f"extends: {TINY}\ntrain:\n  eval_batches: 4\n")
    assert _error(old) == (f"{old}: train.eval_batches: renamed to train.eval_sequences (validation sequences per "
                           "evaluation, independent of dp and micro-batch)")


@pytest.mark.parametrize("args, message", [
    (["train", "--num-processes", "two"], "error: zerolm train: argument --num-processes: invalid int value: 'two'"),
    (["train", "--resume", "sometimes"], "error: zerolm train: argument --resume: invalid choice: 'sometimes'"),
    (["prepare", "--out", "x"], "error: zerolm prepare: the following arguments are required: --source"),
    (["prepare", "--source", "default", "--out", "x", "--seq-len", "abc"],
     "error: zerolm prepare: argument --seq-len: invalid int value: 'abc'"),
    (["frobnicate"], "error: zerolm: argument command: invalid choice: 'frobnicate'"),
])
def test_command_line_mistakes_are_one_line(args, message, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "zerolm.cli", *args], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.startswith(message), proc.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("overrides, message", [
    (["data.mixture=[]"], "(--set data.mixture): data.mixture: Tuple should have at least 1 item after validation, not 0"),
    (["data.dataset=mine", "data.mixture=[{dataset: default, weight: 1}]"],
     "(--set data.dataset): data.dataset: 'mine' is set beside data.mixture, which a run reads instead; put it in "
     "the mixture, or drop data.mixture"),
    (["zero.grad_reduce=all_reduce", "zero.scatter=ring"],
     "(--set zero.grad_reduce): zero.scatter: ring is how a reduce-scatter runs, and zero.grad_reduce is all_reduce, "
     "which runs none; set zero.grad_reduce=reduce_scatter, or leave scatter auto"),
    (["model.document_positions=restart"],
     "(--set model.document_positions): model.document_positions: restart counts positions from each document's "
     "start, which needs model.document_mask: true (without it a sample is one sequence)"),
])
def test_an_option_that_would_do_nothing_or_be_ignored_is_refused(overrides, message):
    """Settings that were accepted silently: an empty mixture (a traceback), a dataset whose weight rounds to no
    sample, data.dataset beside data.mixture, a reduce-scatter's algorithm without a reduce-scatter, restarted
    positions without the document mask."""
    assert _error(TINY, overrides) == f"{TINY} {message}"


def test_an_unknown_key_in_a_mixture_entry_is_the_whole_line():
    """The sweep found it behind "[and 1 more problem(s)]": the mixture's own errors that only follow from it
    (not None; a tuple left too short by its failed entry) are not more problems."""
    assert _error(TINY, ["data.mixture=[{dataset: default, weight: 1, bogus: 2}]"]) == \
        f"{TINY} (--set data.mixture): data.mixture.0.bogus: unknown key"


def test_where_tensorboard_writes_and_a_directory_without_it_is_one_line():
    cfg = load_config(TINY, ["logging.tensorboard=true"])
    assert cfg.tensorboard_dir == str(Path("runs") / "tiny" / "tensorboard")  # beside metrics.jsonl and the profile
    assert load_config(TINY, ["logging.tensorboard=true", "logging.tensorboard_dir=gs://b/tb"]).tensorboard_dir == \
        "gs://b/tb"
    assert load_config(TINY).tensorboard_dir is None
    assert _error(TINY, ["logging.tensorboard_dir=gs://b/tb"]) == (
        f"{TINY} (--set logging.tensorboard_dir): logging.tensorboard_dir: gs://b/tb is set and logging.tensorboard "
        "is false, which writes no TensorBoard events; set logging.tensorboard=true, or logging.tensorboard_dir=null")


def test_a_misspelled_key_is_named_before_the_key_it_leaves_missing():
    assert _error(TINY, ["data.mixture=[{dataset: default, weight: 1}, {dataset: default, wieght: 0.3}]"]) == \
        f"{TINY} (--set data.mixture): data.mixture.1.wieght: unknown key [and 1 more problem(s)]"


def test_a_checkpoints_config_from_before_the_model_settings_validates_as_today():
    """A mixture checkpoint's data is opened again from its config: one saved before model.position, model.bias,
    the activation, dropout, train.init_from, the lr schedules, the eval section and TensorBoard existed reads them as they were
    then (BEFORE_RECORDED)."""
    from zerolm.checkpoint.meta import CheckpointMeta
    from zerolm.config.tree import Config

    old = load_config(TINY).model_dump()
    for key in ("position", "bias", "activation", "embedding_dropout", "residual_dropout", "attention_dropout"):
        del old["model"][key]
    for key in ("init_from", "schedule", "decay_steps", "decay_shape"):
        del old["train"][key]
    del old["eval"]
    del old["zero"]["tpu_async_collectives"]
    del old["logging"]["tensorboard"], old["logging"]["tensorboard_dir"]
    meta = CheckpointMeta(step=1, time=0.0, config=old, dp=1, accum_steps=1, dataset={}, tokens_seen=0, loss=None,
                          wandb_id="x")
    cfg = Config.model_validate(meta.full_config)
    assert (cfg.model.position, cfg.model.bias, cfg.train.init_from) == ("learned", True, None)
    assert (cfg.train.schedule, cfg.train.decay_steps, cfg.train.decay_shape) == ("cosine", None, "linear")
    assert cfg.eval == load_config(TINY).eval and cfg.eval.tasks == ()
    assert cfg.zero.tpu_async_collectives == "off"  # zerolm set no libtpu flags then
    assert (cfg.logging.tensorboard, cfg.logging.tensorboard_dir) == (False, None)  # nor TensorBoard events
