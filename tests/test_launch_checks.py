"""`trident run` refuses, before it launches a rank, what the ranks would refuse only once started
(their error line and the launcher's: two lines or more): a checkpoint's torn tensor files, token
ids beyond the model's vocabulary, --init-from tensors of the wrong shape, a loss scale out of
range, --allow-change without --resume. Each in one line, exit 2; no rank is started here."""
from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch

from planner.hf_config import to_hf_config
from planner.model import ConfigError
from planner.plan import Plan
from runtime import checkpoint, launch
from runtime import train as runtime_train
from runtime.data import TokenFileData
from runtime.hf_weights import ModelDir, parameter_shapes, to_hf
from torchrun_helpers import write_plan


def one_line(capsys, entry, argv) -> str:
    """The one stderr line of `entry(argv)`, which must exit 2."""
    try:
        code = entry([str(a) for a in argv])
    except SystemExit as exc:  # argparse
        code = exc.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "Traceback" not in err[0], (code, err)
    return err[0]


@pytest.fixture
def plan(tmp_path):
    return write_plan(tmp_path, "p")


def _checkpoint(plan_path, step_dir):
    """A DCP checkpoint of a few tensors (not the model's: only its files are checked before a
    launch) with the trident.json of `plan_path` at step 2."""
    p = Plan.read(plan_path)
    with warnings.catch_warnings():  # "no process group: saving in one process", as meant
        warnings.simplefilter("ignore")
        torch.distributed.checkpoint.save({"model": {"a": torch.arange(1000.0), "b": torch.ones(50, 3)}},
                                          checkpoint_id=str(step_dir))
    (step_dir / checkpoint.META).write_text(json.dumps({
        "plan_hash": p.content_hash(), "layout": checkpoint.BY_NAME, "run": checkpoint.run_of(p), "step": 2,
        "data": {"next_step": 2}}))
    return step_dir


def test_a_checkpoint_whose_tensor_files_are_torn_is_refused_before_launching(tmp_path, plan, capsys):
    ck = tmp_path / "ck"
    _checkpoint(plan, ck / "step-2")
    args = runtime_train.parse_args(["--plan", str(plan), "--steps", "5", "--checkpoint-dir", str(ck), "--resume"])
    assert checkpoint.to_resume(args, Plan.read(plan))[0] == ck / "step-2"  # whole: resumed
    (shard,) = (ck / "step-2").glob("*.distcp")
    data = shard.read_bytes()
    shard.write_bytes(data[:-100])  # torn: shorter than the byte ranges .metadata records
    run = [plan, "--steps", 5, "--checkpoint-dir", ck, "--resume"]
    line = one_line(capsys, launch.main, run)
    assert f"checkpoint {ck / 'step-2'}: its tensor file {shard.name} holds {len(data) - 100:,} bytes where its " \
           f".metadata records {len(data):,}" in line and "delete step-2 to start from step 0" in line, line
    shard.unlink()
    _checkpoint(plan, ck / "step-1")
    line = one_line(capsys, launch.main, run)
    assert f"its tensor file {shard.name} is missing" in line and "delete step-2 to resume step-1" in line, line
    (ck / "step-2" / ".metadata").write_bytes(b"\x80not a pickle")
    assert "its .metadata cannot be read (" in one_line(capsys, launch.main, run)
    # trident export asks the same before it writes anything
    from runtime.export import main as export_main
    assert "its .metadata cannot be read" in one_line(capsys, export_main, [ck, "-o", tmp_path / "out"])
    assert not (tmp_path / "out").exists()


def _tokens(path, ids, dtype=np.uint16):
    np.asarray(ids, dtype=dtype).tofile(path)
    return path


def test_token_ids_beyond_the_vocabulary_are_refused_before_launching(tmp_path, plan, capsys):
    vocab = Plan.read(plan).model.vocab  # 512
    good = _tokens(tmp_path / "good.bin", np.arange(5000) % vocab)
    bad = _tokens(tmp_path / "bad.bin", [*(np.arange(4000) % vocab), vocab + 3, *range(99)])
    source = TokenFileData(str(bad), 32, 0, vocab)
    with pytest.raises(ConfigError, match=f"--data: token id {vocab + 3} of .*bad.bin is not below model.vocab=512"):
        source.check_ids(chunk=7)  # chunks of any size, the bad id in the middle of one
    TokenFileData(str(good), 32, 0, vocab).check_ids(chunk=7)
    for argv, says in (
            (["--data", bad, "--eval-data", good], f"--data: token id {vocab + 3} of {bad} is not below model.vocab"),
            (["--data", good, "--eval-data", bad], f"--eval-data: token id {vocab + 3} of {bad}"),
            (["--data", f"{good}:0.5,{bad}:0.5", "--eval-data", good], f"--data: token id {vocab + 3} of {bad}"),
            (["--data", good, "--eval-data", f"{good}:1,{bad}:1"], f"--eval-data: token id {vocab + 3} of {bad}")):
        line = one_line(capsys, launch.main, [plan, *argv, "--eval-every", 1])
        assert says in line and "wrong --data-dtype or tokenizer" in line, line
    # uint16 ids read as uint32: each pair one id, far beyond the vocabulary
    line = one_line(capsys, launch.main, [plan, "--data", good, "--data-dtype", "uint32", "--eval-data", good,
                                          "--eval-every", 1])
    assert "is not below model.vocab=512" in line, line


def test_a_rank_names_eval_data_for_a_bad_id_in_a_validation_batch(tmp_path, plan):
    """Where only the ranks find it (a run launched without trident run's checks), a bad id in a
    validation batch names --eval-data, the option that gave the file."""
    from types import SimpleNamespace

    from runtime.evaluate import Evaluator
    p = Plan.read(plan)
    bad = _tokens(tmp_path / "bad.bin", [p.model.vocab + 3] * 5000)
    args = SimpleNamespace(eval_every=1, eval_batches=1, steps=1, eval_data=str(bad), data_dtype=None)
    with pytest.raises(ConfigError, match=f"^--eval-data: token id {p.model.vocab + 3} of .*bad.bin"):
        Evaluator(args, p).run(SimpleNamespace(plan=p), 0)


def _model_dir(path, cfg, **shapes):
    """A transformers directory of `cfg` (config.json, model.safetensors of zeros), the tensors
    named in `shapes` (transformers' names, dots as __) of other shapes."""
    from safetensors.torch import save_file
    path.mkdir()
    hf = to_hf(cfg, {n: torch.zeros(s) for n, s in parameter_shapes(cfg).items()})
    hf.update({k.replace("__", "."): torch.zeros(s) for k, s in shapes.items()})
    save_file(hf, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(to_hf_config(cfg)))
    return path


def test_init_from_tensors_of_the_wrong_shape_are_refused_before_launching(tmp_path, plan, capsys):
    cfg = Plan.read(plan).model
    ModelDir(_model_dir(tmp_path / "good", cfg)).check(cfg, 32)
    bad = _model_dir(tmp_path / "bad", cfg, model__layers__1__mlp__up_proj__weight=(cfg.ffn_hidden, cfg.hidden + 8))
    line = one_line(capsys, launch.main, [plan, "--init-from", bad])
    assert f"--init-from: {bad}: model.layers.1.mlp.up_proj.weight has shape ({cfg.ffn_hidden}, {cfg.hidden + 8}), " \
           f"which does not make the model's layers.2.feed_forward.w3.weight of shape ({cfg.ffn_hidden}, " \
           f"{cfg.hidden})" in line, line


@pytest.mark.parametrize("value", ["1e300", "1e-300", "0.5", "nan", "inf", "5e9"])
def test_an_initial_loss_scale_out_of_range_is_refused_by_both_parsers(plan, capsys, value):
    for entry, argv in ((launch.main, [plan]), (runtime_train.main, ["--plan", plan])):
        line = one_line(capsys, entry, [*argv, "--dtype", "fp16", "--initial-loss-scale", value])
        assert f"--initial-loss-scale: {value} is outside 1 to 2^32 (4294967296)" in line, line
    for ok in ("1", "65536", str(2 ** 32)):
        assert launch.parse_args([str(plan), "--initial-loss-scale", ok]).initial_loss_scale == float(ok)
        given = runtime_train.parse_args(["--plan", str(plan), "--initial-loss-scale", ok])
        assert given.initial_loss_scale == float(ok)


def test_allow_change_without_resume_is_refused(tmp_path, plan, capsys):
    for entry, argv in ((launch.main, [plan]), (runtime_train.main, ["--plan", plan])):
        for more in ([], ["--checkpoint-dir", tmp_path / "ck"]):
            line = one_line(capsys, entry, [*argv, *more, "--allow-change", "lr"])
            assert line.startswith("trident: error: --allow-change: only with --resume"), line
